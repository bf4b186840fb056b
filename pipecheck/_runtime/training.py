"""Several training steps of pipecheck's runtime on one rank: the engine kept from step to step.

    reports = world.run(rank_train, TrainSpec(step, batches, reductions, training))
    reports[r].steps[t].stage_grads / .params / .buffers / .outputs[a][mb] / .losses[a][mb]

The rank splits the model once, builds its optimizer over its stages' parameters once, and runs
``training.steps`` optimizer steps: each runs ``accumulation_steps`` schedule steps on their batches,
adds their gradients, then clips them with the norm of the whole model (each rank's squared norm,
a tied parameter counted on its first stage only, summed over the ranks) and steps the optimizer.
Every replica of a tied parameter gets the full gradient (the schedule step's all-reduce) and so
the same update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecheck._core.result import RankReport
from pipecheck._core.training import Batch, Training
from pipecheck._runtime.executor import StageExecutor, StepSpec, to_host
from pipecheck._runtime.optimizer import StageOptimizer
from pipecheck._runtime.stage_step import add_param_grads
from pipecheck._world.worker import RankContext
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

    outputs: list[dict[int, list[Any]]] = field(default_factory=list)  # per schedule step: mb -> output leaves
    losses: list[dict[int, torch.Tensor]] = field(default_factory=list)  # per schedule step: mb -> loss


@dataclass
class RankTraining(RankReport):
    """Every optimizer step of one rank."""

    steps: list[TrainStepReport] = field(default_factory=list)


def rank_train(ctx: RankContext, spec: TrainSpec) -> RankTraining:
    """The function every rank runs for a training loop (top-level, so it pickles)."""
    executor = StageExecutor(ctx, spec.step)
    pipe = executor.pipe
    mine = [stage for stage in pipe.stages if executor._mine(stage.index)]
    optimizer = StageOptimizer(mine, spec.training.optimizer)
    first_holder = {fqn: min(pipe.param_stages(fqn)) for stage in mine for fqn in stage.params}
    result = RankTraining(ctx.rank)
    g = spec.training.accumulation_steps
    for t in range(spec.training.steps):
        report = TrainStepReport(ctx.rank)
        grads: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(t * g, (t + 1) * g):
            batch = spec.batches[i]
            executor.use_batch(batch.args, dict(batch.kwargs), batch.target, spec.reductions[i])
            executor.step()
            for stage, stage_grads in executor.result.stage_grads.items():
                add_param_grads(grads.setdefault(stage, {}), {f: v.detach() for f, v in stage_grads.items()})
            report.outputs.append(executor.result.outputs)
            report.losses.append(executor.result.losses)
        report.stage_grads = {stage: {fqn: v.clone() for fqn, v in by_fqn.items()} for stage, by_fqn in grads.items()}
        ctx.action = "optimizer step"
        optimizer.step(grads, spec.training.clip_grad_norm, lambda local: _sum_over_ranks(ctx, local),
                       lambda stage, fqn: first_holder.get(fqn) == stage)
        report.params = optimizer.params_after()
        report.buffers = executor.result.buffers
        report.outputs, report.losses, report.stage_grads, report.params, report.buffers = to_host(
            (report.outputs, report.losses, report.stage_grads, report.params, report.buffers))
        result.steps.append(report)
    ctx.stage, ctx.action = None, None
    return result


def _sum_over_ranks(ctx: RankContext, local: torch.Tensor) -> torch.Tensor:
    """``local`` summed over every rank of the pipeline (the squared gradient norms, for clipping)."""
    buffer = local.detach().to(ctx.comm_device, torch.float64).reshape(1).clone()
    dist.all_reduce(buffer)
    return buffer.to(local.device, local.dtype).reshape(())
