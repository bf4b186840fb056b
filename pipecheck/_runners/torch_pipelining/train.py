"""runner="torch" training: torch.distributed.pipelining's stages and schedule kept across optimizer steps.

    results = train_torch(run_torch, job)     # runner.train(job): one StepResult per optimizer step

Every rank builds its stages and torch's schedule once (``pipeline()`` traces the first batch) and an
optimizer over its stages' parameters, then runs each optimizer step's ``accumulation_steps``
``schedule.step`` calls, gradients accumulating in the stages' ``.grad`` as torch leaves them. Each
micro-batch's loss is weighed by the job's loss convention and torch scales nothing
(``scale_grads=False``, as torchtitan runs it: torch's own division after each step would divide
what earlier steps accumulated too). Clipping uses the norm over every rank's parameters, a weight
torch replicates on several stages counted once. torch never sums a tied weight's replicas, so
each replica steps on its own stage's share of the gradient: the check names them. A model with
random ops draws each forward torch runs by pipecheck's randomness contract, at the optimizer step
and schedule step the loop is in (``randomness.py`` beside this).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from pipecheck._core.result import RankReport, StepResult
from pipecheck._core.training import Batch, Training
from pipecheck._runners.base import merge_stage_grads, world_for
from pipecheck._runners.job import Job
from pipecheck._runners.rank_side import buffers_by_fqn, grads_by_fqn, prepare_together
from pipecheck._runners.torch_pipelining.rank import (
    TorchStepSpec,
    _prepare,
    _step,
    _torch_target,
    original_fqn,
)
from pipecheck._runners.training import reductions, refuse_data_parallel, run_training
from pipecheck._runtime.optimizer import build_optimizer, clip_by_norm, summed_over
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import unwrap_replicated
from pipecheck._world.worker import RankContext
from pipecheck.losses import MicrobatchLoss, Reduction


@dataclass(frozen=True)
class TorchTrainSpec:
    step: TorchStepSpec  # the first batch's, which torch's pipeline() traces
    batches: tuple[Batch, ...]
    reductions: tuple[Reduction, ...]
    training: Training
    first_holder: dict[str, int]  # fqn -> the lowest stage holding it (counted once in the clipping norm)


@dataclass
class TorchTrainStep(RankReport):
    outputs: list[Any] = field(default_factory=list)  # per schedule step, on the last stage's rank
    losses: list[list[torch.Tensor]] = field(default_factory=list)  # per schedule step: each micro-batch's


@dataclass
class TorchTraining(RankReport):
    steps: list[TorchTrainStep] = field(default_factory=list)


def torch_rank_train(ctx: RankContext, spec: TorchTrainSpec) -> TorchTraining:
    """What every rank runs (top-level, so it pickles)."""
    result = TorchTraining(ctx.rank)
    prep = prepare_together(ctx, result, lambda: _prepare(ctx, spec.step))
    if prep is None or prep.loss is None:
        return result
    original = original_fqn(prep.names, prep.by_id)
    held = [(stage, original(local, param), param) for stage in prep.stages
            for local, param in stage.submod.named_parameters() if param.requires_grad]
    unique = list({id(param): param for _, _, param in held}.values())
    optimizer = build_optimizer(spec.training.optimizer, unique) if spec.training.optimizer and unique else None
    n, g = spec.step.n_microbatches, spec.training.accumulation_steps
    for t in range(spec.training.steps):
        report = TorchTrainStep(ctx.rank)
        for i in range(t * g, (t + 1) * g):
            batch, reduction = spec.batches[i], spec.reductions[i]
            args, kwargs = unwrap_replicated(cast_inputs((tuple(batch.args), dict(batch.kwargs)), None, ctx.device))
            target = cast_inputs(batch.target, None, ctx.device)
            prep.args, prep.kwargs = tuple(args), dict(kwargs)
            prep.target, prep.loss.by_index = _torch_target(target, n, ctx.device)
            prep.loss.loss_of = MicrobatchLoss(spec.step.loss_fn, target, n, reduction)
            prep.loss.calls, prep.loss.scale = 0, reduction.weight
            for at in prep.drawing_at:  # pipecheck's randomness contract: this schedule step's position
                at.step, at.schedule_step = t, i - t * g
            step = _step(ctx, prep)
            report.outputs.append(step.outputs)
            report.losses.append(step.losses)
        for stage in prep.stages:
            grads, unmapped = grads_by_fqn(stage.submod, original)  # on a CPU rank: the .grad tensors themselves
            report.stage_grads[stage.stage_index] = {fqn: grad.clone() for fqn, grad in grads.items()}
            report.unmapped += unmapped
        if spec.training.optimizer is not None:
            ctx.action = "optimizer step"
            _clip(ctx, held, spec)
            if optimizer is not None:
                optimizer.step()
        for param in unique:
            param.grad = None  # the next optimizer step accumulates from zero
        report.params = {stage.stage_index: {fqn: param.detach().cpu().clone()
                                             for local, param in stage.submod.named_parameters()
                                             for fqn in [original(local, param)] if fqn is not None}
                         for stage in prep.stages}  # frozen parameters too
        report.buffers = {stage.stage_index: buffers_by_fqn(stage.submod, original) for stage in prep.stages}
        result.steps.append(report)
    ctx.stage, ctx.action = None, None
    return result


def _clip(ctx: RankContext, held: list[tuple[Any, str | None, torch.nn.Parameter]], spec: TorchTrainSpec) -> None:
    """Clip every gradient by the norm over all ranks (a replicated weight counted on its lowest stage)."""
    if spec.training.clip_grad_norm is None:
        return
    squares = [torch.linalg.vector_norm(param.grad.detach()) ** 2 for stage, fqn, param in held
               if param.grad is not None and spec.first_holder.get(fqn or "") == stage.stage_index]
    clip_by_norm(list({id(p): p for _, _, p in held}.values()), squares, spec.training.clip_grad_norm,
                 summed_over(ctx.group, ctx.comm_device))


def train_torch(runner: Any, job: Job) -> list[StepResult]:
    """The driver side: plan once, one World job for the whole loop, one StepResult per optimizer step."""
    refuse_data_parallel(job, "torch", "pipecheck drives torch.distributed.pipelining on one pipeline; composing "
                         "it with DDP or FSDP is not supported yet")
    pipe = job.structure()
    batches = job.schedule_batches()
    first = batches[0]
    step = dataclasses.replace(runner.plan(job.with_batch(first), pipe), scale_grads=False)
    weights = tuple(reductions(job))
    first_holder = {fqn: min(pipe.param_stages(fqn)) for stage in pipe.stages for fqn in stage.params}
    spec = TorchTrainSpec(step, tuple(batches), weights, job.training, first_holder)
    world = world_for(job, runner.n_ranks(job, pipe, step), runner.label)
    reports, ran = run_training(runner, world, job, runner.rank_train, spec, step)
    return merge_training(pipe, job, reports, ran)


def merge_training(pipe: Any, job: Job, reports: list[TorchTraining], ran: float) -> list[StepResult]:
    """One StepResult per optimizer step from every rank's :class:`TorchTraining` (torch's and
    torchtitan's loops: outputs and weighed losses on the last stage's rank, one pipeline)."""
    g = job.training.accumulation_steps
    results = []
    for t in range(job.training.steps):
        steps = [r.steps[t] for r in reports]
        last = next(s for s in steps if s.losses and s.losses[0])
        outputs = [last.outputs[a] for a in range(g)]
        loss = sum((torch.stack(last.losses[a]).sum() for a in range(g)), torch.zeros(()))  # each already weighed
        stage_grads = {s: v for r in steps for s, v in r.stage_grads.items()}
        params = {s: v for r in steps for s, v in r.params.items()}
        grads, replica_grads = merge_stage_grads(stage_grads, pipe.tied_groups)
        merged_params, replica_params = merge_stage_grads(params, pipe.tied_groups)
        buffers: dict[str, torch.Tensor] = {}
        for _, by_fqn in sorted(((s, v) for r in steps for s, v in r.buffers.items()), key=lambda item: item[0]):
            buffers.update(by_fqn)
        results.append(StepResult(outputs[0] if g == 1 else tuple(outputs), loss, grads, buffers=buffers,
                                  replica_grads=replica_grads, params=merged_params, replica_params=replica_params,
                                  timings={"step_s": ran / job.training.steps}))
    return results
