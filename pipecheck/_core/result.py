"""What a runner returns for one training step, and what each rank of an engine sends back for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipecheck.errors import RankError


@dataclass
class StepResult:
    """One step of a model: merged outputs, the loss, and full gradients by original FQN.

    ``grads`` maps each parameter FQN (as ``model.named_parameters()`` names it)
    to its full gradient; ``input_grads`` maps model input names to gradients
    for inputs that require grad.
    """

    outputs: Any
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    # Every buffer by original FQN (as model.named_buffers() names it) after the step; empty: not reported.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Optional. The reference runner: each stage's own share of every gradient, before tied sums.
    stage_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # Optional: the gradient every replica of a tied parameter ended with, fqn -> stage -> grad.
    # assert_equivalent checks each replica, not only the one in ``grads``.
    replica_grads: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)  # optional: timeline events (pipecheck._runtime.timeline.Event)
    # Optional: boundary values, (stage, micro-batch, point, value name) -> host tensor, recorded when
    # ``job.boundaries`` is set (see pipecheck.Job): ``job.recorded(recorders)`` for an engine that records
    # with ``job.recorder(stage)``; a runner that runs ``job.split()``'s stage modules on one process need not fill it.
    boundaries: dict[tuple[int, int, str, str], torch.Tensor] = field(default_factory=dict)
    # Optional: what the runner wants the report to say (its engine's version and configuration).
    notes: list[str] = field(default_factory=list)
    # A training step's (``runner.train``): every parameter after the optimizer step (frozen ones too), by original FQN,
    # and every replica of a tied parameter after it, fqn -> stage -> value.
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    replica_params: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    # With data-parallel replicas of the pipeline: every other replica's copy of every gradient (before
    # the optimizer) and parameter (after it), fqn -> (data-parallel rank, stage) -> value.
    dp_grads: dict[str, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    dp_params: dict[str, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)


BoundaryKey = tuple[int, int, str, str]  # (stage, micro-batch, point, value name)


@dataclass
class RankReport:
    """What one rank sends back after its engine's step, keyed by stage and ORIGINAL parameter FQN.

    Each engine's rank result extends it with what that engine hands back its own way (outputs,
    losses, input gradients); the driver skeleton (``pipecheck._runners.engine``) merges the rest.
    """

    rank: int
    stage_grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> fqn -> grad
    buffers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> fqn -> after the step
    boundaries: dict[BoundaryKey, torch.Tensor] = field(default_factory=dict)  # when the spec says record
    timings: dict[str, float] = field(default_factory=dict)
    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> fqn -> after an optimizer step
    unmapped: list[str] = field(default_factory=list)  # the engine's parameter names with no original FQN
    failure: RankError | None = None  # this rank failed before communicating
