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
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._core.result import StepResult
from pipecheck._runners.base import (
    merge_stage_grads,
    run_engine,
    run_reference,
    stage_state_on,
    world_for,
)
from pipecheck._runners.engine import EngineRunner
from pipecheck._runners.job import Job
from pipecheck._runtime.optimizer import StageOptimizer
from pipecheck._runtime.randomness import schedule_step
from pipecheck._runtime.reference import DetachExecutor, weighted_loss
from pipecheck._runtime.stage_step import add_param_grads
from pipecheck._runtime.training import TrainSpec, rank_train
from pipecheck._split.microbatch import merge_microbatches, shard_batch
from pipecheck._split.pipe import Pipe
from pipecheck._world.world import World
from pipecheck.errors import InputError, plural
from pipecheck.losses import Reduction


def reductions(job: Job) -> list[Reduction]:
    """Each schedule step's loss weighting, from the job's convention over its optimizer step."""
    training = job.training
    found = []
    for batches in job.optimizer_steps():  # every micro-batch of every replica weighs in
        reduction = Reduction.of(training.loss_reduction, [b.target for b in batches],
                                 job.n_microbatches * training.data_parallel, training.ignore_index)
        found += [reduction] * len(batches)
    return found


def _outputs(per_schedule_step: Sequence[Any]) -> Any:
    return per_schedule_step[0] if len(per_schedule_step) == 1 else tuple(per_schedule_step)


def train_reference(job: Job) -> list[StepResult]:
    """The training loop on private copies of the job's split (one per data-parallel replica), stage by
    stage in this process."""
    d = job.training.data_parallel
    pipes = [job.split() for _ in range(d)]
    seed = job.training.random_seed
    optimizers = [StageOptimizer(pipe.stages, job.training.optimizer) for pipe in pipes]
    weights = reductions(job)
    first_holder = {fqn: min(pipes[0].param_stages(fqn)) for s in pipes[0].stages for fqn in s.params}

    def counted(stage: int, fqn: str) -> bool:  # each parameter in the clipping norm once
        return stage == first_holder.get(fqn)

    results = []
    i = 0
    for batches in job.optimizer_steps():
        started = time.perf_counter()
        grads: list[dict[str, torch.Tensor]] = [{} for _ in pipes]
        outputs: list[Any] = []
        losses: list[torch.Tensor] = []
        for batch in batches:
            uneven = weights[i].uneven
            shards = shard_batch((batch.args, dict(batch.kwargs)), d, uneven)
            targets = shard_batch(batch.target, d, uneven, "target")
            replica_outputs = []
            for r, (pipe, (args, kwargs), target) in enumerate(zip(pipes, shards, targets)):
                g = job.training.accumulation_steps
                with schedule_step(seed, i // g, i % g, r * job.n_microbatches) if seed is not None else nullcontext():
                    step = DetachExecutor(pipe).step(args, kwargs, loss_fn=job.loss_fn, target=target,
                                                     n_microbatches=job.n_microbatches, reduction=weights[i])
                add_param_grads(grads[r], step.grads)
                replica_outputs.append(step.outputs)
                losses.append(step.loss if step.loss is not None else torch.zeros(()))
            outputs.append(merge_microbatches(replica_outputs))
            i += 1
        total = _summed(grads)  # the data-parallel all-reduce
        for pipe, optimizer in zip(pipes, optimizers):
            by_stage = {s.index: {fqn: total[fqn] for fqn in s.params if fqn in total} for s in pipe.stages}
            optimizer.step(by_stage, job.training.clip_grad_norm,
                           counts=counted)
        after = [optimizer.params_after() for optimizer in optimizers]
        params, replicas = merge_stage_grads(after[0], pipes[0].tied_groups)
        result = StepResult(_outputs(outputs), torch.stack(losses).sum(), {f: g.clone() for f, g in total.items()},
                            buffers=pipes[0].buffers_after_step() if d == 1 else {}, params=params,
                            replica_params=replicas, timings={"step_s": time.perf_counter() - started})
        for r in range(1, d):
            for stage, by_fqn in after[r].items():
                for fqn, value in by_fqn.items():
                    result.dp_params.setdefault(fqn, {})[(r, stage)] = value
                    if fqn in total:  # a frozen parameter, or one without a gradient, has none
                        result.dp_grads.setdefault(fqn, {})[(r, stage)] = total[fqn].clone()
        results.append(result)
    return results


def _summed(per_replica: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    total: dict[str, torch.Tensor] = {}
    for grads in per_replica:
        add_param_grads(total, grads)
    return total


def train_distributed(runner: EngineRunner, job: Job) -> list[StepResult]:
    """The training loop on the job's World: every rank keeps its stages and optimizer across steps;
    with ``data_parallel`` d, the World holds d pipelines."""
    pipe = job.structure()
    first = job.schedule_batches()[0]
    step = runner.plan(job.with_batch(first), pipe)
    weights = tuple(reductions(job))
    spec = TrainSpec(dataclasses.replace(step, reduction=weights[0]), tuple(job.schedule_batches()), weights,
                     job.training)
    d = job.training.data_parallel
    p = runner.n_ranks(job, pipe, step)
    if d > 1:
        check_replica_world(job, p, "a pipeline of " + plural(p, "rank"))
    world = world_for(dataclasses.replace(job, world_size=None) if d > 1 else job, d * p, runner.label)
    with stage_state_on(world, job, pipe, step.recipe) as state:  # ranks build their own stages, with these values
        spec = dataclasses.replace(spec, step=dataclasses.replace(spec.step, state=state))
        reports, ran = run_training(runner, world, job, rank_train, spec, step)
    g = job.training.accumulation_steps
    results = [merge_step(pipe, [r.steps[t] for r in reports], job, weights[t * g:(t + 1) * g])
               for t in range(job.training.steps)]
    for result in results:
        result.timings["step_s"] = ran / len(results)
    return results


def check_replica_world(job: Job, p: int, pipeline: str) -> None:
    """An InputError unless the job's World (or world_size) holds data_parallel x ``p`` ranks."""
    d = job.training.data_parallel
    asked = job.world.world_size if job.world is not None else job.world_size
    if asked is not None and asked != d * p:
        raise InputError(f"data_parallel={d} replicas of {pipeline} need {d * p} ranks, but "
                         f"{'the World has' if job.world is not None else 'world_size is'} {asked}. Fix: "
                         f"World({d * p}) / world_size={d * p}, or data_parallel={max(1, asked // p)}.")


def refuse_data_parallel(job: Job, runner: str, why: str) -> None:
    """An InputError for ``data_parallel`` > 1 on a runner that trains one pipeline, saying ``why``."""
    if job.training.data_parallel > 1:
        raise InputError(f"runner={runner!r} with data_parallel={job.training.data_parallel}: {why}. Fix: "
                         "data_parallel=1, or runner='distributed' or runner='deepspeed' (each runs its own "
                         "data parallel).")


def run_training(runner: EngineRunner, world: World, job: Job, rank_fn: Callable[..., Any], spec: Any,
                 step: Any) -> tuple[list[Any], float]:
    """Every rank's training loop on ``world`` in one job: their reports (a rank's own failure raised as
    the runner's EngineError) and the seconds the ranks ran."""
    runner.check_world(job, world)
    started = time.perf_counter()
    reports = run_engine(world, rank_fn, spec, job, lambda err: runner.world_failed(err, job, step))
    ran = time.perf_counter() - started
    runner.raise_reported(job, step, reports)
    return reports, ran


def merge_step(pipe: Pipe, reports: Sequence[Any], job: Job, weights: Sequence[Reduction]) -> StepResult:
    d, n = job.training.data_parallel, job.n_microbatches
    outputs, loss = [], torch.zeros(())
    for a in range(job.training.accumulation_steps):
        replica_outputs = []
        for r in range(d):
            by_mb: dict[int, list[Any]] = {}
            losses: dict[int, torch.Tensor] = {}
            for report in reports:
                if report.dp_rank == r:
                    by_mb.update(report.outputs[a])
                    losses.update(report.losses[a])
            replica_outputs.append(merge_microbatches([pytree.tree_unflatten(by_mb[m], pipe.out_spec)
                                                       for m in range(n)]))
            loss = loss + weighted_loss([losses[m] for m in range(n)], weights[a])
        outputs.append(merge_microbatches(replica_outputs))
    stage_grads, params, buffers = {}, {}, {}
    for report in reports:
        if report.dp_rank == 0:
            stage_grads.update(report.stage_grads)
            params.update(report.params)
            buffers.update(report.buffers)
    grads, replica_grads = merge_stage_grads(stage_grads, pipe.tied_groups)
    merged_params, replica_params = merge_stage_grads(params, pipe.tied_groups)
    merged_buffers: dict[str, torch.Tensor] = {}
    for s in sorted(buffers):
        merged_buffers.update(buffers[s])
    result = StepResult(_outputs(outputs), loss, grads, buffers=merged_buffers if d == 1 else {},
                        replica_grads=replica_grads, stage_grads=[stage_grads.get(s, {}) for s in range(pipe.num_stages)],
                        params=merged_params, replica_params=replica_params)
    for report in reports:
        result.boundaries.update(report.boundaries)  # a failing check's re-run (pipecheck._check.train_locate)
        if report.dp_rank > 0:
            for copies, by_stage in ((result.dp_grads, report.stage_grads), (result.dp_params, report.params)):
                for stage, by_fqn in by_stage.items():
                    for fqn, value in by_fqn.items():
                        copies.setdefault(fqn, {})[(report.dp_rank, stage)] = value
    return result


class ReferenceRunner:
    """The "reference" runner: one step (``runner(job)``) or a training loop (``runner.train(job)``)."""

    __name__ = "reference"
    follows_random_contract = True  # every stage forward draws by pipecheck.randomness (stage_forward)
    follows_precision = True  # forwards under job.precision's autocast, gradients summed in its grad_accumulation

    def __call__(self, job: Job) -> StepResult:
        return run_reference(job)

    def train(self, job: Job) -> list[StepResult]:
        return train_reference(job)


reference_runner = ReferenceRunner()
