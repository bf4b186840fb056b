"""DetachExecutor: run a Pipe stage by stage in one process, exactly as a pipeline would.

    ex = pc.DetachExecutor(pc.split(model, (x,)))
    res = ex.step((x,), loss_fn=F.mse_loss, target=y, n_microbatches=4)
    res.outputs, res.loss, res.grads["layers.0.weight"]

Every stage-boundary tensor is detached, so each stage is its own autograd
graph; backward runs one explicit call per stage in reverse stage order, and
gradients of skip connections (a value read by several later stages) and of
tied parameters (one parameter in several stages) are summed explicitly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._microbatch import merge_microbatches, split_microbatches
from pipecheck._pipe import Pipe
from pipecheck._result import StepResult
from pipecheck._stage_step import (
    LeafGrads,
    StageForward,
    add_leaf_grads,
    add_param_grads,
    stage_backward,
    stage_forward,
)
from pipecheck.losses import check_scalar_loss, default_microbatch_target, projection_loss

LossFn = Callable[[Any, Any], torch.Tensor]


def sum_stage_grads(per_stage: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full gradients: a tied parameter's replicas are summed in stage order."""
    total: dict[str, torch.Tensor] = {}
    for grads in per_stage:
        add_param_grads(total, dict(grads))
    return total


class DetachExecutor:
    """Single-process reference runner of a :class:`pipecheck.Pipe`."""

    def __init__(self, pipe: Pipe, *, drop_gradients: Iterable[tuple[int, str, int]] = ()) -> None:
        """``drop_gradients``: (producer stage, value name, consumer stage) edges whose gradient is
        discarded instead of sent back — a what-if run, used to recognise that bug in an engine."""
        self.pipe = pipe
        self.drop_gradients = frozenset(drop_gradients)

    def forward_microbatch(self, inputs: Mapping[str, Any]) -> list[StageForward]:
        """All stages' forwards of one micro-batch, in stage order."""
        produced: dict[tuple[int | None, str], Any] = {(None, k): v for k, v in inputs.items()}
        forwards = []
        for stage in self.pipe.stages:
            fwd = stage_forward(stage, [produced[(src.stage, src.name)] for src in stage.inputs])
            produced.update(((stage.index, name), value) for name, value in zip(stage.outputs, fwd.outputs))
            forwards.append(fwd)
        return forwards

    def backward_microbatch(self, forwards: list[StageForward], loss: torch.Tensor, loss_scale: float,
                            param_grads: list[dict[str, torch.Tensor]],
                            owned: list[set[str]]) -> dict[str, LeafGrads]:
        """All stages' backwards of one micro-batch, last stage first. Returns model-input grads."""
        pending: dict[tuple[int | None, str], LeafGrads] = {}
        for stage in reversed(self.pipe.stages):
            fwd = forwards[stage.index]
            last = stage.index == self.pipe.num_stages - 1
            out_grads = [pending.pop((stage.index, name), None) for name in stage.outputs]
            in_grads, p_grads = stage_backward(stage, fwd, out_grads, loss if last else None, loss_scale)
            add_param_grads(param_grads[stage.index], p_grads, owned[stage.index])
            for src, grads in zip(stage.inputs, in_grads):
                if src.stage is not None and (src.stage, src.name, stage.index) in self.drop_gradients:
                    continue
                key = (src.stage, src.name)
                pending[key] = add_leaf_grads(pending.get(key), grads)
        return {name: grads for (stage, name), grads in pending.items() if stage is None}

    def step(self, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
             loss_fn: LossFn | None = None, target: Any = None, n_microbatches: int = 1) -> StepResult:
        """One training step; the loss is the mean over micro-batches of ``loss_fn(out_mb, target_mb)``.

        Without ``loss_fn`` the loss is a seeded random projection of every output element.
        """
        started = time.perf_counter()
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        inputs = split_microbatches(self.pipe.bind_inputs(args, kwargs), n_microbatches)
        forwards = [self.forward_microbatch(mb) for mb in inputs]
        outputs = [pytree.tree_unflatten(list(f[-1].outputs), self.pipe.out_spec) for f in forwards]
        merged = merge_microbatches([pytree.tree_map(_detached, o) for o in outputs])
        if loss_fn is None:
            loss_fn = projection_loss
            targets = [default_microbatch_target(out, m) for m, out in enumerate(outputs)]
        elif target is not None:
            targets = split_microbatches(target, n_microbatches, "target")
        else:
            targets = [None] * n_microbatches
        losses = [check_scalar_loss(loss_fn(out, tgt), loss_fn) for out, tgt in zip(outputs, targets)]
        param_grads: list[dict[str, torch.Tensor]] = [{} for _ in self.pipe.stages]
        input_grads: list[dict[str, LeafGrads]] = []
        owned: list[set[str]] = [set() for _ in self.pipe.stages]
        for fwd, loss in zip(forwards, losses):
            input_grads.append(self.backward_microbatch(fwd, loss, 1.0 / n_microbatches, param_grads, owned))
        return StepResult(
            outputs=merged,
            loss=torch.stack([loss.detach() for loss in losses]).mean(),
            grads=sum_stage_grads(param_grads),
            input_grads=_merge_input_grads(input_grads),
            timings={"step_s": time.perf_counter() - started},
            stage_grads=param_grads,
        )


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _merge_input_grads(per_mb: list[dict[str, LeafGrads]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for name in per_mb[0]:
        leaves = [mb.get(name) for mb in per_mb]
        if all(grads is not None and len(grads) == 1 and grads[0] is not None for grads in leaves):
            merged[name] = merge_microbatches([grads[0] for grads in leaves])  # type: ignore[index]
    return merged
