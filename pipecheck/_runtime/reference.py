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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._core.precision import PLAIN, Precision
from pipecheck._core.result import StepResult
from pipecheck._runtime.randomness import microbatch
from pipecheck._runtime.stage_step import (
    InputGradKey,
    LeafGrads,
    StageForward,
    add_leaf_grads,
    add_param_grads,
    merge_input_grads,
    stage_backward,
    stage_forward,
)
from pipecheck._split.inputs import as_args
from pipecheck._split.microbatch import merge_microbatches, replicated_names, split_microbatches
from pipecheck._split.pipe import Pipe
from pipecheck.losses import LossFn, MicrobatchLoss, Reduction


def sum_stage_grads(per_stage: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full gradients: a tied parameter's replicas are summed in stage order."""
    total: dict[str, torch.Tensor] = {}
    for grads in per_stage:
        add_param_grads(total, dict(grads))
    return total


@dataclass(frozen=True)
class Accumulation:
    """How the reference adds up gradients: the same math, summed in another order or dtype.

        DetachExecutor(pipe, accumulation=Accumulation(reverse=True))          # last first
        DetachExecutor(pipe, accumulation=Accumulation(dtype=torch.float32))   # Megatron's main_grad

    ``reverse``: the micro-batches' backwards run last first (each parameter's gradient summed in that
    order), a value read by several later stages sums its consumers' gradients first stage first, and a
    tied parameter sums its replicas last stage first. ``dtype``: parameter gradients are accumulated
    over the micro-batches in that dtype, and returned in it. ``scale_after``: each micro-batch's
    backward starts from its loss unscaled, and the summed gradients are divided by the micro-batch
    count at the end (torch.distributed.pipelining's ``scale_grads``; not the same rounding where the
    count is not a power of 2)."""

    reverse: bool = False
    dtype: torch.dtype | None = None
    scale_after: bool = False


class DetachExecutor:
    """Single-process reference runner of a :class:`pipecheck.Pipe`."""

    def __init__(self, pipe: Pipe, *, drop_gradients: Iterable[tuple[int, str, int]] = (),
                 accumulation: Accumulation = Accumulation(), precision: Precision = PLAIN) -> None:
        """``drop_gradients``: (producer stage, value name, consumer stage) edges whose gradient is
        discarded instead of sent back — a what-if run, used to recognise that bug in an engine.
        ``accumulation``: the order and dtype gradients are summed in (default: as a pipeline does,
        micro-batch 0 first, in the parameters' dtype, or ``precision.grad_accumulation``).
        ``precision``: forwards and losses under its autocast."""
        self.pipe = pipe
        self.drop_gradients = frozenset(drop_gradients)
        if accumulation.dtype is None and precision.grad_accumulation is not None:
            accumulation = Accumulation(accumulation.reverse, precision.grad_accumulation)
        self.accumulation = accumulation
        self.precision = precision

    def forward_microbatch(self, inputs: Mapping[str, Any]) -> list[StageForward]:
        """All stages' forwards of one micro-batch, in stage order."""
        produced: dict[tuple[int | None, str], Any] = {(None, k): v for k, v in inputs.items()}
        forwards = []
        for stage in self.pipe.stages:
            fwd = stage_forward(stage, [produced[(src.stage, src.name)] for src in stage.inputs])
            produced.update(((stage.index, name), value) for name, value in zip(stage.outputs, fwd.outputs))
            forwards.append(fwd)
        return forwards

    def backward_microbatch(self, mb: int, forwards: list[StageForward], loss: torch.Tensor, loss_scale: float,
                            param_grads: list[dict[str, torch.Tensor]], owned: list[set[str]],
                            input_grads: dict[InputGradKey, LeafGrads]) -> None:
        """All stages' backwards of micro-batch ``mb``, last stage first; model-input gradients
        go to ``input_grads`` by (consuming stage, input name, micro-batch)."""
        pending: dict[tuple[int, str], list[LeafGrads]] = {}  # by value: its consumers' gradients, last stage first
        for stage in reversed(self.pipe.stages):
            fwd = forwards[stage.index]
            last = stage.index == self.pipe.num_stages - 1
            out_grads = [self._summed(pending.pop((stage.index, name), [])) for name in stage.outputs]
            in_grads, p_grads = stage_backward(stage, fwd, out_grads, loss if last else None, loss_scale)
            add_param_grads(param_grads[stage.index], self._accumulated(p_grads), owned[stage.index])
            for src, grads in zip(stage.inputs, in_grads):
                if src.stage is None:
                    input_grads[(stage.index, src.name, mb)] = grads
                elif (src.stage, src.name, stage.index) not in self.drop_gradients:
                    pending.setdefault((src.stage, src.name), []).append(grads)

    def _summed(self, consumers: list[LeafGrads]) -> LeafGrads | None:
        """A value's gradient from its consumers' (last stage first; first stage first with ``reverse``)."""
        total: LeafGrads | None = None
        for grads in reversed(consumers) if self.accumulation.reverse else consumers:
            total = add_leaf_grads(total, grads)
        return total

    def _accumulated(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dtype = self.accumulation.dtype
        return grads if dtype is None else {fqn: g.to(dtype) for fqn, g in grads.items()}

    def step(self, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
             loss_fn: LossFn | None = None, target: Any = None, n_microbatches: int = 1,
             reduction: Reduction | None = None) -> StepResult:
        """One training step; the loss is the mean over micro-batches of ``loss_fn(out_mb, target_mb)``,
        or with ``reduction`` the sum of each micro-batch's loss times ``reduction.weight``.

        Without ``loss_fn`` the loss is a seeded random projection of every output element.
        """
        started = time.perf_counter()
        bound = self.pipe.bind_inputs(as_args(args), kwargs)
        inputs = split_microbatches(bound, n_microbatches, uneven=reduction is not None and reduction.uneven)
        loss_of = MicrobatchLoss(loss_fn, target, n_microbatches, reduction)
        scale = 1.0 / n_microbatches if reduction is None else reduction.weight
        forwards = []
        autocast = self.precision.forward(self._device())
        for mb, values in enumerate(inputs):
            with microbatch(mb), autocast:  # random ops drawn by pipecheck's contract, where a check has any
                forwards.append(self.forward_microbatch(values))
        outputs = [pytree.tree_unflatten(list(f[-1].outputs), self.pipe.out_spec) for f in forwards]
        merged = merge_microbatches([pytree.tree_map(_detached, o) for o in outputs])
        with autocast:
            losses = [loss_of(mb, out) for mb, out in enumerate(outputs)]
        param_grads: list[dict[str, torch.Tensor]] = [{} for _ in self.pipe.stages]
        input_grads: dict[InputGradKey, LeafGrads] = {}
        owned: list[set[str]] = [set() for _ in self.pipe.stages]
        order = range(len(forwards) - 1, -1, -1) if self.accumulation.reverse else range(len(forwards))
        after = self.accumulation.scale_after
        for mb in order:
            with microbatch(mb, backward=True):  # a checkpointed region recomputes under the RNG state it saved
                self.backward_microbatch(mb, forwards[mb], losses[mb], 1.0 if after else scale, param_grads, owned,
                                         input_grads)
        grads = sum_stage_grads(param_grads[::-1] if self.accumulation.reverse else param_grads)
        merged_input_grads = merge_input_grads(input_grads, n_microbatches, replicated_names(bound),
                                               self.accumulation.reverse)
        if after:
            grads, merged_input_grads = ({name: _rescaled(g, reduction, n_microbatches) for name, g in values.items()}
                                         for values in (grads, merged_input_grads))
        return StepResult(
            outputs=merged,
            loss=weighted_loss([loss.detach() for loss in losses], reduction),
            grads=grads,
            input_grads=merged_input_grads,
            buffers=self.pipe.buffers_after_step(),
            timings={"step_s": time.perf_counter() - started},
            stage_grads=param_grads,
        )

    def _device(self) -> torch.device:
        return next((p.device for stage in self.pipe.stages for p in stage.module.parameters()), torch.device("cpu"))

    def microbatch_grads(self, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
                         loss_fn: LossFn | None = None, target: Any = None, n_microbatches: int = 1
                         ) -> list[dict[str, torch.Tensor]]:
        """Each micro-batch's own share of :meth:`step`'s parameter gradients (its loss divided by
        ``n_microbatches``, as in the step): the shares sum to the step's gradients."""
        bound = self.pipe.bind_inputs(as_args(args), kwargs)
        loss_of = MicrobatchLoss(loss_fn, target, n_microbatches)
        shares = []
        for mb, values in enumerate(split_microbatches(bound, n_microbatches)):
            with self.precision.forward(self._device()):
                forwards = self.forward_microbatch(values)
                loss = loss_of(mb, pytree.tree_unflatten(list(forwards[-1].outputs), self.pipe.out_spec))
            param_grads: list[dict[str, torch.Tensor]] = [{} for _ in self.pipe.stages]
            self.backward_microbatch(mb, forwards, loss, 1.0 / n_microbatches, param_grads,
                                     [set() for _ in self.pipe.stages], {})
            shares.append(sum_stage_grads(param_grads))
        return shares


def weighted_loss(losses: Sequence[torch.Tensor], reduction: Reduction | None) -> torch.Tensor:
    """A step's loss from its micro-batches' own: their mean, or their sum times ``reduction.weight``."""
    if reduction is None:
        return torch.stack(list(losses)).mean()
    return torch.stack(list(losses)).sum() * reduction.weight


def _rescaled(grad: torch.Tensor, reduction: Reduction | None, n_microbatches: int) -> torch.Tensor:
    """A gradient summed over unscaled micro-batch losses, scaled at the end as the step's loss is."""
    return grad / n_microbatches if reduction is None else grad * reduction.weight


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
