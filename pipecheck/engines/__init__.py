"""Checks built around other pipeline engines, one module each.

    import pipecheck as pc
    pc.engines.deepspeed.check(layers, x, num_stages=2, n_microbatches=4)        # a DeepSpeed layer list
    pc.engines.torchtitan.check(make_model, (tokens,), module_names_per_stage=[["tok_embeddings", ...], ...])
    pc.engines.megatron.check(make_model, (tokens,), n_microbatches=4, batch_p2p_comm=False)  # Megatron Core

Each needs its engine installed (``pip install "torch-pipecheck[deepspeed]"``,
``"torch-pipecheck[torchtitan]"``, ``"torch-pipecheck[megatron]"``), and imports it only when a check runs.
The same engines also run any model pipecheck splits: ``pc.assert_equivalent(model,
args, runner="deepspeed")``, ``runner="torchtitan"`` or ``runner="megatron"``.
"""

from __future__ import annotations

import importlib
import typing

__all__ = ["deepspeed", "megatron", "torchtitan"]


def __getattr__(name: str) -> typing.Any:
    if name in __all__:
        module = importlib.import_module(f"pipecheck.engines.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'pipecheck.engines' has no attribute {name!r}")


if typing.TYPE_CHECKING:
    from pipecheck.engines import deepspeed, megatron, torchtitan
