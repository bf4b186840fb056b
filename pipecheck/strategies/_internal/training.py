"""The optimizers a generated training case draws from: top-level factories, so they travel to ranks.

    OPTIMIZERS["adamw"](model.parameters())   # torch.optim.AdamW(params, lr=1e-2)

Each is a small, well-conditioned step for the generated models' scale: a check of three steps
moves every parameter by a visible amount without leaving the region where float32 tracks float64.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def momentum(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


OPTIMIZERS = {"sgd": sgd, "momentum": momentum, "adamw": adamw}
"""Optimizer factories by name, simplest first (a case shrinks towards no optimizer, then sgd)."""

LOSS_REDUCTIONS = ("mean", "sum")
"""The loss conventions a generated case draws ("token_mean" needs token labels and a per-token loss)."""
