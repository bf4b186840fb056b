"""The built-in runners, by name: "reference", "distributed", "torch"."""

from __future__ import annotations

from typing import Any

from pipecheck._errors import InputError
from pipecheck._job import Job, Runner
from pipecheck._reference import DetachExecutor
from pipecheck._result import StepResult

BUILTIN = ("reference", "distributed", "torch")


def run_reference(job: Job) -> StepResult:
    """pipecheck's single-process reference: DetachExecutor on the job's split."""
    return DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                            n_microbatches=job.n_microbatches)


def resolve_runner(runner: Any) -> tuple[str, Runner]:
    if runner == "reference":
        return "reference", run_reference
    if runner == "distributed":
        from pipecheck._runtime import run_distributed

        return "distributed", run_distributed
    if runner == "torch":
        from pipecheck._torch_runner import run_torch

        return "torch", run_torch
    if callable(runner):
        return getattr(runner, "__name__", type(runner).__name__), runner
    raise InputError(f"runner={runner!r} is not known. Fix: use one of {list(BUILTIN)} or a callable "
                     "runner(job: pc.Job) -> pc.StepResult.")
