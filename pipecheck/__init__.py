"""pipecheck: verify that a pipeline-parallel PyTorch model computes what the eager model computes.

    import pipecheck as pc

    pipe = pc.split(model, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING})
    res = pc.DetachExecutor(pipe).step((x,), n_microbatches=4)
    pc.assert_equivalent(model, (x,), split_spec=..., n_microbatches=4, runner="reference")

Names are loaded on first use, so ``import pipecheck`` (and the pytest plugin)
stays cheap until something is actually used.
"""

from __future__ import annotations

import importlib
import typing  # a module, so no typing names leak into the public namespace

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AdapterError": "pipecheck.errors",
    "Batch": "pipecheck._core.training",
    "assert_equivalent": "pipecheck._check.equivalence",
    "Boundaries": "pipecheck._runtime.boundaries",
    "DetachExecutor": "pipecheck._runtime.reference",
    "Divergence": "pipecheck._runtime.boundaries",
    "Edge": "pipecheck._split.pipe",
    "EngineError": "pipecheck.errors",
    "EquivalenceError": "pipecheck.errors",
    "InputError": "pipecheck.errors",
    "Job": "pipecheck._runners.job",
    "LossError": "pipecheck.errors",
    "ModelFactory": "pipecheck._split.model_factory",
    "NonFiniteError": "pipecheck.errors",
    "Pipe": "pipecheck._split.pipe",
    "PipecheckError": "pipecheck.errors",
    "PowerError": "pipecheck.errors",
    "Precision": "pipecheck._core.precision",
    "Report": "pipecheck._check.report",
    "Runner": "pipecheck._runners.job",
    "Replicated": "pipecheck._split.microbatch",
    "RecordingError": "pipecheck.errors",
    "ScheduleError": "pipecheck.errors",
    "Source": "pipecheck._split.pipe",
    "SplitError": "pipecheck.errors",
    "SplitPoint": "pipecheck._split.markers",
    "Stage": "pipecheck._split.pipe",
    "StageRecorder": "pipecheck._runtime.stage_recorder",
    "StepResult": "pipecheck._core.result",
    "TiedGroup": "pipecheck._split.pipe",
    "Tolerance": "pipecheck._check.numerics",
    "TraceError": "pipecheck.errors",
    "World": "pipecheck._world.world",
    "WorldError": "pipecheck.errors",
    "RankDiedError": "pipecheck.errors",
    "RankFailedError": "pipecheck.errors",
    "RankTimeoutError": "pipecheck.errors",
    "TaskPickleError": "pipecheck.errors",
    "UsageError": "pipecheck.errors",
    "WorldStartError": "pipecheck.errors",
    "merge_microbatches": "pipecheck._split.microbatch",
    "pipe_split": "pipecheck._split.markers",
    "run_pipeline": "pipecheck._runners.runtime.driver",
    "split": "pipecheck._split.pipe",
    "split_microbatches": "pipecheck._split.microbatch",
}
_SUBMODULES = ("engines", "errors", "losses", "policies", "randomness", "schedules", "strategies")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> typing.Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pipecheck.{name}")
    else:
        raise AttributeError(f"module 'pipecheck' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if typing.TYPE_CHECKING:
    from pipecheck import engines, errors, losses, policies, randomness, schedules, strategies
    from pipecheck._check.equivalence import assert_equivalent
    from pipecheck._check.numerics import Tolerance
    from pipecheck._check.report import Report
    from pipecheck._core.precision import Precision
    from pipecheck._core.result import StepResult
    from pipecheck._runners.job import Job, Runner
    from pipecheck._runners.runtime.driver import run_pipeline
    from pipecheck._runtime.boundaries import Boundaries, Divergence
    from pipecheck._runtime.reference import DetachExecutor
    from pipecheck._runtime.stage_recorder import StageRecorder
    from pipecheck._split.markers import SplitPoint, pipe_split
    from pipecheck._split.microbatch import Replicated, merge_microbatches, split_microbatches
    from pipecheck._split.model_factory import ModelFactory
    from pipecheck._split.pipe import Edge, Pipe, Source, Stage, TiedGroup, split
    from pipecheck._world.world import World
    from pipecheck.errors import (
        AdapterError,
        EngineError,
        EquivalenceError,
        InputError,
        LossError,
        NonFiniteError,
        PipecheckError,
        PowerError,
        RankDiedError,
        RankFailedError,
        RankTimeoutError,
        RecordingError,
        ScheduleError,
        SplitError,
        TaskPickleError,
        TraceError,
        UsageError,
        WorldError,
        WorldStartError,
    )
