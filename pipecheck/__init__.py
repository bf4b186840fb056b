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
    "AdapterError": "pipecheck._errors",
    "assert_equivalent": "pipecheck._check",
    "Boundaries": "pipecheck._boundaries",
    "DetachExecutor": "pipecheck._reference",
    "Divergence": "pipecheck._boundaries",
    "Edge": "pipecheck._pipe",
    "EngineError": "pipecheck._errors",
    "EquivalenceError": "pipecheck._errors",
    "InputError": "pipecheck._errors",
    "Job": "pipecheck._job",
    "LossError": "pipecheck._errors",
    "ModelFactory": "pipecheck._model_factory",
    "NonFiniteError": "pipecheck._errors",
    "Pipe": "pipecheck._pipe",
    "PipecheckError": "pipecheck._errors",
    "PowerError": "pipecheck._errors",
    "Report": "pipecheck._report",
    "Runner": "pipecheck._job",
    "Replicated": "pipecheck._microbatch",
    "ScheduleError": "pipecheck._errors",
    "Source": "pipecheck._pipe",
    "SplitError": "pipecheck._errors",
    "SplitPoint": "pipecheck._markers",
    "Stage": "pipecheck._pipe",
    "StepResult": "pipecheck._result",
    "TiedGroup": "pipecheck._pipe",
    "Tolerance": "pipecheck._numerics",
    "TraceError": "pipecheck._errors",
    "World": "pipecheck._world",
    "WorldError": "pipecheck._errors",
    "merge_microbatches": "pipecheck._microbatch",
    "pipe_split": "pipecheck._markers",
    "run_pipeline": "pipecheck._distributed_runner",
    "split": "pipecheck._pipe",
    "split_microbatches": "pipecheck._microbatch",
}
_SUBMODULES = ("engines", "losses", "policies", "schedules", "strategies")

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
    from pipecheck import engines, losses, policies, schedules, strategies
    from pipecheck._boundaries import Boundaries, Divergence
    from pipecheck._check import assert_equivalent
    from pipecheck._distributed_runner import run_pipeline
    from pipecheck._errors import (
        AdapterError,
        EngineError,
        EquivalenceError,
        InputError,
        LossError,
        NonFiniteError,
        PipecheckError,
        PowerError,
        ScheduleError,
        SplitError,
        TraceError,
        WorldError,
    )
    from pipecheck._job import Job, Runner
    from pipecheck._markers import SplitPoint, pipe_split
    from pipecheck._microbatch import Replicated, merge_microbatches, split_microbatches
    from pipecheck._model_factory import ModelFactory
    from pipecheck._numerics import Tolerance
    from pipecheck._pipe import Edge, Pipe, Source, Stage, TiedGroup, split
    from pipecheck._reference import DetachExecutor
    from pipecheck._report import Report
    from pipecheck._result import StepResult
    from pipecheck._world import World
