"""How a check trains: several optimizer steps of one engine, accumulation, the loss convention.

    training = Training(steps=3, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                        clip_grad_norm=1.0, accumulation_steps=2, loss_reduction="token_mean")
    batches = (Batch((x0,), target=y0), Batch((x1,), target=y1), ...)   # steps * accumulation_steps of them

One optimizer step runs ``accumulation_steps`` schedule steps, each on its own batch, and their
gradients add up (and, with ``data_parallel`` replicas of the pipeline each on its shard of every
batch, are summed across the replicas) before the optimizer (clipping first, when asked) updates every parameter and every
replica of a tied one. What an engine must report after each optimizer step is a
:class:`pipecheck.StepResult` with ``grads`` (before clipping and the optimizer) and ``params`` (after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
"""``optimizer(params) -> torch.optim.Optimizer``, e.g. ``lambda params: torch.optim.SGD(params, lr=0.1)``."""


@dataclass(frozen=True)
class Batch:
    """One schedule step's inputs: positional ``args``, ``kwargs`` and the loss's ``target``.

        pc.assert_equivalent(model, (x0,), batches=[pc.Batch((x0,), target=y0), pc.Batch((x1,), target=y1)],
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss_fn=F.mse_loss)

    Tensors are split into micro-batches on dim 0 like ``args``; shapes may differ from batch to batch.
    """

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    target: Any = None


@dataclass(frozen=True)
class Training:
    """A check's training loop. ``Training()`` is one step with no optimizer: today's check."""

    steps: int = 1
    accumulation_steps: int = 1
    optimizer: OptimizerFactory | None = None
    clip_grad_norm: float | None = None
    loss_reduction: str = "mean"
    ignore_index: int = -100
    data_parallel: int = 1  # pipeline replicas, each on its shard of every batch, gradients summed across them
    # The random ops the stages run ("stage 1: blocks.0.drop (Dropout)"), drawn by pipecheck's randomness
    # contract (pipecheck.randomness) under this seed; () and None: the model draws nothing.
    dropout: tuple[str, ...] = ()
    random_seed: int | None = None

    @property
    def schedule_steps(self) -> int:
        """How many schedule steps (batches) the loop runs."""
        return self.steps * self.accumulation_steps

    @property
    def plain(self) -> bool:
        """Whether this is one step of the mean loss with no optimizer nor dropout: a one-call runner's job."""
        return self == Training()

    def describe(self) -> str:
        """``3 steps of AdamW (gradients clipped to norm 1), 2 accumulation steps each, loss token_mean``."""
        parts = [f"{self.steps} step{'s' if self.steps != 1 else ''}"]
        if self.optimizer is not None:
            parts[0] += f" of {_optimizer_name(self.optimizer)}"
        if self.clip_grad_norm is not None:
            parts.append(f"gradients clipped to norm {self.clip_grad_norm:g}")
        if self.accumulation_steps > 1:
            parts.append(f"{self.accumulation_steps} accumulation steps each")
        parts.append(f"loss {self.loss_reduction}")
        if self.data_parallel > 1:
            parts.append(f"{self.data_parallel} data-parallel replicas")
        if self.dropout:
            count = len(self.dropout)
            parts.append(f"{count} random op{'s' if count != 1 else ''} drawn by pipecheck's randomness contract")
        return ", ".join(parts)


def _optimizer_name(factory: OptimizerFactory) -> str:
    """The optimizer a factory builds, named without building it when the factory says (a class)."""
    if isinstance(factory, type):
        return factory.__name__
    return getattr(factory, "__name__", type(factory).__name__).replace("<lambda>", "the optimizer")
