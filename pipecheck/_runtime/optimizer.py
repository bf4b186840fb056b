"""The optimizer step of the stages one process holds: gradients in, clipping, the update.

    optimizer = StageOptimizer(stages, lambda params: torch.optim.SGD(params, lr=0.1))
    optimizer.step(grads_by_stage, clip_grad_norm=1.0, norm_sum=all_reduce_sum, counts=first_holder)
    optimizer.params_after()          # stage -> fqn -> value, detached copies

Every replica of a tied parameter is its own tensor on its own stage (several stages of one process
may share one object: it is updated once). Each gets the full gradient and the same update, so the
replicas stay equal. Clipping scales every gradient by ``max_norm / (norm + 1e-6)`` (at most 1) as
``torch.nn.utils.clip_grad_norm_`` does, where ``norm`` is the 2-norm over the model's parameters,
each counted once: a tied parameter's replicas on several stages are one parameter, counted by the
one stage ``counts`` names; ``norm_sum`` adds the squared norms of all processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipecheck._core.training import OptimizerFactory
from pipecheck._runtime.stage_step import frozen_params, trainable_params
from pipecheck._split.pipe import Stage
from pipecheck.errors import InputError


class StageOptimizer:
    """One process's optimizer over the trainable parameters of ``stages`` (each object once)."""

    def __init__(self, stages: Sequence[Stage], factory: OptimizerFactory | None) -> None:
        self.held: dict[int, list[tuple[str, torch.nn.Parameter]]] = {s.index: trainable_params(s) for s in stages}
        self.frozen = {s.index: frozen_params(s) for s in stages}  # reported after each step, never stepped
        unique: dict[int, torch.nn.Parameter] = {}
        for params in self.held.values():
            unique.update((id(p), p) for _, p in params)
        self.parameters = list(unique.values())
        self.steps = factory is not None  # a process whose stages train nothing still takes part in clipping
        self.optimizer = build_optimizer(factory, self.parameters) if factory is not None and self.parameters \
            else None

    def step(self, grads: Mapping[int, Mapping[str, torch.Tensor]], clip_grad_norm: float | None = None,
             norm_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
             counts: Callable[[int, str], bool] = lambda stage, fqn: True) -> None:
        """Give every held parameter its stage's gradient, clip, and step the optimizer (nothing without one)."""
        if not self.steps:
            return
        squares: list[torch.Tensor] = []
        for stage, params in self.held.items():
            for fqn, param in params:
                grad = grads.get(stage, {}).get(fqn)
                param.grad = None if grad is None else grad.detach().clone()
                if grad is not None and counts(stage, fqn):
                    squares.append(torch.linalg.vector_norm(grad.detach()) ** 2)
        if clip_grad_norm is not None:
            clip_by_norm(self.parameters, squares, clip_grad_norm, norm_sum)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def params_after(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's value now, trainable and frozen, by stage and FQN (detached copies)."""
        return {stage: {fqn: p.detach().clone() for fqn, p in [*params, *self.frozen[stage]]}
                for stage, params in self.held.items()}


def clip_by_norm(parameters: Sequence[torch.nn.Parameter], squares: Sequence[torch.Tensor], max_norm: float,
                 norm_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> None:
    """Scale every gradient of ``parameters`` by ``max_norm / (norm + 1e-6)``, at most 1, as
    ``torch.nn.utils.clip_grad_norm_`` does; ``norm`` is the square root of ``squares`` (each counted
    parameter's squared gradient norm) summed here and, through ``norm_sum``, over the other processes."""
    device = parameters[0].device if parameters else torch.device("cpu")
    local = torch.stack([square.to(device) for square in squares]).sum() if squares else torch.zeros((), device=device)
    scale = (max_norm / (norm_sum(local).sqrt() + 1e-6)).clamp(max=1.0)
    for param in parameters:
        if param.grad is not None:
            param.grad.mul_(scale.to(param.grad.device, param.grad.dtype))


def summed_over(group: Any, comm_device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``norm_sum`` for :func:`clip_by_norm`: a scalar all-reduced (in float64) over ``group``."""
    def total(local: torch.Tensor) -> torch.Tensor:
        moved = local.detach().to(comm_device, torch.float64).reshape(1).clone()
        dist.all_reduce(moved, group=group)
        return moved.to(local.device, local.dtype).reshape(())
    return total


def build_optimizer(factory: OptimizerFactory, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``factory(parameters)``, or an InputError that says what a factory must be."""
    try:
        optimizer = factory(parameters)
    except Exception as err:
        raise InputError(f"optimizer={factory!r} failed on a list of parameters ({type(err).__name__}: {err}). "
                         "Fix: pass a factory of the parameters, e.g. optimizer=functools.partial(torch.optim.SGD, "
                         "lr=0.1) (a lambda works in this process but cannot travel to a World's ranks).") from err
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer={factory!r} returned {type(optimizer).__name__}, not a torch.optim.Optimizer. "
                         "Fix: def adamw(params): return torch.optim.AdamW(params, lr=1e-3), and optimizer=adamw.")
    return optimizer
