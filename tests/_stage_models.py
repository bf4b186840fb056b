"""Models and a World job for tests/runtime/test_stage_build.py: ranks build only their own stages.

Top-level so that spawned ranks unpickle them by name.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn as nn

import pipecheck as pc

# private: the rank's executor, as a distributed step builds it
from pipecheck._runtime.executor import StageExecutor, StepSpec
from pipecheck._split.stage_build import held_tensors
from pipecheck._world.world import RankContext

D = 6


class Rotary(nn.Module):
    """A rotary-embedding-style table: a non-persistent buffer computed in ``__init__``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cos(self.inv_freq).repeat(2)


class Scaled(nn.Module):
    """A plain tensor attribute made in ``__init__`` (not a buffer): the graph reads it as a get_attr."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale = torch.linspace(0.5, 1.5, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class FourStages(nn.Module):
    """Four stages: a BatchNorm (running stats), a rotary-style buffer, a get_attr constant, linears."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d)
        self.rotary = Rotary(d)
        self.mid = nn.Linear(d, d)
        self.scaled = Scaled(d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        pc.pipe_split()
        h = torch.tanh(self.mid(self.rotary(h)))
        pc.pipe_split()
        h = torch.tanh(self.scaled(h))
        pc.pipe_split()
        return self.out(h)


def make_four_stages() -> FourStages:
    return FourStages()


def make_pid_weights() -> FourStages:
    """The same weights on every call in one process, other weights in another process (as a factory
    that reads a per-process counter or a clock would build): right only where the driver's are shipped."""
    model = FourStages()
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.add_(math.sin(os.getpid() * 0.37 + i))
    return model


def make_item_in_init() -> FourStages:
    """A factory that computes with its tensors' values (``.item()``): it cannot run on the meta device."""
    model = FourStages()
    factor = float(model.inp.weight.abs().max().item())
    with torch.no_grad():
        model.out.weight.mul_(1.0 / max(factor, 1.0))
    return model


class WithLSTM(nn.Module):
    """An LSTM (a ``torch.nn`` module the tracer keeps whole) in the second stage."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        pc.pipe_split()
        h = self.rnn(h)[0]
        return self.out(h)


def make_lstm() -> WithLSTM:
    return WithLSTM()


def make_lstm_with_a_list() -> WithLSTM:
    """The LSTM also holds a tensor in a list attribute: nothing names it, so on a rank it would stay on meta."""
    model = WithLSTM()
    model.rnn.extra = [torch.ones(D)]
    return model


class TiedEnds(nn.Module):
    """The first and last of four stages share one weight."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.emb = nn.Linear(d, d, bias=False)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        pc.pipe_split()
        h = torch.tanh(self.a(h))
        pc.pipe_split()
        h = torch.tanh(self.b(h))
        pc.pipe_split()
        return h @ self.emb.weight.T


def make_tied_ends() -> TiedEnds:
    return TiedEnds()


def held_on_rank(ctx: RankContext, spec: StepSpec) -> dict[str, Any]:
    """A World job: the rank's split as a step builds it; per stage, the devices of the tensors it holds,
    and the bytes this rank holds off the meta device (each tensor once)."""
    executor = StageExecutor(ctx, spec)
    devices: dict[int, list[str]] = {}
    real: dict[int, torch.Tensor] = {}
    for stage in executor.pipe.stages:
        found = list(held_tensors(stage.module))
        devices[stage.index] = sorted({t.device.type for _, _, t in found})
        real.update({id(t): t for _, _, t in found if not t.is_meta})
    own = [s for s, r in enumerate(executor.stage_to_rank) if r == ctx.rank]
    objects: dict[str, set[int]] = {}  # per parameter FQN: the objects this rank's own stages hold
    for s in own:
        stage = executor.pipe.stages[s]
        for local, param in stage.module.named_parameters(remove_duplicate=False):
            objects.setdefault(stage.local_to_fqn[local], set()).add(id(param))
    return {"own": own, "devices": devices, "bytes": sum(t.nbytes for t in real.values()),
            "param_objects": {fqn: len(found) for fqn, found in objects.items()}}
