"""pipecheck: verify that a pipeline-parallel PyTorch model computes what the eager model computes.

    import pipecheck as pc

    pipe = pc.split(model, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING})
    res = pc.DetachExecutor(pipe).step((x,), n_microbatches=4)
    pc.assert_equivalent(model, (x,), split_spec=..., n_microbatches=4, runner="reference")
"""

from pipecheck import losses, policies, schedules
from pipecheck._check import assert_equivalent
from pipecheck._errors import (
    EngineError,
    EquivalenceError,
    InputError,
    LossError,
    NonFiniteError,
    PipecheckError,
    ScheduleError,
    SplitError,
    TraceError,
    WorldError,
)
from pipecheck._job import Job, ModelFactory, Runner
from pipecheck._markers import SplitPoint, pipe_split
from pipecheck._microbatch import merge_microbatches, split_microbatches
from pipecheck._numerics import Tolerance
from pipecheck._pipe import Edge, Pipe, Source, Stage, TiedGroup, split
from pipecheck._reference import DetachExecutor
from pipecheck._report import Report
from pipecheck._result import StepResult

__version__ = "0.1.0"

__all__ = [
    "DetachExecutor",
    "Edge",
    "EngineError",
    "EquivalenceError",
    "InputError",
    "Job",
    "LossError",
    "ModelFactory",
    "NonFiniteError",
    "Pipe",
    "PipecheckError",
    "Report",
    "Runner",
    "ScheduleError",
    "Source",
    "SplitError",
    "SplitPoint",
    "Stage",
    "StepResult",
    "TiedGroup",
    "Tolerance",
    "TraceError",
    "WorldError",
    "assert_equivalent",
    "losses",
    "merge_microbatches",
    "pipe_split",
    "policies",
    "schedules",
    "split",
    "split_microbatches",
]
