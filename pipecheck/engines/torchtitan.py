"""Check a model split the torchtitan way against the same model run eagerly.

    from pipecheck.engines import torchtitan as pctt

    names = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    report = pctt.check(make_model, (tokens,), module_names_per_stage=names, loss_fn=lm_loss,
                        target=labels, n_microbatches=4, schedule="1f1b")

torchtitan's ``_pipeline_module_split`` keeps each stage's modules in a copy of
the whole model, its ``_build_pipeline_schedule`` builds the schedule, and one
step runs on pipecheck's World (one rank per stage, or ``stages_per_rank`` for
the interleaved and "V" schedules). The cut pipecheck compares against is the
one the names describe: each stage after the first starts at its first module.
Names torchtitan would silently ignore (nested ones, a whole ModuleList) and a
forward() that cannot run without a stage's removed modules are refused with
the reason; what torchtitan computes wrong without an error fails the check.
``runner="torchtitan"`` in :func:`pipecheck.assert_equivalent` derives the names
from any cut instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipecheck._check.equivalence import assert_equivalent
from pipecheck._check.numerics import ToleranceLike
from pipecheck._check.report import Report
from pipecheck._runners.torchtitan.driver import TorchtitanRunner
from pipecheck._split.markers import SplitPoint
from pipecheck.losses import LossFn

if TYPE_CHECKING:
    from pipecheck._world.world import World

__all__ = ["check"]


def check(model: Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
          module_names_per_stage: Sequence[Sequence[str]], loss_fn: LossFn | None = None, target: Any = None,
          n_microbatches: int = 1, schedule: str = "1f1b", stages_per_rank: int = 1,
          tolerance: ToleranceLike = "auto", seed: int = 0, world: World | None = None,
          timeout: float | None = None) -> Report:
    """One training step of ``model`` through torchtitan's split into ``module_names_per_stage``
    and its schedule, compared with the model run eagerly (outputs, loss, every gradient, buffers).

    ``schedule`` is pipecheck's name ("gpipe", "1f1b", "interleaved") or torch's ("ZBVZeroBubble", ...).
    """
    split_spec = {stage[0]: SplitPoint.BEGINNING for stage in list(module_names_per_stage)[1:] if stage}
    return assert_equivalent(model, args, kwargs, split_spec=split_spec, loss_fn=loss_fn, target=target,
                             n_microbatches=n_microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
                             runner=TorchtitanRunner(module_names_per_stage), tolerance=tolerance, seed=seed,
                             world=world, timeout=timeout)
