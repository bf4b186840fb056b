"""The eager side of a check: the model run per micro-batch, as a pipeline sees it.

    eager, target = eager_step(model, inputs, loss_fn, n_microbatches, check_grads=True)
    check_deterministic(model, inputs, n_microbatches, seed)    # InputError if the RNG changes outputs
    check_finite(eager)                                          # NonFiniteError on NaN/Inf

The loss is the mean over micro-batches of ``loss_fn(out_mb, target_mb)``;
without ``loss_fn`` it is the seeded random projection of every output
element, and the projection weights become the target every runner gets.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipecheck._check.numerics import AUTO_FLOOR_EPS, nonfinite
from pipecheck._core.precision import PLAIN, Precision
from pipecheck._core.result import StepResult
from pipecheck._core.torch_warnings import torch_internal_warnings_ignored
from pipecheck._split.inputs import Inputs, cast_module
from pipecheck._split.microbatch import merge_microbatches, split_microbatches, unwrap_replicated
from pipecheck._split.model_factory import buffers_kept, rng_fingerprint, seeded
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
    for mb, out in enumerate(outputs):
        with precision.forward(device):
            losses.append(loss_of(mb, out))
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
    sums: list[torch.Tensor | None] = [None] * (len(params) + len(named_inputs))
    outputs, losses = [], []
    accumulate = precision.grad_accumulation
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
                     loss_of: MicrobatchLoss, precision: Precision = PLAIN
                     ) -> Iterator[tuple[Any, torch.Tensor, Sequence[torch.Tensor | None]]]:
    """Per micro-batch, its forward (under ``precision``'s autocast) and backward of its loss / n:
    (outputs, loss, gradients in :func:`_differentiable`'s order), one micro-batch's activations alive
    at a time."""
    n = len(calls)
    params, named_inputs = _differentiable(model, bound)
    wrt = [p for _, p in params] + [t for _, t in named_inputs]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for mb, call in enumerate(calls):
        with precision.forward(device):  # the loss too, as a training loop under autocast computes it
            out = _call(model, call, n, whole=bound)
            loss = loss_of(mb, out)
        got: Sequence[torch.Tensor | None] = (_gradients(model, loss / n, wrt) if wrt and loss.requires_grad
                                              else [None] * len(wrt))
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
            return torch.autograd.grad(loss, wrt, allow_unused=True)
    except PipecheckError:
        raise
    except Exception as err:
        first = first_line(err)
        if "use_reentrant=True" in str(err):
            raise InputError(f"{type(model).__name__} uses torch.utils.checkpoint(..., use_reentrant=True), whose "
                             "backward runs only under loss.backward(); a pipeline stage's backward (and the "
                             "eager step pipecheck compares against) computes gradients with torch.autograd.grad. "
                             "Fix: checkpoint(..., use_reentrant=False), torch's recommended mode.") from None
        raise InputError(f"the eager model's backward failed ({type(err).__name__}: {first}). Fix: check that "
                         "loss.backward() runs on this model eagerly.") from err


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
def in_dtype(model: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """The model itself with its floating parameters and buffers in ``dtype`` for the block, then
    exactly as it was: every parameter's own data back (bit for bit, whatever the cast lost), every
    buffer the very object it was. Stages that share the model's parameters see the same; no second
    copy of the model is made."""
    params = [(module, name, param, param.data, param.grad, None if param.grad is None else param.grad.data)
              for module in model.modules() for name, param in module._parameters.items() if param is not None]
    buffers = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    try:
        yield cast_module(model, dtype)  # complex parameters to the complex counterpart, never to real
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


def check_deterministic(model: nn.Module, inputs: Inputs, n_microbatches: int, seed: int) -> None:
    """Refuse a model whose outputs are random: no pipeline can match it, and its spread would widen
    the auto tolerance until a wrong answer passes. Leaves the model's buffers as found.

    Two forwards of the first micro-batch under different seeds (torch's, Python's ``random`` and
    numpy's: :func:`seeded`). A difference beyond the square root of the dtype's epsilon
    (scaled by the output) is randomness: dropout, sampling, a generator or call counter of the
    model's own. A smaller one is randomness only if the forward drew from an RNG and a third
    forward under the first seed gives back the first's bits, and the change exceeds the auto
    tolerance's floor (2 epsilons of the output's scale): stochastic depth behind a 1e-6 layer scale
    moves outputs by ~7 epsilons; a random permutation undone after a BatchNorm (MoCo's shuffle-BN)
    only reorders a sum, by under one; GPU kernels that add with atomics (``index_add``,
    ``scatter_add``) differ in the last bits from call to call without drawing anything."""
    found = _random_outputs(model, inputs, n_microbatches, seed)
    if found:
        raise _random_model_error(model, found, _parameters_written(model, inputs, n_microbatches, seed))


def refuse_random(model: nn.Module, inputs: Inputs, n_microbatches: int, seed: int) -> None:
    """:func:`check_deterministic`'s refusal if ``model`` is random; nothing if it is not, or if its
    eager forward fails (the caller's own error then stands)."""
    try:
        found = _random_outputs(model, inputs, n_microbatches, seed)
    except Exception:
        return
    if found:
        raise _random_model_error(model, found, _parameters_written(model, inputs, n_microbatches, seed))


def _parameters_written(model: nn.Module, inputs: Inputs, n_microbatches: int, seed: int) -> list[str]:
    """The parameters one forward of the first micro-batch writes in place (``weight.mul_`` under
    ``no_grad``, ``weight.data.copy_``), each put back as found. Only on the way to a refusal: it
    copies every parameter."""
    params = dict(model.named_parameters())
    saved = {name: p.detach().clone() for name, p in params.items()}
    call = inspect.BoundArguments(inputs.signature, split_microbatches(inputs.unspoiled().arguments,
                                                                        n_microbatches)[0])
    try:
        with seeded(seed), torch.no_grad(), buffers_kept(model):
            _call(model, call, n_microbatches)
    except Exception:
        return []
    finally:
        written = [name for name, p in params.items() if not _same_bits(saved[name], p.detach())]
        with torch.no_grad():
            for name in written:
                params[name].copy_(saved[name])
    return written


class _Draws(TorchDispatchMode):
    """The random ops a block calls (torch's ``nondeterministic_seeded`` ops, whatever generator they
    draw from) and the generators of the model's own they draw from, each with its state at first
    use: seen by what the forward does, not by whether torch's global RNG moved."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []

    supports_higher_order_operators = True  # torch.cond and the like pass through (their bodies unwatched)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.add(f"{func.namespace}.{func._opname}")
            for leaf in pytree.tree_leaves((args, kwargs)):
                if (isinstance(leaf, torch.Generator) and all(leaf is not g for g, _ in self.generators)
                        and not _is_default(leaf)):
                    self.generators.append((leaf, leaf.get_state()))
        return func(*args, **kwargs)


def _is_default(generator: torch.Generator) -> bool:
    """Whether ``generator`` is its device's default one, passed explicitly (the dispatcher hands over
    a new Python object for it: told apart by its state, which a generator of one's own matches only
    if seeded and drawn alike)."""
    if generator.device.type == "cpu":
        default = torch.default_generator
    elif generator.device.type == "cuda":
        default = torch.cuda.default_generators[generator.device.index or 0]
    else:
        return False
    return generator.initial_seed() == default.initial_seed() and torch.equal(generator.get_state(),
                                                                              default.get_state())


def _random_outputs(model: nn.Module, inputs: Inputs, n_microbatches: int, seed: int) -> str:
    """Why the model's outputs are random ("" if they are not).

    Forwards run plainly first: torch's, Python's and numpy's RNGs show a draw by moving. Where the
    outputs' bits move and none of them did, the forwards run again watched by :class:`_Draws`
    (a dispatch mode costs time and, on CPU, memory: only then): a random op on a generator of the
    model's own, which is then reseeded like torch's (its state as found for the first and third
    forwards, another seed for the second) and left as found; or no random op at all (kernels that
    add in another order, as GPU atomics do)."""
    draws, watching = _Draws(), False

    def forward(offset: int) -> tuple[list[Any], bool]:
        nonlocal inputs
        inputs = inputs.unspoiled()  # a forward that wrote into its inputs: the next run gets a copy
        call = inspect.BoundArguments(inputs.signature, split_microbatches(inputs.arguments, n_microbatches)[0])
        for generator, state in draws.generators:
            if offset == 1:
                generator.set_state(state)
            else:
                generator.manual_seed(seed + offset)
        with seeded(seed + offset), torch.no_grad(), buffers_kept(model):
            before = rng_fingerprint()
            with draws if watching else contextlib.nullcontext():
                leaves = pytree.tree_leaves(_call(model, call, n_microbatches))
            drew = rng_fingerprint() != before or bool(draws.ops)
        return leaves, drew

    try:
        (first, drew_first), (second, drew_second) = forward(1), forward(2)
        if not (drew_first or drew_second) and not _all_same_bits(first, second) and not _differs(first, second):
            watching = True  # the bits moved with no RNG of torch's, Python's or numpy's moving: watch the ops
            forward(1)  # which random ops, on which generators (their states as found)
            if not draws.ops:
                return ""  # no draw: kernels that add in another order
            (first, drew_first), (second, drew_second) = forward(1), forward(2)
        why = _judge_draws(forward, first, second, drew_first or drew_second)
        if why.startswith("its forward draws") and not watching:
            watching = True
            forward(1)  # only to name the ops it draws with
        what = ", ".join(sorted(draws.ops)) if draws.ops else "Python's or numpy's RNG"  # watched: no torch op
        own = ", from a torch.Generator of its own" if draws.generators else ""
        return why.replace("{what}", what + own)
    finally:
        for generator, state in draws.generators:
            generator.set_state(state)


def _all_same_bits(first: list[Any], second: list[Any]) -> bool:
    return all(_same_bits(a, b) for a, b in zip(first, second) if isinstance(a, torch.Tensor))


def _differs(first: list[Any], second: list[Any]) -> bool:
    return any(_differ(a, b) for a, b in zip(first, second) if isinstance(a, torch.Tensor))


def _judge_draws(forward: Callable[[int], tuple[list[Any], bool]], first: list[Any], second: list[Any],
                 drew: bool) -> str:
    """The verdict on two forwards under different seeds; ``{what}`` stands for the draws."""
    pairs = [(a, b) for a, b in zip(first, second) if isinstance(a, torch.Tensor)]
    if _differs(first, second):
        return "two eager forwards of the same micro-batch under different seeds give different outputs"
    if not drew or _all_same_bits(first, second):
        return ""
    worst = max(_relative_change(a, b) for a, b in pairs)
    if not any(_relative_change(a, b) > AUTO_FLOOR_EPS * torch.finfo(a.dtype).eps
               for a, b in pairs if a.is_floating_point()):
        return ""  # within the rounding of a reordered sum (a random permutation undone): no draw decides a value
    again, _ = forward(1)
    if _all_same_bits(first, again):
        return (f"its forward draws random numbers ({{what}}), and its outputs follow the seed: they change "
                f"by up to {worst:.1e} relative under another seed and come back bit for bit under the same one")
    return ""


def _same_bits(a: torch.Tensor, b: Any) -> bool:
    return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                              and torch.equal(a.nan_to_num(), b.nan_to_num())))


def _relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    if not (a.is_floating_point() and a.numel()):
        return 0.0
    a64, b64 = a.double().nan_to_num(), b.double().nan_to_num()
    return float((a64 - b64).abs().max() / a64.abs().max().clamp_min(torch.finfo(torch.float64).tiny))


def _random_model_error(model: nn.Module, why: str, written: list[str]) -> InputError:
    if written:
        shown = ", ".join(repr(name) for name in written[:4]) + (f" and {len(written) - 4} more"
                                                                 if len(written) > 4 else "")
        return InputError(
            f"{type(model).__name__}'s forward changes its parameter(s) {shown} in place (an in-place op on the "
            "weight under no_grad, or on its .data): each call runs on other weights, so two forwards of the same "
            "micro-batch differ, no pipeline can match eager's step, and the gradients are not of the weights "
            "the step started from. Fix: compute the changed weight out of place in forward (w = self.weight * "
            "1.01, then use w), or make the update part of the optimizer step (pc.Training(optimizer=...)), "
            "or keep a value that forward must update in a buffer."
        )
    return InputError(
        f"{type(model).__name__} is not deterministic: {why} (dropout, stochastic depth or another random op "
        "in train mode, or a generator, random module or call counter of its own?). No pipeline can match it, "
        "and pipecheck does not compare random draws. Fix: check the model in eval mode (model.eval()) or "
        "without its random ops."
    )


def _differ(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return not torch.equal(a, b)
    if a.numel() == 0:
        return False
    bound = torch.finfo(a.dtype).eps ** 0.5  # finfo of a complex dtype is its parts'
    both_nan = a.isnan() & b.isnan()
    a, b = a.masked_fill(both_nan, 0), b.masked_fill(both_nan, 0)
    size = a.abs().double()
    return bool(((a - b).abs().double() > bound * (size + size.max())).any())


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
