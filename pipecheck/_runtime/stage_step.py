"""Forward and backward of one micro-batch of one stage, shared by every pipecheck runner.

    fwd = stage_forward(stage, values)                # values: one per stage.inputs
    in_grads, p_grads = stage_backward(stage, fwd, output_grads)
    # or split in two (zero-bubble schedules): input gradients now, weight gradients later
    in_grads, pending = stage_backward_input(stage, fwd, output_grads)
    p_grads = stage_backward_weight(stage, pending)

Each stage is its own autograd graph: every tensor crossing into a stage is
detached (keeping ``requires_grad``), and its gradient comes back out of
``stage_backward`` for the producer. The reference runner and the distributed
runtime both call these functions, so they agree bit for bit wherever the
summation order is the same.

Gradients of a (possibly nested) value are a list aligned with
``tree_leaves(value)``, ``None`` where a leaf has none.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._core.torch_warnings import torch_internal_warnings_ignored
from pipecheck._runtime.randomness import stage_draws
from pipecheck._split.microbatch import merge_microbatches
from pipecheck._split.pipe import Stage

LeafGrads = list[torch.Tensor | None]
InputGradKey = tuple[int, str, int]  # (consuming stage, model input name, micro-batch)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def detach_value(value: Any) -> Any:
    """Cut a value's autograd history, keeping which leaves require grad."""
    return pytree.tree_map(_detach, value)


def trainable_params(stage: Stage) -> list[tuple[str, torch.nn.Parameter]]:
    """The stage's parameters that need gradients, once each, by canonical FQN."""
    cached = _TRAINABLE.get(stage.module)
    if cached is not None and all(p.requires_grad for _, p in cached):
        return cached
    seen: dict[str, torch.nn.Parameter] = {}
    for local, param in stage.module.named_parameters(remove_duplicate=False):
        fqn = stage.local_to_fqn.get(local)
        if fqn is not None and param.requires_grad and fqn not in seen:
            seen[fqn] = param
    _TRAINABLE[stage.module] = list(seen.items())
    return _TRAINABLE[stage.module]


def frozen_params(stage: Stage) -> list[tuple[str, torch.nn.Parameter]]:
    """The stage's parameters that need no gradient (``requires_grad=False``), once each, by canonical FQN:
    a training check holds them to their value before the first step."""
    seen: dict[str, torch.nn.Parameter] = {}
    for local, param in stage.module.named_parameters(remove_duplicate=False):
        fqn = stage.local_to_fqn.get(local)
        if fqn is not None and not param.requires_grad and fqn not in seen:
            seen[fqn] = param
    return list(seen.items())


# Per stage module, computed once: backward asks for every micro-batch.
_TRAINABLE: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[str, torch.nn.Parameter]]] = \
    weakref.WeakKeyDictionary()


@dataclass
class StageForward:
    """What one stage's forward of one micro-batch leaves for its backward."""

    inputs: list[Any]
    outputs: tuple[Any, ...]


def stage_forward(stage: Stage, values: Sequence[Any]) -> StageForward:
    """One micro-batch's forward of ``stage`` (its random numbers drawn by pipecheck's randomness contract
    where the check has any: :mod:`pipecheck.randomness`)."""
    inputs = [detach_value(v) for v in values]
    if stage.module in _WRITES_INPUTS:
        with stage_draws(stage.index):
            return StageForward(inputs, tuple(stage.module(*[_writable(v) for v in inputs])))
    try:
        with stage_draws(stage.index):
            outputs = stage.module(*inputs)
    except RuntimeError as err:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(err):
            raise
        # The stage writes into an input (ReLU(inplace=True) right after a cut): from now on it
        # gets non-leaf copies, whose gradients still flow to the detached inputs.
        _WRITES_INPUTS.add(stage.module)
        with stage_draws(stage.index):  # drawn again from the start
            outputs = stage.module(*[_writable(v) for v in inputs])
    return StageForward(inputs, tuple(outputs))


_WRITES_INPUTS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _writable(value: Any) -> Any:
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v, value)


def _grad_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def stage_backward(stage: Stage, fwd: StageForward, output_grads: Sequence[LeafGrads | None] | None = None,
                   loss: torch.Tensor | None = None, loss_scale: float = 1.0
                   ) -> tuple[list[LeafGrads], dict[str, torch.Tensor]]:
    """Backward of one micro-batch: from ``loss`` (last stage, seeded with ``loss_scale``)
    or from the gradients of this stage's outputs. Returns per-input leaf gradients and
    parameter gradients by FQN."""
    roots: list[torch.Tensor] = []
    seeds: list[torch.Tensor] = []
    if loss is not None and loss.requires_grad:
        roots.append(loss)
        seeds.append(torch.full_like(loss, loss_scale))
    for value, grads in zip(fwd.outputs, output_grads or ()):
        if grads is None:
            continue
        for leaf, grad in zip(pytree.tree_leaves(value), grads):
            if grad is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                roots.append(leaf)
                seeds.append(grad)
    params = trainable_params(stage)
    input_leaves = [_grad_leaves(v) for v in fwd.inputs]
    wrt = [leaf for leaves in input_leaves for leaf in leaves] + [p for _, p in params]
    if not roots or not wrt:
        return [_none_grads(v) for v in fwd.inputs], {}
    with torch_internal_warnings_ignored():  # cuBLAS's context warning from autograd's CUDA thread
        grads = list(torch.autograd.grad(roots, wrt, seeds, allow_unused=True))
    param_grads = {fqn: g for (fqn, _), g in zip(params, grads[len(wrt) - len(params):]) if g is not None}
    position = 0
    input_grads: list[LeafGrads] = []
    for value in fwd.inputs:
        leaf_grads: LeafGrads = []
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf_grads.append(grads[position])
                position += 1
            else:
                leaf_grads.append(None)
        input_grads.append(leaf_grads)
    return input_grads, param_grads


@dataclass
class PendingWeights:
    """What a stage's input-gradient half (I) of one micro-batch leaves for its weight-gradient half (W):
    the roots of that micro-batch's graph (kept alive until W) and the gradients that seed them."""

    roots: list[torch.Tensor]
    seeds: list[torch.Tensor]


def _seeded_roots(fwd: StageForward, output_grads: Sequence[LeafGrads | None] | None,
                  loss: torch.Tensor | None, loss_scale: float) -> PendingWeights:
    """The tensors a backward starts from, with their gradients (as :func:`stage_backward` builds them)."""
    pending = PendingWeights([], [])
    if loss is not None and loss.requires_grad:
        pending.roots.append(loss)
        pending.seeds.append(torch.full_like(loss, loss_scale))
    for value, grads in zip(fwd.outputs, output_grads or ()):
        for leaf, grad in zip(pytree.tree_leaves(value), grads or ()):
            if grad is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                pending.roots.append(leaf)
                pending.seeds.append(grad)
    return pending


def stage_backward_input(stage: Stage, fwd: StageForward, output_grads: Sequence[LeafGrads | None] | None = None,
                         loss: torch.Tensor | None = None, loss_scale: float = 1.0
                         ) -> tuple[list[LeafGrads], PendingWeights]:
    """The input-gradient half (I) of one micro-batch's backward: per-input leaf gradients now, and
    what :func:`stage_backward_weight` needs later. Together they compute what :func:`stage_backward`
    does, bit for bit (the same autograd graph, walked twice: inputs first, then parameters).

    The graph is kept (``retain_graph``) until the weight half runs; the weight half must run once,
    with this micro-batch's :class:`PendingWeights`.
    """
    pending = _seeded_roots(fwd, output_grads, loss, loss_scale)
    leaves = [leaf for value in fwd.inputs for leaf in _grad_leaves(value)]
    if not pending.roots or not leaves:
        return [_none_grads(v) for v in fwd.inputs], pending
    grads = iter(torch.autograd.grad(pending.roots, leaves, pending.seeds, retain_graph=True, allow_unused=True))
    input_grads = [[next(grads) if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
                    for leaf in pytree.tree_leaves(value)] for value in fwd.inputs]
    return input_grads, pending


def stage_backward_weight(stage: Stage, pending: PendingWeights) -> dict[str, torch.Tensor]:
    """The weight-gradient half (W) of one micro-batch's backward: parameter gradients by FQN.
    Frees the micro-batch's graph."""
    params = trainable_params(stage)
    if not pending.roots or not params:
        return {}
    grads = torch.autograd.grad(pending.roots, [p for _, p in params], pending.seeds, allow_unused=True)
    return {fqn: g for (fqn, _), g in zip(params, grads) if g is not None}


def _none_grads(value: Any) -> LeafGrads:
    return [None] * len(pytree.tree_leaves(value))


def add_leaf_grads(total: LeafGrads | None, more: LeafGrads) -> LeafGrads:
    """Accumulate gradients of one value from one more consumer (in consumer order)."""
    if total is None:
        return list(more)
    return [b if a is None else a if b is None else a + b for a, b in zip(total, more)]


def add_param_grads(total: dict[str, torch.Tensor], more: dict[str, torch.Tensor],
                    owned: set[str] | None = None) -> None:
    """``total[fqn] += more[fqn]``, bit for bit as ``a + b`` in call order.

    With ``owned`` (the micro-batch loop of one stage), the sum is done in place once
    ``total`` holds a tensor this loop allocated itself: the first gradient is kept as
    autograd returned it (it may be shared, e.g. the gradient of ``p + x`` is also x's),
    the first sum allocates, and every later micro-batch adds into that tensor.
    """
    for fqn, grad in more.items():
        if fqn not in total:
            total[fqn] = grad
        elif owned is not None and fqn in owned:
            total[fqn].add_(grad)
        else:
            total[fqn] = total[fqn] + grad
            if owned is not None:
                owned.add(fqn)


def merge_input_grads(per_key: Mapping[InputGradKey, LeafGrads], n_microbatches: int,
                      replicated: Collection[str] = (), reverse: bool = False) -> dict[str, torch.Tensor]:
    """Gradients of the model's inputs: per micro-batch summed over the consuming stages, last
    stage first (as backward reaches them), then merged in micro-batch order (summed, for a
    ``replicated`` input every micro-batch got whole); ``reverse``: both sums the other way round.
    Inputs that are not one tensor, or miss a micro-batch's gradient, are left out."""
    merged: dict[str, torch.Tensor] = {}
    for name in sorted({name for _, name, _ in per_key}):
        stages = sorted({s for s, other, _ in per_key if other == name}, reverse=not reverse)
        chunks = []
        for mb in range(n_microbatches):
            total: LeafGrads | None = None
            for s in stages:
                if (s, name, mb) in per_key:
                    total = add_leaf_grads(total, per_key[(s, name, mb)])
            chunks.append(total[0] if total and len(total) == 1 else None)
        if all(chunk is not None for chunk in chunks):
            merged[name] = _sum(chunks[::-1] if reverse else chunks) if name in replicated \
                else merge_microbatches(chunks)
    return merged


def _sum(tensors: Sequence[Any]) -> torch.Tensor:
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total
