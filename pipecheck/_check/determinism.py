"""Is the model deterministic? Refuse one whose outputs are random, and say why.

    check_deterministic(model, inputs, n_microbatches, seed)    # InputError if the RNG changes outputs
    refuse_random(model, inputs, n_microbatches, seed)          # the same, silent if the forward fails

Random outputs cannot be matched by any pipeline, and their spread would widen the auto tolerance until
a wrong answer passes. A forward that writes its own parameters in place looks random the same way; it
is named as what it is.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipecheck._check.eager import _call
from pipecheck._check.numerics import AUTO_FLOOR_EPS
from pipecheck._split.inputs import Inputs
from pipecheck._split.microbatch import split_microbatches
from pipecheck._split.model_factory import (
    buffers_kept,
    is_default_generator,
    rng_fingerprint,
    seeded,
)
from pipecheck.errors import InputError


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


def refuse_random(model: nn.Module, inputs: Inputs, n_microbatches: int, seed: int, untraced: str = "") -> None:
    """:func:`check_deterministic`'s refusal if ``model`` is random; nothing if it is not, or if its
    eager forward fails (the caller's own error then stands). ``untraced``: why no tracer could trace it
    (its random ops then cannot be split to draw by the randomness contract: said first)."""
    try:
        found = _random_outputs(model, inputs, n_microbatches, seed)
    except Exception:
        return
    if found and untraced:
        raise InputError(
            f"{type(model).__name__} is not deterministic: {found}; and no tracer could trace it ({untraced}), so "
            "pipecheck cannot split it to draw its random numbers by its randomness contract. Fix: make forward "
            "traceable (torch < 2.13 cannot trace a torch.Generator argument: draw without generator=); "
            "model.eval() (or the model without its random ops) checks the deterministic model only.")
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
                        and not is_default_generator(leaf)):
                    self.generators.append((leaf, leaf.get_state()))
        return func(*args, **kwargs)


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
        f"{type(model).__name__} is not deterministic: {why} (a torch.Generator, Python's random or NumPy's of "
        "its own, a call counter, or a random op the split does not show?). pipecheck's randomness contract "
        "replays only what stages draw from torch's default generators, so no pipeline can be compared with "
        "it. Fix: draw from torch's default generator (torch.rand(...), dropout, bernoulli_ without "
        "generator=): the contract then checks the engine's randomness too (docs/randomness.md). "
        "model.eval() (or the model without its random ops) checks the deterministic model only."
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
