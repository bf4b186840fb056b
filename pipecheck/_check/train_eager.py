"""The eager side of a training check: the model trained step by step, in its dtype and in float64.

    batches = prepared_batches(model, job_batches, dtype, device)
    eager = train_eager(model, batches, training, loss_fn, n_microbatches)            # list[StepResult]
    truth = train_eager(model64, batches64, training, loss_fn, n_microbatches)        # float64, same loop

Every optimizer step runs ``accumulation_steps`` schedule steps; each runs its batch micro-batch by
micro-batch (as a pipeline sees it), weighs every micro-batch's loss as the loss convention says
(:class:`pipecheck.losses.Reduction`) and adds its gradients. The step's result holds the gradients
before the optimizer; then clipping (``torch.nn.utils.clip_grad_norm_``) and the optimizer update the
model, and the result holds every parameter after. Without ``loss_fn`` each batch's target is the
seeded projection of its outputs, filled in on the batch (every runner gets it).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from pipecheck._check.eager import _call, _detached, _gradients
from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch, Training
from pipecheck._runtime.optimizer import build_optimizer
from pipecheck._split.inputs import Inputs, cast_inputs, cast_module, prepare_inputs
from pipecheck._split.microbatch import merge_microbatches, split_microbatches
from pipecheck.losses import LossFn, MicrobatchLoss, Reduction, projection_loss, projection_target


def prepared_batches(model: nn.Module, batches: Sequence[Batch], dtype: torch.dtype | None,
                     device: str | None) -> list[Inputs]:
    """Each batch bound to ``model.forward``, cast and copied (the caller's tensors only ever read)."""
    return [prepare_inputs(model, batch.args, batch.kwargs, batch.target, dtype=dtype, device=device)
            for batch in batches]


def train_eager(model: nn.Module, batches: list[Inputs], training: Training, loss_fn: LossFn | None,
                n_microbatches: int, targets: list[Any] | None = None,
                perturb: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[list[StepResult], list[Any]]:
    """``training.steps`` optimizer steps of ``model`` itself (trained in place: pass a copy).

    ``targets``: each batch's target (the fp32 run's, cast); None: the batches' own, the projection's
    weights where there is no ``loss_fn``. ``perturb(step, name, grad)``: added to each gradient the
    optimizer gets (not to the one reported). Returns one result per optimizer step and the targets used."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(training.optimizer, [p for _, p in params]) if training.optimizer else None
    g = training.accumulation_steps
    used = list(targets) if targets is not None else [None] * len(batches)
    results = []
    for t in range(training.steps):
        group = range(t * g, (t + 1) * g)
        sums: list[torch.Tensor | None] = [None] * len(params)
        outputs, losses = [], []
        forwards = {i: _forward(model, batches[i], n_microbatches, training.loss_reduction != "mean") for i in group}
        for i in group:
            if used[i] is None:
                used[i] = batches[i].target if loss_fn is not None else projection_target(
                    merge_microbatches(_detached(forwards[i])))
        reduction = Reduction.of(training.loss_reduction, [used[i] for i in group], n_microbatches,
                                 training.ignore_index)
        for i in group:
            mb_outputs = forwards.pop(i)
            loss_of = MicrobatchLoss(loss_fn or projection_loss, used[i], n_microbatches, reduction)
            total = torch.stack([loss_of(mb, out) for mb, out in enumerate(mb_outputs)]).sum() * reduction.weight
            if params and total.requires_grad:
                for k, grad in enumerate(_gradients(model, total, [p for _, p in params])):
                    total_k = sums[k]
                    if grad is not None:
                        sums[k] = grad if total_k is None else total_k + grad
            outputs.append(merge_microbatches(_detached(mb_outputs)))
            losses.append(total.detach())
            del mb_outputs, total
        grads = {name: grad for (name, _), grad in zip(params, sums) if grad is not None}
        if optimizer is not None:
            for (name, param), grad in zip(params, sums):
                param.grad = None if grad is None else grad.detach().clone()
                if perturb is not None and param.grad is not None:
                    param.grad += perturb(t, name, param.grad)
            if training.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([p for _, p in params], training.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append(StepResult(
            outputs[0] if g == 1 else tuple(outputs), torch.stack(losses).sum(), grads,
            buffers={name: b.detach().clone() for name, b in model.named_buffers()},
            params={name: p.detach().clone() for name, p in params} if optimizer is not None else {}))
    return results, used


def _forward(model: nn.Module, inputs: Inputs, n_microbatches: int, uneven: bool) -> list[Any]:
    """One batch's micro-batches run forward, their graphs kept for the backward."""
    bound = inputs.signature.bind(*inputs.args, **inputs.kwargs)
    calls = [inspect.BoundArguments(bound.signature, chunk)
             for chunk in split_microbatches(dict(bound.arguments), n_microbatches, uneven=uneven)]
    return [_call(model, call, n_microbatches, whole=bound) for call in calls]


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` as it is now (its parameters, buffers and train/eval mode)."""
    return cast_module(copy.deepcopy(model), torch.float64)


def float64_batches(batches: list[Inputs], targets: list[Any]) -> tuple[list[Inputs], list[Any]]:
    """The batches and targets with their floating tensors in float64 (copies)."""
    cast = []
    for inputs in batches:
        args, kwargs, target = inputs.to64()
        cast.append(replace(inputs, args=args, kwargs=kwargs, target=target, source=(args, kwargs, target)))
    return cast, [cast_inputs(target, torch.float64, None, copy=True) for target in targets]
