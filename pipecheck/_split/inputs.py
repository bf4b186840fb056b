"""A step's inputs, prepared once: bound to ``forward``'s signature, validated, cast and copied.

    inputs = prepare_inputs(model, args, kwargs, target, dtype=torch.bfloat16, device="cpu")
    inputs.args, inputs.kwargs, inputs.target   # pipecheck's own copies, never the caller's tensors
    inputs.arguments                            # forward's parameter name -> value
    inputs = inputs.unspoiled()                 # the same, or a new copy if a run wrote into them

Floating tensors are cast to ``dtype``, every tensor goes to ``device``, and each
is copied once, keeping ``requires_grad``. A forward that writes into its
inputs bumps their version counters; :meth:`Inputs.unspoiled` then copies again
from the caller's tensors, which pipecheck only ever reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.microbatch import Replicated, unwrap_replicated
from pipecheck.errors import InputError

Device = str | torch.device | None


def bind_signature(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
    """``forward``'s binding of ``(args, kwargs)``; an InputError naming the signature if they do not fit."""
    sig = inspect.signature(model.forward)
    unknown = [k for k in kwargs if k not in sig.parameters]
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    if unknown and not has_var_kw:
        raise InputError(
            f"kwargs {unknown} are not parameters of {type(model).__name__}.forward{sig}. "
            f"Fix: pass only {list(sig.parameters)}."
        )
    try:
        return sig.bind(*args, **kwargs)
    except TypeError as err:
        raise InputError(f"inputs do not fit {type(model).__name__}.forward{sig}: {err}. Fix: pass forward's "
                         f"parameters {list(sig.parameters)}: positional inputs in that order (args), any of them "
                         "by name (kwargs).") from None


def as_args(args: Sequence[Any] | Any) -> tuple[Any, ...]:
    """Positional inputs as a tuple: one bare value is one argument."""
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32}


def detached_batch(inputs: Any) -> Any:
    """An engine's whole-batch input as its data iterator yields it (a tensor, or a tuple from a tuple
    or a list), every tensor detached: the engine's first stage gets no input gradient."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                           tuple(inputs) if isinstance(inputs, list) else inputs)


def cast_dtype(current: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What a tensor of ``current`` dtype becomes when its model is cast to ``dtype``: a floating
    tensor ``dtype``, a complex one ``dtype``'s complex counterpart (none for bfloat16: unchanged),
    anything else unchanged."""
    if dtype is None:
        return current
    if current.is_floating_point:
        return dtype
    if current.is_complex:
        return COMPLEX_OF.get(dtype, current)
    return current


def cast_module(model: nn.Module, dtype: torch.dtype | None, device: Device = None) -> nn.Module:
    """``model.to(device, dtype)`` in place, except that complex parameters and buffers become the
    complex counterpart of ``dtype`` (``Module.to`` would cast them to a real dtype, dropping their
    imaginary parts)."""
    return model._apply(lambda t: t.to(device=device, dtype=cast_dtype(t.dtype, dtype)))


def cast_inputs(value: Any, dtype: torch.dtype | None, device: Device, *, copy: bool = False) -> Any:
    """Floating tensors to ``dtype``, every tensor to ``device``, keeping requires_grad; never in place.

    Without ``copy`` a tensor that needs no cast is passed on as it is. A :class:`Replicated`
    input stays wrapped, its value cast.
    """

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, Replicated):
            return Replicated(pytree.tree_map(cast, leaf.value))
        if not isinstance(leaf, torch.Tensor):
            return leaf
        target = cast_dtype(leaf.dtype, dtype)
        if not copy and target == leaf.dtype and (device is None or torch.device(device) == leaf.device):
            return leaf
        moved = leaf.detach().to(device=device, dtype=target, copy=True)
        return moved.requires_grad_(leaf.requires_grad)

    return pytree.tree_map(cast, value)


def _tensor_versions(value: Any) -> tuple[int, ...]:
    leaves = pytree.tree_leaves(unwrap_replicated(value))
    return tuple(leaf._version for leaf in leaves if isinstance(leaf, torch.Tensor))


@dataclass(frozen=True)
class Inputs:
    """One step's inputs, bound, cast and copied; ``source`` is the caller's, only ever read."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any
    signature: inspect.Signature
    source: tuple[tuple[Any, ...], dict[str, Any], Any]
    dtype: torch.dtype | None
    device: Device
    versions: tuple[int, ...]

    @property
    def arguments(self) -> dict[str, Any]:
        """``forward``'s parameter name -> value (checked when prepared)."""
        return dict(self.signature.bind(*self.args, **self.kwargs).arguments)

    def unspoiled(self) -> Inputs:
        """These inputs if no run wrote into them since they were made, else a fresh copy."""
        if _tensor_versions((self.args, self.kwargs, self.target)) == self.versions:
            return self
        return _copied(self.source, self.signature, self.dtype, self.device)

    def to64(self) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """Copies of ``(args, kwargs, target)`` with floating tensors in float64 (the ground truth's)."""
        return cast_inputs((self.args, self.kwargs, self.target), torch.float64, None, copy=True)


def _copied(source: tuple[tuple[Any, ...], dict[str, Any], Any], signature: inspect.Signature,
            dtype: torch.dtype | None, device: Device) -> Inputs:
    args, kwargs, target = cast_inputs(source, dtype, device, copy=True)
    return Inputs(args, kwargs, target, signature, source, dtype, device,
                  _tensor_versions((args, kwargs, target)))


def prepare_inputs(model: nn.Module, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None,
                   target: Any = None, *, dtype: torch.dtype | None = None, device: Device = None) -> Inputs:
    """Bind ``(args, kwargs)`` to ``model.forward`` (an InputError if they do not fit), then cast and copy."""
    call_args, call_kwargs = as_args(args), dict(kwargs or {})
    signature = bind_signature(model, call_args, call_kwargs).signature
    return _copied((call_args, call_kwargs, target), signature, dtype, device)
