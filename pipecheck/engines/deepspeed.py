"""Check a DeepSpeed pipeline layer list against the same layers run eagerly.

    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from pipecheck.engines import deepspeed as pcds

    layers = [TiedLayerSpec("embed", nn.Embedding, 32, 16), LayerSpec(Block), LayerSpec(Block),
              TiedLayerSpec("embed", nn.Embedding, 32, 16, forward_fn=lm_head)]
    report = pcds.check(layers, tokens, num_stages=2, loss_fn=lm_loss, target=labels, n_microbatches=4)

DeepSpeed's ``PipelineModule`` builds the layers on their ranks (partitioned
as ``partition_method`` says) and runs one ``train_batch``; the reference is
the same layers applied in order in one process, every use of a tied key
sharing one module. Parameters are named as DeepSpeed names them:
``"3.weight"`` for layer 3, ``"tied_modules.embed.weight"`` for a tied key.
Raises :class:`pipecheck.EquivalenceError` with the failure table, or
:class:`pipecheck.EngineError` when DeepSpeed cannot run the list (refused
before any rank starts where pipecheck can tell); returns the Report.

DeepSpeed feeds the first layer detached inputs, so input gradients are not
compared. Layers must pickle (classes and functions defined at module level).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipecheck._check.equivalence import assert_equivalent
from pipecheck._check.numerics import ToleranceLike
from pipecheck._check.report import Report
from pipecheck._runners.deepspeed.driver import DeepSpeedLayersRunner, build_layer_list
from pipecheck._split.inputs import detached_batch
from pipecheck.losses import LossFn

if TYPE_CHECKING:
    from pipecheck._world.world import World

__all__ = ["check"]


def check(layers: Sequence[Any], inputs: Any, *, num_stages: int, loss_fn: LossFn | None = None,
          target: Any = None, n_microbatches: int = 1, partition_method: str = "parameters",
          tolerance: ToleranceLike = "auto", seed: int = 0, world: World | None = None,
          timeout: float | None = None) -> Report:
    """One training step of ``layers`` through DeepSpeed's PipelineEngine on ``num_stages`` ranks,
    compared with the same layers run eagerly (outputs, loss, every gradient, buffers).

    ``inputs`` is what DeepSpeed's data iterator yields as the first layer's input for the whole
    batch (a tensor or a tuple of tensors), split on dim 0 into ``n_microbatches``.
    """
    runner = DeepSpeedLayersRunner(layers, num_stages, partition_method)
    inputs = detached_batch(inputs)
    return assert_equivalent(functools.partial(build_layer_list, runner.layers, runner.parts), (inputs,),
                             loss_fn=loss_fn, target=target, n_microbatches=n_microbatches, runner=runner,
                             tolerance=tolerance, seed=seed, world=world, world_size=num_stages,
                             timeout=timeout)
