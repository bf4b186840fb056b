"""Check a model through Megatron Core's pipeline schedules, with Megatron's own settings.

    from pipecheck.engines import megatron as pcm

    report = pcm.check(make_model, (tokens,), loss_fn=lm_loss, target=labels, n_microbatches=4)
    report = pcm.check(make_model, (tokens,), schedule="interleaved", stages_per_rank=2,
                       batch_p2p_comm=False)                      # a TransformerConfig knob
    pc.assert_equivalent(model, (x,), runner=pcm.MegatronRunner(overlap_p2p_comm=True), ...)

pipecheck's split runs as Megatron model chunks through ``forward_backward_func`` and
``finalize_model_grads`` on pipecheck's World (CPU, gloo); ``runner="megatron"`` is the same with
Megatron Core's defaults. Needs ``pip install "pipecheck[megatron]"`` (megatron-core 0.16).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipecheck._check.equivalence import assert_equivalent
from pipecheck._check.numerics import ToleranceLike
from pipecheck._check.report import Report
from pipecheck._runners.megatron.driver import MegatronRunner
from pipecheck.losses import LossFn

if TYPE_CHECKING:
    from pipecheck._world.world import World

__all__ = ["MegatronRunner", "check"]


def check(model: Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
          split_spec: Mapping[str, Any] | None = None, policy: Any = None, loss_fn: LossFn | None = None,
          target: Any = None, n_microbatches: int = 1, schedule: str = "1f1b", stages_per_rank: int = 1,
          tolerance: ToleranceLike = "auto", seed: int = 0, world: World | None = None,
          timeout: float | None = None, **megatron_config: Any) -> Report:
    """One training step of ``model``, cut as pipecheck cuts it (markers, ``split_spec`` or ``policy``),
    through Megatron Core's 1F1B (``schedule="1f1b"``) or interleaved schedule, compared with the
    model run eagerly. ``megatron_config``: Megatron's ``TransformerConfig`` knobs (``batch_p2p_comm``,
    ``overlap_p2p_comm``, ...); the rest are Megatron's defaults."""
    return assert_equivalent(model, args, kwargs, split_spec=split_spec, policy=policy, loss_fn=loss_fn,
                             target=target, n_microbatches=n_microbatches, schedule=schedule,
                             stages_per_rank=stages_per_rank, runner=MegatronRunner(**megatron_config),
                             tolerance=tolerance, seed=seed, world=world, timeout=timeout)
