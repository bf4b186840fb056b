"""runner="deepspeed" training: one PipelineEngine kept across optimizer steps, DeepSpeed's own data parallel.

    results = train_deepspeed(runner, job)     # runner.train(job): one StepResult per optimizer step

Every rank builds DeepSpeed's PipelineModule and engine once, over ``d x p`` ranks: DeepSpeed lays them
out itself (its pipe-by-data topology) and all-reduces each stage's gradients over its data-parallel
group, as it does for its users. Each optimizer step is one ``engine.train_batch()`` over the step's
``accumulation_steps x n_microbatches`` micro-batches of this replica's shard, the engine's optimizer
built from the check's factory and its clipping set to the check's ``clip_grad_norm``.

DeepSpeed divides each micro-batch's loss by its gradient-accumulation count and averages gradients
over its replicas; the loss handed to it is the micro-batch's loss weighed by the check's convention
times those counts, so a correct engine gives the convention's gradient. Gradients are read when
DeepSpeed takes its optimizer step (after its data-parallel and tied all-reduces, before clipping),
parameters after it, every rank's copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch, Training
from pipecheck._runners.base import world_for
from pipecheck._runners.deepspeed.rank import (
    SplitModelSpec,
    build_engine,
    clock,
    frozen_sgd,
    import_deepspeed,
    quiet_tied_broadcast,
    teardown,
)
from pipecheck._runners.job import Job
from pipecheck._runners.rank_side import prepare_together
from pipecheck._runners.training import check_replica_world, merge_step, reductions, run_training
from pipecheck._runtime.optimizer import build_optimizer
from pipecheck._runtime.training import RankTraining, TrainStepReport
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import shard_batch
from pipecheck._world.worker import RankContext
from pipecheck.errors import InputError, plural
from pipecheck.losses import MicrobatchLoss, Reduction


@dataclass(frozen=True)
class DeepSpeedTrainSpec:
    step: SplitModelSpec  # the first batch's: every rank splits the model on it
    batches: tuple[Batch, ...]  # one per schedule step, the whole batch (every replica's shard)
    reductions: tuple[Reduction, ...]  # one per schedule step
    training: Training
    num_stages: int
    micro_batch_size: int  # DeepSpeed's train_micro_batch_size_per_gpu (its batch bookkeeping only)
    reshaped: tuple[bool, ...]  # per optimizer step: its shapes differ from the step before's
    dynamic_shape: bool  # shapes differ within one optimizer step: DeepSpeed's PipelineModule(dynamic_shape=True)


class StepLoss:
    """DeepSpeed's loss for one optimizer step: micro-batch ``label = a * n + mb`` of schedule step ``a``,
    weighed by the check's convention times ``scale`` (what DeepSpeed divides by); the raw losses kept."""

    def __init__(self, losses: Sequence[MicrobatchLoss], weights: Sequence[float], n: int, scale: float) -> None:
        self.losses, self.weights, self.n, self.scale = list(losses), list(weights), n, scale
        self.raw: dict[int, torch.Tensor] = {}

    def __call__(self, label: int, outputs: Any) -> torch.Tensor:
        a, mb = divmod(label, self.n)
        loss = self.losses[a](mb, outputs)
        self.raw[label] = loss.detach().cpu().clone()
        return loss * (self.weights[a] * self.scale)


def deepspeed_rank_train(ctx: RankContext, spec: DeepSpeedTrainSpec) -> RankTraining:
    """What every rank runs (top-level, so it pickles): the whole training loop on one engine."""
    result = RankTraining(ctx.rank)
    prepared = prepare_together(ctx, result, lambda: (import_deepspeed(), spec.step.setup(ctx)))
    if prepared is None:
        return result
    deepspeed, setup = prepared
    assert setup.feed is not None  # SplitModelSpec's setup feeds any batch
    training = spec.training
    d, n, g = training.data_parallel, spec.step.n_microbatches, training.accumulation_steps
    groups_before = set(dist.distributed_c10d._world.pg_map)
    config = {
        "train_batch_size": spec.micro_batch_size * g * n * d,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": g * n,
        "gradient_clipping": training.clip_grad_norm or 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }

    def optimizer_of(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        trainable = [p for p in params if p.requires_grad]  # the factory sees what eager's does
        if training.optimizer is None or not trainable:
            return frozen_sgd(trainable)
        return build_optimizer(training.optimizer, trainable)

    with clock(result.timings, "build_s"):
        engine, module, names = build_engine(ctx, deepspeed, setup, spec.num_stages, config, optimizer_of,
                                             spec.dynamic_shape)
    spec.step.engine_built(engine)
    stage, replica = int(engine.stage_id), int(engine.grid.get_data_parallel_id())
    ctx.stage = stage
    params = [(setup.engine_fqn(names[id(p)]), p) for p in module.parameters() if id(p) in names]
    report = TrainStepReport(ctx.rank)
    take_step = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:  # DeepSpeed's reduced gradients, before clipping
        report.stage_grads[stage] = {fqn: p.grad.detach().cpu().clone() for fqn, p in params if p.grad is not None}
        return take_step(*args, **kwargs)

    engine._take_model_step = take_model_step
    try:
        for t in range(training.steps):
            report = TrainStepReport(ctx.rank, dp_rank=replica)
            first = t * g
            data, losses = [], []
            for a in range(g):
                batch = spec.batches[first + a]
                args, kwargs = shard_batch((tuple(batch.args), dict(batch.kwargs)), d)[replica]
                target = cast_inputs(shard_batch(batch.target, d, what="target")[replica], None, ctx.device)
                losses.append(MicrobatchLoss(spec.step.loss_fn, target, n, spec.reductions[first + a]))
                data += [(inputs, torch.tensor([a * n + mb])) for mb, inputs in enumerate(setup.feed(args, kwargs, n))]
            step_loss = StepLoss(losses, [r.weight for r in spec.reductions[first:first + g]], n, g * n * d)
            setup.loss.loss_of, setup.loss.outputs = step_loss, {}
            if spec.reshaped[t]:
                engine.reset_activation_shape()  # DeepSpeed's way for batches whose shapes change
            with clock(result.timings, "train_batch_s"), quiet_tied_broadcast():
                ctx.action = f"train_batch of optimizer step {t}"
                engine.train_batch(data_iter=iter(data))
            ctx.action = "collect"
            for a in range(g):
                report.outputs.append({mb: pytree.tree_leaves(setup.loss.outputs[a * n + mb]) for mb in range(n)
                                       if a * n + mb in setup.loss.outputs})
                report.losses.append({mb: step_loss.raw[a * n + mb] for mb in range(n) if a * n + mb in step_loss.raw})
            report.params = {stage: {fqn: p.detach().cpu().clone() for fqn, p in params}}
            report.buffers = {stage: {setup.engine_fqn(name): b.detach().cpu().clone()
                                      for name, b in module.named_buffers()}}
            result.steps.append(report)
    finally:
        engine._take_model_step = take_step
    with clock(result.timings, "teardown_s"):
        ctx.action = "teardown"
        teardown(engine, groups_before)
    ctx.stage, ctx.action = None, None
    return result


def train_deepspeed(runner: Any, job: Job) -> list[StepResult]:
    """The driver side: plan once on the first batch, one World job for the whole loop."""
    training = job.training
    d, n, g = training.data_parallel, job.n_microbatches, training.accumulation_steps
    pipe = job.structure()
    batches = job.schedule_batches()
    first = batches[0]
    step = runner.plan(job.with_batch(first), pipe)
    p = runner.n_ranks(job, pipe, step)
    shapes = [_refuse_unequal(pipe, batch, d, n, i) for i, batch in enumerate(batches)]
    within = any(len(set(shapes[t * g:(t + 1) * g])) > 1 for t in range(training.steps))
    reshaped = tuple(t > 0 and shapes[t * g] != shapes[t * g - 1] for t in range(training.steps))
    check_replica_world(job, p, f"DeepSpeed's pipeline of {plural(p, 'stage')}")
    spec = DeepSpeedTrainSpec(step, tuple(batches), tuple(reductions(job)), training, p,
                              shapes[0][0] // (d * n), reshaped, within)
    world = world_for(dataclasses.replace(job, world_size=None), d * p, runner.label)
    reports, ran = run_training(runner, world, job, deepspeed_rank_train, spec, step)
    results = [merge_step(pipe, [r.steps[t] for r in reports], job, spec.reductions[t * g:(t + 1) * g])
               for t in range(training.steps)]
    for result in results:
        result.timings["step_s"] = ran / len(results)
    return results


def _refuse_unequal(pipe: Any, batch: Batch, d: int, n: int, index: int) -> tuple[Any, ...]:
    """The batch's size and the shapes of what it feeds; an InputError when its ``d x n`` micro-batches
    would differ in size (DeepSpeed's engine sends every micro-batch in the first one's shape)."""
    bound = pipe.bind_inputs(tuple(batch.args), dict(batch.kwargs))
    leaves = [leaf for leaf in pytree.tree_leaves(bound) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    size = leaves[0].shape[0] if leaves else 0
    if size % (d * n):
        raise InputError(f"runner='deepspeed': schedule step {index}'s batch of {size} rows does not split into "
                         f"{d} x {n} equal micro-batches (data_parallel x n_microbatches); DeepSpeed's engine "
                         "sends every micro-batch in one shape. Fix: a batch size divisible by "
                         f"{d * n}, or runner='distributed', which takes unequal micro-batches.")
    return (size, *(tuple(leaf.shape) for leaf in leaves))
