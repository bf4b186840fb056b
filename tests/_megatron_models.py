"""Models and planted adapter bugs for tests/runners/test_megatron_runner.py, top-level so the ranks
can unpickle them by name."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.nn as nn

from pipecheck import pipe_split

# private: planted bugs are Megatron's rank step with one of its parts changed
from pipecheck._runners.megatron import rank as megatron_rank


class TiedLM(nn.Module):
    """Embedding on the first stage, its weight reused by the output projection on the last: the
    word-embedding tie Megatron sums with finalize_model_grads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.l0 = nn.Linear(8, 8)
        self.l1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l0(self.emb(tokens)))
        pipe_split()
        return self.head(torch.tanh(self.l1(x)))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


class Skip(nn.Module):
    """A value of stage 0 read by stage 2: a skip across a stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pipe_split()
        g = self.b(h)
        pipe_split()
        return self.c(g) + h


def rank_step_without_tied_sync(ctx: Any, plan: Any) -> Any:
    """Planted: finalize_model_grads never sums the word embedding's replicas."""
    import importlib

    # the module (megatron.core.distributed's attribute of that name is the function)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    with mock.patch.object(finalize, "_allreduce_word_embedding_grads", lambda *args, **kwargs: None):
        return megatron_rank.megatron_rank_step(ctx, plan)


def rank_step_scaling_loss_twice(ctx: Any, plan: Any) -> Any:
    """Planted: each micro-batch's loss divided by the number of micro-batches before Megatron
    divides it again."""
    real = megatron_rank.MicrobatchLoss

    class Halved(real):  # type: ignore[misc, valid-type]
        def __call__(self, mb: int, output: Any) -> torch.Tensor:
            return super().__call__(mb, output) / plan.n_microbatches

    with mock.patch.object(megatron_rank, "MicrobatchLoss", Halved):
        return megatron_rank.megatron_rank_step(ctx, plan)


def fails_on_ranks() -> nn.Module:
    """Builds eagerly; raises when a rank builds it, after Megatron's parallel state is set up."""
    if torch.distributed.is_initialized():
        raise ValueError("planted failure building the model on a rank")
    return mlp()
