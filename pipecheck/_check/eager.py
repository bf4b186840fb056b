"""The eager side of a check: the model run per micro-batch, as a pipeline sees it.

    eager, target = eager_step(model, inputs, loss_fn, n_microbatches, check_grads=True)
    check_finite(eager)                                          # NonFiniteError on NaN/Inf

The loss is the mean over micro-batches of ``loss_fn(out_mb, target_mb)``;
without ``loss_fn`` it is the seeded random projection of every output
element, and the projection weights become the target every runner gets.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._check.draws import LossDraws
from pipecheck._check.numerics import nonfinite
from pipecheck._check.placement import spilled
from pipecheck._core.precision import PLAIN, Precision
from pipecheck._core.result import StepResult
from pipecheck._core.torch_warnings import torch_internal_warnings_ignored
from pipecheck._split.inputs import Inputs, cast_module
from pipecheck._split.microbatch import merge_microbatches, split_microbatches, unwrap_replicated
from pipecheck._split.model_factory import buffers_kept
from pipecheck.errors import InputError, NonFiniteError, PipecheckError, first_line
from pipecheck.losses import LossFn, MicrobatchLoss, projection_loss, projection_target


def output_name(path: tuple[Any, ...]) -> str:
    """An output leaf's row name: ``output``, ``output[0]``, ``output['logits']``."""
    return "output" + pytree.keystr(path)


def eager_step(model: nn.Module, inputs: Inputs, loss_fn: LossFn | None, n_microbatches: int,
               check_grads: bool, *, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
               target: Any = None, backward_each: bool = False,
               precision: Precision = PLAIN) -> tuple[StepResult, Any]:
    """The model run eagerly on each micro-batch; loss = mean of per-micro-batch losses.

    Runs on ``inputs`` (or on ``args``/``kwargs``/``target`` bound the same way, e.g. their
    float64 copies). Returns the result and the target used (the projection weights when
    ``loss_fn`` is None). ``backward_each`` (with a ``loss_fn``): each micro-batch's backward
    right after its forward, gradients summed, so that one micro-batch's activations are alive at
    a time (the float64 truth's memory), not all of them. ``precision``: forwards under its autocast,
    and with its ``grad_accumulation`` each micro-batch's gradient summed in that dtype, first to last.
    """
    if args is None:
        args, kwargs, target = inputs.args, inputs.kwargs, inputs.target
    bound = inputs.signature.bind(*args, **(kwargs or {}))
    calls = [inspect.BoundArguments(bound.signature, chunk)
             for chunk in split_microbatches(dict(bound.arguments), n_microbatches)]  # errors name the input
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if precision.grad_accumulation is not None and check_grads:
        if loss_fn is None:  # the projection's weights come from the outputs' shapes: one plain forward first
            with torch.no_grad(), buffers_kept(model), precision.forward(device):
                outputs = [_call(model, call, n_microbatches, whole=bound) for call in calls]
            loss_fn, target = projection_loss, projection_target(merge_microbatches(_detached(outputs)))
            del outputs
        backward_each = True
    if backward_each and loss_fn is not None and check_grads:
        return _step_each(model, bound, calls, MicrobatchLoss(loss_fn, target, n_microbatches), precision), target
    outputs = []
    for call in calls:  # autocast entered per micro-batch, as engines do: each casts the weights anew
        with precision.forward(device):
            outputs.append(_call(model, call, n_microbatches, whole=bound))
    merged = merge_microbatches(_detached(outputs))
    if loss_fn is None:
        loss_fn, target = projection_loss, projection_target(merged)
    loss_of = MicrobatchLoss(loss_fn, target, n_microbatches)
    losses = []
    for mb in range(len(outputs)):
        with precision.forward(device):
            with LossDraws():
                losses.append(loss_of(mb, outputs[mb]))
    outputs.clear()  # the merged copy is the result: the graph's own outputs go before its backward
    loss = torch.stack(losses).mean()
    grads: dict[str, torch.Tensor] = {}
    input_grads: dict[str, torch.Tensor] = {}
    if check_grads:
        params, named_inputs = _differentiable(model, bound)
        wrt = [p for _, p in params] + [t for _, t in named_inputs]
        if wrt and loss.requires_grad:
            grads, input_grads = _by_name(params, named_inputs, _gradients(model, loss, wrt))
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return StepResult(merged, loss.detach(), grads, input_grads, buffers), target


def _step_each(model: nn.Module, bound: inspect.BoundArguments, calls: list[inspect.BoundArguments],
               loss_of: MicrobatchLoss, precision: Precision = PLAIN) -> StepResult:
    """:func:`eager_step` with each micro-batch's backward (of its loss / n) before the next forward;
    parameter gradients summed in ``precision.grad_accumulation`` where it says."""
    params, named_inputs = _differentiable(model, bound)
    accumulate = precision.grad_accumulation
    if accumulate is None:  # summed in the tensors' own dtype: autograd adds each into its .grad as it comes
        return _step_into_grad(model, bound, calls, loss_of, precision, params, named_inputs)
    sums: list[torch.Tensor | None] = [None] * (len(params) + len(named_inputs))
    outputs, losses = [], []
    for out, loss, got in _each_microbatch(model, bound, calls, loss_of, precision):
        for i, grad in enumerate(got):
            if grad is not None:
                if accumulate is not None and i < len(params):
                    grad = grad.to(accumulate)
                total = sums[i]
                sums[i] = grad if total is None else total + grad
        outputs.append(out)
        losses.append(loss)
    grads, input_grads = _by_name(params, named_inputs, sums)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return StepResult(merge_microbatches(outputs), torch.stack(losses).mean(), grads, input_grads, buffers)


def _step_into_grad(model: nn.Module, bound: inspect.BoundArguments, calls: list[inspect.BoundArguments],
                    loss_of: MicrobatchLoss, precision: Precision, params: list[tuple[str, torch.Tensor]],
                    named_inputs: list[tuple[str, torch.Tensor]]) -> StepResult:
    """:func:`_step_each` summing each micro-batch's gradients into the tensors' ``.grad`` (put back as they
    were after): a parameter's gradient is added as soon as the backward reaches it, so one set of
    gradients is alive, not the sums and a whole micro-batch's gradients beside them. The same additions
    in the same order (micro-batch 0 first), so the same values."""
    wrt = [p for _, p in params] + [t for _, t in named_inputs]
    saved = [tensor.grad for tensor in wrt]
    outputs, losses = [], []
    try:
        for tensor in wrt:
            tensor.grad = None
            if not tensor.is_leaf:
                tensor.retain_grad()
        for out, loss, _ in _each_microbatch(model, bound, calls, loss_of, precision, into_grad=True):
            outputs.append(out)
            losses.append(loss)
        grads, input_grads = _by_name(params, named_inputs, [tensor.grad for tensor in wrt])
    finally:
        for tensor, grad in zip(wrt, saved):
            tensor.grad = grad
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return StepResult(merge_microbatches(outputs), torch.stack(losses).mean(), grads, input_grads, buffers)


def microbatch_shares(model: nn.Module, inputs: Inputs, loss_fn: LossFn, target: Any, n_microbatches: int,
                      precision: Precision = PLAIN) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Each micro-batch's own share of the eager step's parameter gradients (the gradient of its
    loss / n, run on its own, forward under ``precision``'s autocast), and its loss, in micro-batch
    order: summed, they are the step's gradients and loss in another order. The model's buffers are
    left as found."""
    bound = inputs.signature.bind(*inputs.args, **inputs.kwargs)
    calls = [inspect.BoundArguments(bound.signature, chunk)
             for chunk in split_microbatches(dict(bound.arguments), n_microbatches)]
    params, _ = _differentiable(model, bound)
    shares, losses = [], []
    with buffers_kept(model):
        for _, loss, got in _each_microbatch(model, bound, calls, MicrobatchLoss(loss_fn, target, n_microbatches),
                                             precision):
            shares.append(_by_name(params, [], got[:len(params)])[0])
            losses.append(loss)
    return shares, losses


def _each_microbatch(model: nn.Module, bound: inspect.BoundArguments, calls: list[inspect.BoundArguments],
                     loss_of: MicrobatchLoss, precision: Precision = PLAIN, into_grad: bool = False
                     ) -> Iterator[tuple[Any, torch.Tensor, Sequence[torch.Tensor | None]]]:
    """Per micro-batch, its forward (under ``precision``'s autocast) and backward of its loss / n:
    (outputs, loss, gradients in :func:`_differentiable`'s order), one micro-batch's activations alive
    at a time. ``into_grad``: the gradients are added into the tensors' ``.grad`` instead (none yielded)."""
    n = len(calls)
    params, named_inputs = _differentiable(model, bound)
    wrt = [p for _, p in params] + [t for _, t in named_inputs]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for mb, call in enumerate(calls):
        with precision.forward(device):  # the loss too, as a training loop under autocast computes it
            out = _call(model, call, n, whole=bound)
            with LossDraws():
                loss = loss_of(mb, out)
        got: Sequence[torch.Tensor | None] = [None] * len(wrt)
        if wrt and loss.requires_grad:
            if into_grad:
                _backward(loss / n, wrt)
            else:
                got = _gradients(model, loss / n, wrt)
        yield _detached(out), loss.detach(), got
        del out, loss


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


def _differentiable(model: nn.Module, bound: inspect.BoundArguments
                    ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The parameters and the model inputs a step takes gradients of, by name."""
    params: list[tuple[str, torch.Tensor]] = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    named_inputs: list[tuple[str, torch.Tensor]] = [
        (name, value) for name, value in unwrap_replicated(dict(bound.arguments)).items()
        if isinstance(value, torch.Tensor) and value.requires_grad]
    return params, named_inputs


def _by_name(params: list[tuple[str, torch.Tensor]], named_inputs: list[tuple[str, torch.Tensor]],
             got: Sequence[torch.Tensor | None]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients in ``_differentiable``'s order back to (parameter, input) names; None: none there."""
    grads = {name: g for (name, _), g in zip(params, got) if g is not None}
    input_grads = {name: g for (name, _), g in zip(named_inputs, got[len(params):]) if g is not None}
    return grads, input_grads


def _gradients(model: nn.Module, loss: torch.Tensor, wrt: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    try:
        with torch_internal_warnings_ignored():  # cuBLAS's context warning from autograd's CUDA thread
            if _reentrant_checkpoint_in(loss):
                return _gradients_by_backward(loss, wrt)
            return torch.autograd.grad(loss, wrt, allow_unused=True)
    except PipecheckError:
        raise
    except Exception as err:
        raise InputError(f"the eager model's backward failed ({type(err).__name__}: {first_line(err)}). Fix: check "
                         "that loss.backward() runs on this model eagerly.") from err


def _backward(loss: torch.Tensor, wrt: list[torch.Tensor]) -> None:
    """``loss``'s gradient added into the ``.grad`` of each of ``wrt``; a failure as :func:`_gradients` says it."""
    try:
        with torch_internal_warnings_ignored():
            if _reentrant_checkpoint_in(loss):  # it refuses inputs=: the whole backward, as _gradients_by_backward
                loss.backward()
            else:
                torch.autograd.backward(loss, inputs=wrt)
    except PipecheckError:
        raise
    except Exception as err:
        raise InputError(f"the eager model's backward failed ({type(err).__name__}: {first_line(err)}). Fix: check "
                         "that loss.backward() runs on this model eagerly.") from err


def _reentrant_checkpoint_in(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph holds a ``torch.utils.checkpoint(..., use_reentrant=True)``, whose backward
    runs only under ``loss.backward()`` ("Checkpointing is not compatible with .grad()")."""
    seen, pending = set(), [loss.grad_fn]
    while pending:
        function = pending.pop()
        if function is None or function in seen:
            continue
        seen.add(function)
        if type(function).__name__ == "CheckpointFunctionBackward":
            return True
        pending.extend(next_function for next_function, _ in function.next_functions)
    return False


def _gradients_by_backward(loss: torch.Tensor, wrt: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(loss, wrt)`` through ``loss.backward()``: each tensor's ``.grad`` read, then put
    back as it was (the tensors are pipecheck's own copies of the parameters and inputs)."""
    saved = [tensor.grad for tensor in wrt]
    for tensor in wrt:
        tensor.grad = None
        if not tensor.is_leaf:
            tensor.retain_grad()
    try:
        loss.backward()
        return tuple(tensor.grad for tensor in wrt)
    finally:
        for tensor, grad in zip(wrt, saved):
            tensor.grad = grad


def _call(model: nn.Module, call: inspect.BoundArguments, n_microbatches: int,
          whole: inspect.BoundArguments | None = None) -> Any:
    """``model(*call.args, **call.kwargs)``; a failure is an InputError whose hint is tested, not
    guessed: the batch-size hint only when ``whole`` (the full batch) runs where a micro-batch fails."""
    try:
        return model(*call.args, **call.kwargs)
    except PipecheckError:
        raise
    except Exception as err:
        first = first_line(err)
        failed = f"the eager model failed on {'one micro-batch of ' if n_microbatches > 1 else ''}its inputs"
        mismatch = _placement_mismatch(model, call.arguments)
        if mismatch:
            fix = ("Fix: give inputs in the model's dtype and on its device, or pass dtype=/device= to "
                   "assert_equivalent, which casts the model and the floating inputs alike.")
            raise InputError(f"{failed} ({type(err).__name__}: {first}): {mismatch}. {fix}") from None
        if n_microbatches > 1 and whole is not None and _runs(model, whole):
            raise InputError(
                f"{failed} ({type(err).__name__}: {first}), and runs on the whole batch. "
                f"With n_microbatches={n_microbatches} each call sees 1/{n_microbatches} of the batch. Fix: make "
                "forward work for any batch size (no hard-coded batch), or use n_microbatches=1."
            ) from None
        raise InputError(f"{failed} ({type(err).__name__}: {first}). Fix: check that the model runs "
                         "on these inputs eagerly: model(*args, **kwargs).") from None


def _runs(model: nn.Module, call: inspect.BoundArguments) -> bool:
    """Whether one forward of ``call`` succeeds (no gradients, the model's buffers left as found)."""
    try:
        with torch.no_grad(), buffers_kept(model):
            model(*call.args, **call.kwargs)
    except Exception:
        return False
    return True


def _placement_mismatch(model: nn.Module, arguments: dict[str, Any]) -> str:
    """``"input x is float64 but the model's parameters are float32"`` (or devices), or ""."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        return ""
    dtype, device = params[0].dtype, params[0].device
    problems = []
    for name, value in arguments.items():
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            where = f"input {name}{pytree.keystr(path)}"
            if leaf.is_floating_point() and leaf.dtype != dtype:
                problems.append(f"{where} is {_short(leaf.dtype)} but the model's parameters are {_short(dtype)}")
            if leaf.device != device:
                problems.append(f"{where} is on {leaf.device} but the model's parameters are on {device}")
    return "; ".join(problems)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextmanager
def in_dtype(model: nn.Module, dtype: torch.dtype, spill: bool = False) -> Iterator[nn.Module]:
    """The model itself with its floating parameters and buffers in ``dtype`` for the block, then
    exactly as it was: every parameter's own data back (bit for bit, whatever the cast lost), every
    buffer the very object it was. Stages that share the model's parameters see the same; no second
    copy of the model is made. ``spill``: the parameters' own data waits on the host meanwhile, where nothing
    else holds it (pipecheck._check.placement.spilled), so a tight accelerator holds the float64 copy alone."""
    own: dict[int, torch.Tensor] = {}  # one tensor object a parameter: a tied one's storage is still its alone
    params = [(module, name, param, own.setdefault(id(param), param.data), param.grad,
               None if param.grad is None else param.grad.data)
              for module in model.modules() for name, param in module._parameters.items() if param is not None]
    buffers = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    try:
        cast = cast_module(model, dtype)  # complex parameters to the complex counterpart, never to real
        with spilled(list(own.values()) if spill else []):
            yield cast
    finally:
        for module, name, param, data, grad, grad_data in params:  # the very objects (a cast may replace them)
            module._parameters[name] = param
            param.grad = None  # the cast's gradient first: a float64 one refuses float32 data
            param.data = data
            if grad is not None and grad_data is not None:
                grad.data = grad_data  # the cast wrote a float64 copy into the gradient object itself
            param.grad = grad
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


def named_tensors(result: StepResult) -> list[tuple[str, Any]]:
    """Every compared value of a result by row name: outputs, loss, parameter and input gradients."""
    named = [(output_name(path), leaf) for path, leaf in pytree.tree_flatten_with_path(result.outputs)[0]]
    if result.loss is not None:
        named.append(("loss", result.loss))
    named += [(f"grad {fqn}", g) for fqn, g in result.grads.items()]
    named += [(f"grad input {name}", g) for name, g in result.input_grads.items()]
    return named


def check_finite(eager: StepResult) -> None:
    """Refuse an eager run with NaN anywhere, or an infinite loss or gradient. An infinite output is
    a value like any other (a ``-inf`` logit masking padded vocabulary): compared as itself."""
    outputs = {output_name(path) for path, _ in pytree.tree_flatten_with_path(eager.outputs)[0]}

    def bad_value(name: str, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            return False
        return bool(value.isnan().any()) if name in outputs else nonfinite(value)

    bad = [name for name, value in named_tensors(eager) if bad_value(name, value)]
    if bad:
        raise NonFiniteError(
            f"the eager model itself produced NaN/Inf in: {', '.join(bad)}. No comparison is meaningful. "
            "Fix: check the model and inputs (overflow in float16? log of zero?) before checking the pipeline."
        )


def result_dtype(result: StepResult) -> torch.dtype:
    """The dtype of the first floating output (float32 if none)."""
    for leaf in pytree.tree_leaves(result.outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return torch.float32
