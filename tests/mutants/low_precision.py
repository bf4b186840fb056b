"""Correct runners that sum in their own order, and planted bugs, for checks in bfloat16 and float16.

    pc.assert_equivalent(factory, args, runner=BUGS["stage 0 x0.99"], dtype=torch.bfloat16, ...)

Each is pipecheck's reference runner with one step changed, in this process. The correct ones are
engines pipecheck did not write: each micro-batch's step on its own, summed last first after dividing
(not the reference's association), and a main_grad engine that accumulates in float32 and reports
float32 gradients. The bugs are those that exist in bfloat16 as in float32 (a lost micro-batch, a
tied replica's share, a rescale off by 1% or 10%, outputs merged in the wrong order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import pipecheck as pc
from pipecheck import split_microbatches

# private: planted bugs are the reference runner with one of its steps changed
from pipecheck._runners.base import run_reference
from pipecheck._runtime.reference import Accumulation, DetachExecutor

Runner = Callable[[pc.Job], pc.StepResult]


def _named(name: str, run: Runner) -> Runner:
    run.__name__ = name
    return run


def _microbatch_steps(job: pc.Job) -> list[pc.StepResult]:
    """Each micro-batch's step on its own (one split: each sees the buffers the last one left)."""
    n = job.n_microbatches
    inputs = split_microbatches((job.args, job.kwargs), n)
    targets = split_microbatches(job.target, n, "target") if job.target is not None else [None] * n
    executor = DetachExecutor(job.split())
    return [executor.step(args, kwargs, loss_fn=job.loss_fn, target=target)
            for (args, kwargs), target in zip(inputs, targets)]


def summed_last_first(job: pc.Job) -> pc.StepResult:
    """Correct: each micro-batch's gradient divided by n, then summed last micro-batch first; the loss
    as DeepSpeed's train_batch sums it (the micro-batches' losses added one by one, then divided)."""
    whole = run_reference(job)
    steps = _microbatch_steps(job)
    n = job.n_microbatches
    grads = {}
    for fqn in whole.grads:
        total = steps[-1].grads[fqn] / n
        for step in reversed(steps[:-1]):
            total = total + step.grads[fqn] / n
        grads[fqn] = total
    loss = steps[0].loss
    for step in steps[1:]:
        loss = loss + step.loss
    return dataclasses.replace(whole, grads=grads, loss=loss / n, stage_grads=[], replica_grads={})


def main_grad_float32(job: pc.Job) -> pc.StepResult:
    """Correct: gradients accumulated over the micro-batches in float32 and reported in float32."""
    with job.structure().buffers_restored() as pipe:
        return DetachExecutor(pipe, accumulation=Accumulation(dtype=torch.float32)).step(
            job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target, n_microbatches=job.n_microbatches)


def _scaled(name: str, factor: float, stage: int | None) -> Runner:
    def run(job: pc.Job) -> pc.StepResult:
        result = run_reference(job)
        names = set(job.structure().stages[stage].local_to_fqn.values()) if stage is not None else set(result.grads)
        grads = {fqn: grad * factor if fqn in names else grad for fqn, grad in result.grads.items()}
        return dataclasses.replace(result, grads=grads, stage_grads=[], replica_grads={})
    return _named(name, run)


def microbatch_dropped(job: pc.Job) -> pc.StepResult:
    """Micro-batch 1's gradients never accumulated (its outputs and loss are right)."""
    result = run_reference(job)
    steps = _microbatch_steps(job)
    n = job.n_microbatches
    grads = {}
    for fqn in result.grads:
        total = None
        for mb, step in enumerate(steps):
            if mb != 1:
                total = step.grads[fqn] / n if total is None else total + step.grads[fqn] / n
        grads[fqn] = total
    return dataclasses.replace(result, grads=grads, stage_grads=[], replica_grads={})


def tied_share_missing(job: pc.Job) -> pc.StepResult:
    """A tied parameter's gradient is its first replica's stage's share alone."""
    result = run_reference(job)
    grads = dict(result.grads)
    for group in job.structure().tied_groups:
        first = min(group.stages)
        grads[group.fqn] = result.stage_grads[first][group.fqn]
    return dataclasses.replace(result, grads=grads, stage_grads=[], replica_grads={})


def outputs_swapped(job: pc.Job) -> pc.StepResult:
    """Micro-batches 0 and 1's outputs merged in each other's place."""
    result = run_reference(job)
    n = job.n_microbatches

    def swap(value: object) -> object:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] % n:
            return value
        chunks = list(value.chunk(n))
        chunks[0], chunks[1] = chunks[1], chunks[0]
        return torch.cat(chunks)

    return dataclasses.replace(result, outputs=torch.utils._pytree.tree_map(swap, result.outputs))


CORRECT: dict[str, Runner | str] = {
    "reference": "reference",
    "summed last first": _named("summed_last_first", summed_last_first),
    "float32 main_grad": _named("main_grad_float32", main_grad_float32),
}

BUGS: dict[str, Runner] = {
    "all grads x0.9": _scaled("all_x0.9", 0.9, None),
    "stage 0 x0.9": _scaled("stage0_x0.9", 0.9, 0),
    "stage 0 x0.99": _scaled("stage0_x0.99", 0.99, 0),
    "micro-batch 1 dropped": _named("microbatch_dropped", microbatch_dropped),
    "tied share missing": _named("tied_share_missing", tied_share_missing),
    "outputs of mb 0, 1 swapped": _named("outputs_swapped", outputs_swapped),
}


def summed_in_bfloat16(job: pc.Job) -> pc.StepResult:
    """Promised float32 gradient accumulation (pc.Precision(grad_accumulation=torch.float32)), summed in
    the parameters' bfloat16: the bug Megatron's main_grad and DeepSpeed's bf16 optimizer exist to avoid."""
    with job.structure().buffers_restored() as pipe:
        return DetachExecutor(pipe, precision=pc.Precision(autocast=job.precision.autocast)).step(
            job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target, n_microbatches=job.n_microbatches)


summed_in_bfloat16.follows_precision = True  # type: ignore[attr-defined]  # it says so, and does not
