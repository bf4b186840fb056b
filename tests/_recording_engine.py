"""A two-process engine that records its boundary values with ``job.recorder`` (tests/check/test_recorded_engines.py),
with planted bugs; top-level so spawned ranks can unpickle it.

Its stages are its own modules, not pipecheck's split: rank 0 runs ``embed`` and ``block[:2]``, rank 1
``block[2]`` and ``head``, whose input ``h`` skips over the block (stage 1 receives two values).
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import pipecheck as pc

CUT = {"block.2": pc.SplitPoint.BEGINNING}


class SkipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.block(h) + h)


class DropSkipNet(SkipNet):
    """SkipNet with dropout on both sides of the cut (train mode): its engine draws by pipecheck's contract."""

    def __init__(self) -> None:
        super().__init__()
        self.block.insert(2, nn.Dropout(0.3))  # stage 0: block.0, block.1, block.2 (dropout); stage 1: block.3
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.drop(self.block(h)) + h)


RANDOM_CUT = {"block.3": pc.SplitPoint.BEGINNING}


def _stage0(model: SkipNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = model.embed(x)
    return h, model.block[:-1](h)


def _stage1(model: SkipNet, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    y = model.block[-1](y)
    return model.head((model.drop(y) if isinstance(model, DropSkipNet) else y) + h)


def run_stage(ctx: Any, model_fn: Any, x: torch.Tensor, target: torch.Tensor, loss_fn: Any, n: int,
              recorders: list[pc.StageRecorder], bugs: frozenset[str], seed: int | None = None,
              step: int = 0) -> tuple[Any, ...]:
    """One rank's share of a GPipe step. ``bugs``: "scale_mb2" (stage 1 scales its input for micro-batch 2),
    "drop_skip_grad" (stage 1 sends zeros for the skip's gradient), "inputs_out_of_order" (stage 1 records
    its inputs in its own order), "whole_batch" (stage 0 records the whole batch as its input),
    "draws_next_mb" (each stage draws the next micro-batch's random numbers), "scale_mb2_at_step1" (as
    "scale_mb2", in optimizer step 1 only). ``seed``: the job's
    random_seed; every stage forward then draws inside pc.randomness.drawing, as the contract says."""
    model, recorder, peer = model_fn(), recorders[ctx.rank], 1 - ctx.rank
    run = step * n  # micro-batches are numbered across a training check's run (one schedule step per step here)
    xs, targets = pc.split_microbatches(x, n), pc.split_microbatches(target, n, "target")
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []

    def drawing(mb: int) -> Any:
        if seed is None:
            return contextlib.nullcontext()
        drawn = (mb + 1) % n if "draws_next_mb" in bugs else mb
        return pc.randomness.drawing(seed, stage=ctx.rank, microbatch=drawn, step=step)

    for mb in range(n):
        if ctx.rank == 0:
            with drawing(mb):
                h, y = _stage0(model, xs[mb])
            recorder.inputs(run + mb, x if "whole_batch" in bugs else xs[mb])
            recorder.outputs(run + mb, h, y)
            dist.send(y.detach(), peer)
            dist.send(h.detach(), peer)
            kept.append((h, y))
        else:
            y, h = torch.empty(len(xs[mb]), 16), torch.empty(len(xs[mb]), 16)
            dist.recv(y, peer)
            dist.recv(h, peer)
            y.requires_grad_()
            h.requires_grad_()
            recorder.inputs(run + mb, *((h, y) if "inputs_out_of_order" in bugs else (y, h)))
            scaled = mb == 2 and ("scale_mb2" in bugs or ("scale_mb2_at_step1" in bugs and step == 1))
            used = y * 1.5 if scaled else y
            with drawing(mb):
                out = _stage1(model, used, h)
            recorder.outputs(run + mb, out)
            losses.append(loss_fn(out, targets[mb]))
            outputs.append(out.detach())
            kept.append((y, h))
    for mb in range(n):
        if ctx.rank == 1:
            (losses[mb] / n).backward()
            y, h = kept[mb]
            assert y.grad is not None and h.grad is not None
            recorder.input_grads(run + mb, y.grad, h.grad)
            dist.send(y.grad, peer)
            dist.send(torch.zeros_like(h.grad) if "drop_skip_grad" in bugs else h.grad, peer)
        else:
            h, y = kept[mb]
            grad_y, grad_h = torch.empty_like(y), torch.empty_like(h)
            dist.recv(grad_y, peer)
            dist.recv(grad_h, peer)
            recorder.output_grads(run + mb, grad_h, grad_y)
            torch.autograd.backward([h, y], [grad_h, grad_y])
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return grads, outputs, [loss.detach() for loss in losses], recorder


class TwoProcessEngine:
    """The engine's driver: both stages on ``job.world``'s two ranks, the recorders sent there and back. It
    follows pipecheck's randomness contract (a model with dropout: ``job.random_seed`` is set)."""

    follows_random_contract = True

    def __init__(self, *bugs: str) -> None:
        self.bugs = frozenset(bugs)
        self.__name__ = "+".join(sorted(bugs)) or "correct"

    def __call__(self, job: pc.Job, step: int = 0) -> pc.StepResult:
        assert job.world is not None
        recorders = [job.recorder(0), job.recorder(1)]
        (grads0, _, _, rec0), (grads1, outputs, losses, rec1) = job.world.run(
            run_stage, job.model, job.args[0], job.target, job.loss_fn, job.n_microbatches, recorders, self.bugs,
            job.random_seed, step, timeout=60)
        return pc.StepResult(pc.merge_microbatches(outputs), torch.stack(losses).mean(), {**grads0, **grads1},
                             boundaries=job.recorded([rec0, rec1]))

    def train(self, job: pc.Job) -> list[pc.StepResult]:
        """Optimizer steps without an optimizer (a check of a model with dropout is a training check)."""
        return [self(job.with_batch(batch), t) for t, [batch] in enumerate(job.optimizer_steps())]


class StageOne(nn.Module):
    """Stage 1 as an engine might hold it: its two inputs positionally, pipecheck's order."""

    def __init__(self, model: SkipNet) -> None:
        super().__init__()
        self.block2, self.head = model.block[2], model.head

    def forward(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(y) + h)


def watched_stage_one(recorder: pc.StageRecorder, inputs: list[tuple[torch.Tensor, torch.Tensor]], queue: Any) -> None:
    """A worker process (torch.multiprocessing): stage 1 run under ``recorder.watch``, the recorder sent back
    pickled (as bytes: a tensor put on a torch queue as itself is shared through this process, gone at its exit)."""
    torch.manual_seed(0)
    module = StageOne(SkipNet())
    recorder.watch(module)
    for y, h in inputs:
        out = module(y.clone().requires_grad_(), h.clone().requires_grad_())
        out.sum().backward()
    queue.put(pickle.dumps(recorder))
