"""runner="torchtitan" training: torchtitan's stage modules and schedule kept across optimizer steps.

    results = train_titan(runner, job)     # runner.train(job): one StepResult per optimizer step

Every rank builds torchtitan's stage modules and schedule once (on the first batch), and one optimizer
per model part (torchtitan's ``OptimizersContainer`` keeps one per part), from the check's factory. Each
optimizer step is ``accumulation_steps`` schedule steps, each micro-batch's loss weighed by the check's
convention (torchtitan's schedules sum micro-batches: ``scale_grads=False``), then torchtitan's own
``clip_grad_norm_`` with the pipeline mesh (its norm over every stage, torchtitan#596), the optimizers'
step and their ``zero_grad``, as torchtitan's trainer runs them. One pipeline: torchtitan composes data
parallel through FSDP/DDP in its own parallelize step, which pipecheck does not drive (refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._core.training import Batch, Training
from pipecheck._runners.base import world_for
from pipecheck._runners.job import Job
from pipecheck._runners.rank_side import buffers_by_fqn, grads_by_fqn
from pipecheck._runners.torch_pipelining.rank import restructure
from pipecheck._runners.torch_pipelining.train import TorchTraining, TorchTrainStep, merge_training
from pipecheck._runners.torchtitan.rank import (
    Refusal,
    TitanStepSpec,
    by_local_name,
    original_names,
    ready_titan,
)
from pipecheck._runners.training import reductions, refuse_data_parallel, run_training
from pipecheck._runtime.optimizer import build_optimizer
from pipecheck._split.inputs import cast_inputs
from pipecheck._world.worker import RankContext
from pipecheck.errors import InputError
from pipecheck.losses import MicrobatchLoss, Reduction


@dataclass(frozen=True)
class TitanTrainSpec:
    step: TitanStepSpec  # the first batch's: torchtitan's stages are built on it
    batches: tuple[Batch, ...]
    reductions: tuple[Reduction, ...]
    training: Training


@dataclass
class TitanTraining(TorchTraining):
    refusal: Refusal | None = None  # what torchtitan cannot run, agreed by every rank before any communication


def titan_rank_train(ctx: RankContext, spec: TitanTrainSpec) -> TitanTraining:
    """What every rank runs (top-level, so it pickles): the whole training loop on one schedule."""
    from torchtitan.distributed.utils import clip_grad_norm_

    result = TitanTraining(ctx.rank)
    prep = ready_titan(ctx, spec.step, result)
    if prep is None:
        return result
    training, n = spec.training, spec.step.n_microbatches
    names = [by_local_name(original_names(prep.whole, spec.step.module_names[stage.stage_index]))
             for stage in prep.stages]
    optimizers = [build_optimizer(training.optimizer, trainable)
                  for part in prep.parts for trainable in [[p for p in part.parameters() if p.requires_grad]]
                  if training.optimizer is not None and trainable]
    first = any(stage.is_first for stage in prep.stages)
    last = any(stage.is_last for stage in prep.stages)
    g = training.accumulation_steps
    for t in range(training.steps):
        report = TorchTrainStep(ctx.rank)
        for i in range(t * g, (t + 1) * g):
            batch, reduction = spec.batches[i], spec.reductions[i]
            args, kwargs = cast_inputs((tuple(batch.args), dict(batch.kwargs)), None, ctx.device)
            prep.loss.loss_of = MicrobatchLoss(spec.step.loss_fn, cast_inputs(batch.target, None, ctx.device), n,
                                               reduction)
            prep.loss.scale, prep.loss.losses = reduction.weight, {}
            ctx.stage, ctx.action = prep.stages[0].stage_index, f"schedule.step {i} (optimizer step {t})"
            extra: dict[str, Any] = {"target": prep.target, "losses": []} if last else {}
            outputs = prep.schedule.step(*(args if first else ()), **kwargs, **extra)
            if last:
                report.outputs.append(pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor)
                                                      else v, restructure(outputs, spec.step.out_spec)))
                report.losses.append([prep.loss.losses[mb] * reduction.weight for mb in range(n)])
        for stage, part, original in zip(prep.stages, prep.parts, names):
            grads, unmapped = grads_by_fqn(part, original)
            report.stage_grads[stage.stage_index] = {fqn: grad.clone() for fqn, grad in grads.items()}
            report.unmapped += unmapped
        ctx.action = f"optimizer step {t}"
        if training.clip_grad_norm is not None:  # torchtitan's trainer: the norm over every stage
            clip_grad_norm_([p for part in prep.parts for p in part.parameters()], training.clip_grad_norm,
                            foreach=True, pp_mesh=prep.mesh)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for part in prep.parts:  # parts an optimizer does not hold (none given) accumulate from zero too
            part.zero_grad(set_to_none=True)
        report.params = {stage.stage_index: {fqn: p.detach().cpu().clone() for local, p in part.named_parameters()
                                             for fqn in [original(local, p)] if fqn is not None}
                         for stage, part, original in zip(prep.stages, prep.parts, names)}
        report.buffers = {stage.stage_index: buffers_by_fqn(part, original)
                          for stage, part, original in zip(prep.stages, prep.parts, names)}
        result.steps.append(report)
    ctx.stage, ctx.action = None, None
    return result


def train_titan(runner: Any, job: Job) -> list[Any]:
    """The driver side: plan once on the first batch, one World job for the whole loop."""
    refuse_data_parallel(job, "torchtitan", "torchtitan composes data parallel through FSDP/DDP in its own "
                         "parallelize step, which pipecheck does not drive")
    pipe = job.structure()
    batches = job.schedule_batches()
    first = batches[0]
    shapes = [_shapes(batch) for batch in batches]
    changed = next((i for i, found in enumerate(shapes) if found != shapes[0]), None)
    if changed is not None:  # measured: a rank crashes in native code on the new shapes
        raise InputError(f"runner='torchtitan' trains on batches of one shape: torch's stages keep the shapes they "
                         f"inferred on the first batch {shapes[0]}, and schedule step {changed}'s batch has "
                         f"{shapes[changed]}. Fix: batches of the first one's shapes, or runner='distributed'.")
    step = runner.plan(job.with_batch(first), pipe)
    spec = TitanTrainSpec(step, tuple(batches), tuple(reductions(job)), job.training)
    world = world_for(job, runner.n_ranks(job, pipe, step), runner.label)
    reports, ran = run_training(runner, world, job, titan_rank_train, spec, step)
    return merge_training(pipe, job, reports, ran)


def _shapes(batch: Batch) -> tuple[tuple[int, ...], ...]:
    """The shapes of a batch's tensor inputs, in order."""
    return tuple(tuple(leaf.shape) for leaf in pytree.tree_leaves((batch.args, dict(batch.kwargs)))
                 if isinstance(leaf, torch.Tensor))
