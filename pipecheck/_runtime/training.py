"""Several training steps of pipecheck's runtime on one rank: the engine kept from step to step.

    reports = world.run(rank_train, TrainSpec(step, batches, reductions, training))
    reports[r].steps[t].stage_grads / .params / .buffers / .outputs[a][mb] / .losses[a][mb]

With ``data_parallel`` d > 1 the World holds d pipelines of p ranks (ranks r*p .. r*p+p-1 are replica
r), each on its shard of every batch; tied gradients are summed within a pipeline, and after the
accumulation every gradient is summed over the d copies of its stage. The rank splits the model once, builds its optimizer over its stages' parameters once, and runs
``training.steps`` optimizer steps: each runs ``accumulation_steps`` schedule steps on their batches,
adds their gradients, then clips them with the norm of the whole model (each rank's squared norm,
a tied parameter counted on its first stage only, summed over the ranks) and steps the optimizer.
Every replica of a tied parameter gets the full gradient (the schedule step's all-reduce) and so
the same update.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecheck._core.result import RankReport
from pipecheck._core.training import Batch, Training
from pipecheck._runtime.executor import Replica, StageExecutor, StepSpec, to_host
from pipecheck._runtime.optimizer import StageOptimizer, summed_over
from pipecheck._runtime.randomness import schedule_step
from pipecheck._runtime.stage_step import add_param_grads, trainable_params
from pipecheck._split.pipe import Stage
from pipecheck._world.worker import RankContext, gloo_connections_unprinted
from pipecheck.losses import Reduction


@dataclass(frozen=True)
class TrainSpec:
    """What every rank receives for a training loop: the first step's spec and every batch."""

    step: StepSpec
    batches: tuple[Batch, ...]  # one per schedule step
    reductions: tuple[Reduction, ...]  # one per schedule step: its micro-batches' loss weight
    training: Training


@dataclass
class TrainStepReport(RankReport):
    """One optimizer step of one rank: gradients before the optimizer, parameters after it."""

    dp_rank: int = 0  # which data-parallel replica of the pipeline this rank belongs to
    outputs: list[dict[int, list[Any]]] = field(default_factory=list)  # per schedule step: mb -> output leaves
    losses: list[dict[int, torch.Tensor]] = field(default_factory=list)  # per schedule step: mb -> loss


@dataclass
class RankTraining(RankReport):
    """Every optimizer step of one rank."""

    steps: list[TrainStepReport] = field(default_factory=list)


def rank_train(ctx: RankContext, spec: TrainSpec) -> RankTraining:
    """The function every rank runs for a training loop (top-level, so it pickles)."""
    d = spec.training.data_parallel
    p = spec.step.schedule.n_ranks
    pipelines, reducers = _groups(d, p)  # every rank creates every group, in one order
    try:
        replica = Replica(ctx.rank // p, d, ctx.rank // p * p, pipelines[ctx.rank // p] if d > 1 else None)
        return _train(ctx, spec, replica, reducers[ctx.rank % p] if d > 1 else None)
    finally:
        for group in pipelines + reducers:
            dist.destroy_process_group(group)


def _groups(d: int, p: int) -> tuple[list[Any], list[Any]]:
    """With ``d`` > 1 replicas of ``p`` ranks: each pipeline's group, and each stage position's group of
    its ``d`` copies (the data-parallel all-reduce)."""
    if d == 1:
        return [], []
    with gloo_connections_unprinted():
        pipelines = [dist.new_group(list(range(r * p, (r + 1) * p))) for r in range(d)]
        reducers = [dist.new_group([r * p + position for r in range(d)]) for position in range(p)]
    return pipelines, reducers


def _train(ctx: RankContext, spec: TrainSpec, replica: Replica, reducer: Any) -> RankTraining:
    executor = StageExecutor(ctx, spec.step, replica=replica)
    pipe = executor.pipe
    seed = spec.training.random_seed
    mine = [stage for stage in pipe.stages if executor.stage_to_rank[stage.index] == ctx.rank]
    optimizer = StageOptimizer(mine, spec.training.optimizer)
    first_holder = {fqn: min(pipe.param_stages(fqn)) for stage in mine for fqn in stage.params}
    result = RankTraining(ctx.rank)
    g = spec.training.accumulation_steps
    for t in range(spec.training.steps):
        report = TrainStepReport(ctx.rank, dp_rank=replica.index)
        grads: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(t * g, (t + 1) * g):
            batch = spec.batches[i]
            executor.use_batch(batch.args, dict(batch.kwargs), batch.target, spec.reductions[i])
            with schedule_step(seed or 0, t, i - t * g, replica.index * spec.step.schedule.n_microbatches) \
                    if seed is not None else nullcontext():
                executor.step()
            if executor.recorder is not None:  # a failing check's re-run: micro-batches numbered across the run
                first = (i * replica.count + replica.index) * spec.step.schedule.n_microbatches
                report.boundaries.update({(stage, first + mb, point, name): value for (stage, mb, point, name), value
                                          in executor.recorder.exported().items()})
            for stage, stage_grads in executor.result.stage_grads.items():
                add_param_grads(grads.setdefault(stage, {}), {f: v.detach() for f, v in stage_grads.items()})
            report.outputs.append(executor.result.outputs)
            report.losses.append(executor.result.losses)
        if reducer is not None:
            ctx.action = "data-parallel all-reduce"
            _sum_over_replicas(ctx, mine, grads, reducer)
        report.stage_grads = {stage: {fqn: v.clone() for fqn, v in by_fqn.items()} for stage, by_fqn in grads.items()}
        ctx.action = "optimizer step"
        optimizer.step(grads, spec.training.clip_grad_norm, summed_over(replica.group, ctx.comm_device),
                       lambda stage, fqn: first_holder.get(fqn) == stage)
        report.params = optimizer.params_after()
        report.buffers = executor.result.buffers
        report.outputs, report.losses, report.stage_grads, report.params, report.buffers = to_host(
            (report.outputs, report.losses, report.stage_grads, report.params, report.buffers))
        result.steps.append(report)
    ctx.stage, ctx.action = None, None
    return result


def _sum_over_replicas(ctx: RankContext, mine: list[Stage], grads: dict[int, dict[str, torch.Tensor]],
                       group: Any) -> None:
    """Every gradient summed over the data-parallel copies of its stage, in place of this rank's own: one
    all-reduce per trainable parameter of each stage, in stage then FQN order (the same on every copy,
    whatever gradients a replica's graph left out: a missing one counts as zeros)."""
    for stage in sorted(mine, key=lambda held: held.index):
        for fqn, param in sorted(trainable_params(stage)):
            grad = grads.get(stage.index, {}).get(fqn)
            buffer = torch.zeros(param.shape, dtype=param.dtype, device=ctx.comm_device)
            if grad is not None:
                buffer.copy_(grad.detach())
            dist.all_reduce(buffer, group=group)
            grads.setdefault(stage.index, {})[fqn] = buffer.to(ctx.device)
