"""The built-in runners' training loops: ``runner.train(job) -> list[StepResult]``, one per optimizer step.

    results = train_reference(job)      # DetachExecutor, in this process
    results = train_distributed(job)    # pipecheck's runtime on a World, the engine kept across steps

Each result holds the optimizer step's loss (its schedule steps' micro-batch losses, weighted by the
job's loss convention, summed), its outputs (one per schedule step: a tuple when it accumulates), the
gradients before the optimizer and every parameter and tied replica after it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._core.result import StepResult
from pipecheck._runners.base import merge_stage_grads, run_engine, run_reference, world_for
from pipecheck._runners.engine import EngineRunner
from pipecheck._runners.job import Job
from pipecheck._runtime.optimizer import StageOptimizer
from pipecheck._runtime.reference import DetachExecutor, weighted_loss
from pipecheck._runtime.stage_step import add_param_grads
from pipecheck._runtime.training import RankTraining, TrainSpec, rank_train
from pipecheck._split.microbatch import merge_microbatches
from pipecheck._split.pipe import Pipe
from pipecheck.losses import Reduction


def reductions(job: Job) -> list[Reduction]:
    """Each schedule step's loss weighting, from the job's convention over its optimizer step."""
    training = job.training
    found = []
    for batches in job.optimizer_steps():
        reduction = Reduction.of(training.loss_reduction, [b.target for b in batches], job.n_microbatches,
                                 training.ignore_index)
        found += [reduction] * len(batches)
    return found


def _outputs(per_schedule_step: Sequence[Any]) -> Any:
    return per_schedule_step[0] if len(per_schedule_step) == 1 else tuple(per_schedule_step)


def train_reference(job: Job) -> list[StepResult]:
    """The training loop on one private copy of the job's split, stage by stage in this process."""
    pipe = job.split()
    optimizer = StageOptimizer(pipe.stages, job.training.optimizer)
    weights = reductions(job)
    results = []
    i = 0
    for batches in job.optimizer_steps():
        started = time.perf_counter()
        grads: dict[str, torch.Tensor] = {}
        outputs: list[Any] = []
        losses: list[torch.Tensor] = []
        for batch in batches:
            step = DetachExecutor(pipe).step(batch.args, dict(batch.kwargs), loss_fn=job.loss_fn, target=batch.target,
                                             n_microbatches=job.n_microbatches, reduction=weights[i])
            add_param_grads(grads, step.grads)
            outputs.append(step.outputs)
            losses.append(step.loss if step.loss is not None else torch.zeros(()))
            i += 1
        by_stage = {s.index: {fqn: grads[fqn] for fqn in s.params if fqn in grads} for s in pipe.stages}
        optimizer.step(by_stage, job.training.clip_grad_norm,
                       counts=lambda stage, fqn: stage == min(pipe.param_stages(fqn)))
        params, replicas = merge_stage_grads(optimizer.params_after(), pipe.tied_groups)
        results.append(StepResult(_outputs(outputs), torch.stack(losses).sum(), {f: g.clone() for f, g in grads.items()},
                                  buffers=pipe.buffers_after_step(), params=params, replica_params=replicas,
                                  timings={"step_s": time.perf_counter() - started}))
    return results


def train_distributed(runner: EngineRunner, job: Job) -> list[StepResult]:
    """The training loop on the job's World: every rank keeps its stages and optimizer across steps."""
    pipe = job.structure()
    first = job.schedule_batches()[0]
    step = runner.plan(dataclasses.replace(job, args=first.args, kwargs=dict(first.kwargs), target=first.target), pipe)
    weights = tuple(reductions(job))
    spec = TrainSpec(dataclasses.replace(step, reduction=weights[0]), tuple(job.schedule_batches()), weights,
                     job.training)
    world = world_for(job, runner.n_ranks(job, pipe, step), runner.label)
    started = time.perf_counter()
    reports: list[RankTraining] = run_engine(world, rank_train, spec, job,
                                             lambda err: runner.world_failed(err, job, step))
    ran = time.perf_counter() - started
    runner.raise_reported(job, step, reports)
    g = job.training.accumulation_steps
    results = [_merge_step(pipe, [r.steps[t] for r in reports], job, weights[t * g:(t + 1) * g])
               for t in range(job.training.steps)]
    for result in results:
        result.timings["step_s"] = ran / len(results)
    return results


def _merge_step(pipe: Pipe, reports: Sequence[Any], job: Job, weights: Sequence[Reduction]) -> StepResult:
    g = job.training.accumulation_steps
    outputs, loss = [], torch.zeros(())
    for a in range(g):
        by_mb: dict[int, list[Any]] = {}
        losses: dict[int, torch.Tensor] = {}
        for report in reports:
            by_mb.update(report.outputs[a])
            losses.update(report.losses[a])
        n = job.n_microbatches
        outputs.append(merge_microbatches([pytree.tree_unflatten(by_mb[m], pipe.out_spec) for m in range(n)]))
        loss = loss + weighted_loss([losses[m] for m in range(n)], weights[a])
    stage_grads, params, buffers = {}, {}, {}
    for report in reports:
        stage_grads.update(report.stage_grads)
        params.update(report.params)
        buffers.update(report.buffers)
    grads, replica_grads = merge_stage_grads(stage_grads, pipe.tied_groups)
    merged_params, replica_params = merge_stage_grads(params, pipe.tied_groups)
    merged_buffers: dict[str, torch.Tensor] = {}
    for s in sorted(buffers):
        merged_buffers.update(buffers[s])
    return StepResult(_outputs(outputs), loss, grads, buffers=merged_buffers, replica_grads=replica_grads,
                      stage_grads=[stage_grads.get(s, {}) for s in range(pipe.num_stages)], params=merged_params,
                      replica_params=replica_params)


class ReferenceRunner:
    """The "reference" runner: one step (``runner(job)``) or a training loop (``runner.train(job)``)."""

    __name__ = "reference"

    def __call__(self, job: Job) -> StepResult:
        return run_reference(job)

    def train(self, job: Job) -> list[StepResult]:
        return train_reference(job)


reference_runner = ReferenceRunner()
