"""The float64 ground truth of a check, for every op the model calls.

    truth = float64_truth(model, inputs, loss_fn, target, n_microbatches, check_grads, seed)
    truth.grads["fc.weight"]          # a StepResult, in float64
    truth.error                       # None, or how far the ops run in float32 may move each value
    truth.exact_ops, truth.float32_ops

The truth is the model's own step on a float64 copy. An op with no float64 kernel on the device
(``torch._grouped_mm`` on CPU, which transformers' mixture-of-experts layers call by default; a
custom op with float32 kernels only) fails there while the model runs in its own dtype. The step
is then run again under :class:`Float64Ops`: such an op runs as a float64 implementation of
pipecheck's own where there is one (``FLOAT64_IMPLEMENTATIONS``: exact, nothing to account for),
else in float32 on its inputs rounded to float32, its outputs back in float64. The truth is then
only as exact as that op's float32 rounding: one more run, with every such op's outputs moved by
``PERTURBATION`` float32 epsilons of their largest ordinary value (a mask's fill value is none;
seeded random signs), measures how far that moves each value, and the auto tolerance adds it to
eager's own error (``truth.error``). A check in float64 has no more precise truth than eager's own
step: there ``truth.error`` estimates float64's rounding from the same step in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipecheck._check.eager import eager_step, in_dtype
from pipecheck._core.result import StepResult
from pipecheck._split.inputs import Inputs, cast_inputs
from pipecheck._split.model_factory import buffers_kept, seeded
from pipecheck.errors import InputError, LossError, first_line
from pipecheck.losses import LossFn

PERTURBATION = 8.0  # float32 epsilons of an output's largest value: a K-term sum's rounding, generously
SENTINEL = 1e30  # a magnitude no float32 result reaches but a fill value (a mask's finfo(float32).min)


def _grouped_mm64(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` group by group with ``torch.mm`` (float64 kernels everywhere). ``offs``
    ends each group along the jagged dimension of a 2D operand; what lies past its last entry is 0."""
    if bias is not None or (out_dtype is not None and out_dtype != mat_a.dtype):
        raise NotImplementedError("pipecheck's float64 torch._grouped_mm takes no bias or out_dtype")
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        return torch.bmm(mat_a, mat_b)
    assert offs is not None, "torch._grouped_mm of a 2D operand needs offs"
    ends = [int(e) for e in offs.tolist()]
    starts = [0] + ends[:-1]
    if mat_a.dim() == 2 and mat_b.dim() == 3:  # rows of mat_a by group, times that group's matrix
        out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[-1])
        for group, (start, end) in enumerate(zip(starts, ends)):
            out[start:end] = mat_a[start:end] @ mat_b[group]
        return out
    if mat_a.dim() == 3:  # mat_b 2D: its columns by group
        out = mat_a.new_zeros(mat_a.shape[1], mat_b.shape[1])
        for group, (start, end) in enumerate(zip(starts, ends)):
            out[:, start:end] = mat_a[group] @ mat_b[:, start:end]
        return out
    out = mat_a.new_zeros(len(ends), mat_a.shape[0], mat_b.shape[1])  # both 2D: the contraction by group
    for group, (start, end) in enumerate(zip(starts, ends)):
        out[group] = mat_a[:, start:end] @ mat_b[start:end]
    return out


# Ops with no float64 kernel on some device, computed exactly in float64 from float64 ops.
FLOAT64_IMPLEMENTATIONS: dict[Any, Callable[..., Any]] = {torch.ops.aten._grouped_mm.default: _grouped_mm64}


@contextmanager
def float64_failure_explained(model: nn.Module) -> Iterator[None]:
    """Around the float64 ground-truth step, after the model's own step ran: a failure there is the
    float64 copy's, not the model's in its own dtype (pipecheck._check.truth64 has already tried the ops
    that failed in float32)."""
    try:
        yield
    except InputError as err:
        device = next((p.device.type for p in model.parameters()), "cpu")
        raise InputError(
            f"the float64 copy of {type(model).__name__} (pipecheck's ground truth) failed where the model "
            f"itself ran in its own dtype: {first_line(err).split(' Fix: ')[0]} An op with no float64 kernel on "
            f"{device} (torch._grouped_mm on CPU, a custom op) is run in float32 inside the truth, so the "
            "model's own code refuses float64 here: a dtype check, a branch on the dtype, an op that fails in "
            "float32 too. Fix: let the model run in float64 (make tensors in its inputs' dtype), or give that "
            "layer an implementation with float64 kernels (transformers: config "
            "experts_implementation='batched_mm')."
        ) from err


def _op_name(func: Any) -> str:
    return f"torch.ops.{func.namespace}.{func._opname}"


def _is64(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float64


def _to32(value: Any) -> Any:
    return value.float() if _is64(value) else value


class Float64Ops(TorchDispatchMode):
    """Every op of the block as it is, except one that fails on float64 tensors: pipecheck's float64
    implementation of it, or the op in float32 (its float64 inputs rounded, its floating outputs
    back in float64). An op that writes into its inputs, a higher-order op (``torch.cond``) and an
    out-of-memory error are left alone. ``perturb``: a generator whose random signs move each
    float32 op's outputs by PERTURBATION epsilons."""

    supports_higher_order_operators = True

    def __init__(self, perturb: torch.Generator | None = None) -> None:
        super().__init__()
        self.exact: set[str] = set()
        self.in_float32: set[str] = set()  # no float64 kernel
        self.mixed: set[str] = set()  # float64 mixed with a floating tensor of another dtype (one the model made)
        self._substituted: set[tuple[Any, tuple[torch.dtype, ...]]] = set()
        self._perturb = perturb

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload) or func._schema.is_mutable:
            return func(*args, **kwargs)
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if not any(leaf.dtype == torch.float64 for leaf in leaves):
            return func(*args, **kwargs)
        key = (func, tuple(leaf.dtype for leaf in leaves))
        if key in self._substituted:
            return self._substitute(func, args, kwargs, leaves)
        try:
            return func(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError) as failure:
            try:
                out = self._substitute(func, args, kwargs, leaves)
            except Exception:
                raise failure from None  # not a float64 kernel's absence: the op's own error stands
            self._substituted.add(key)
            return out

    def _substitute(self, func: Any, args: Any, kwargs: Any, leaves: list[torch.Tensor]) -> Any:
        exact = FLOAT64_IMPLEMENTATIONS.get(func)
        if exact is not None:
            out = exact(*args, **kwargs)
            self.exact.add(_op_name(func))
            return out
        out = func(*pytree.tree_map(_to32, args), **pytree.tree_map(_to32, kwargs))
        mixed = any(leaf.is_floating_point() and leaf.dtype != torch.float64 for leaf in leaves)
        (self.mixed if mixed else self.in_float32).add(_op_name(func))
        return pytree.tree_map(self._back, out)

    def _back(self, value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32):
            return value
        value = value.double()
        if self._perturb is not None and value.numel():
            signs = torch.rand(value.shape, generator=self._perturb, dtype=torch.float64,
                               device="cpu").to(value.device) * 2 - 1
            ordinary = value.abs() < SENTINEL  # a mask's fill value (finfo.min) is no scale, and not perturbed
            largest = torch.where(ordinary, value.abs(), 0.0).max()
            moved = signs * (PERTURBATION * torch.finfo(torch.float32).eps) * largest
            value = torch.where(ordinary, value + moved, value)
        return value


@dataclass
class Truth(StepResult):
    """The float64 step, and how it was computed: ``exact_ops`` ran as pipecheck's float64
    implementations, ``float32_ops`` in float32; ``error`` (when some did) holds, value by value,
    how far their float32 rounding may move the truth (each an elementwise absolute difference)."""

    error: StepResult | None = None
    exact_ops: tuple[str, ...] = ()
    float32_ops: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


def float64_truth(model: nn.Module, inputs: Inputs, loss_fn: LossFn, target: Any, n_microbatches: int,
                  check_grads: bool, seed: int, eager_dtype: torch.dtype = torch.float32, spill: bool = False) -> Truth:
    """The model's step in float64, seeded with ``seed``, its buffers and dtypes left as found.
    ``eager_dtype``: the dtype the check runs in; in float64 the truth is eager's own computation,
    and its rounding is estimated (see :func:`_float64_rounding`). ``spill``: the parameters' own data
    waits on the host while the float64 copy runs (a tight accelerator: pipecheck._check.placement)."""

    def step(mode: Float64Ops | None = None, dtype: torch.dtype = torch.float64) -> StepResult:
        with seeded(seed), buffers_kept(model), in_dtype(model, dtype, spill) as cast, mode or nullcontext():
            fresh = inputs.unspoiled()
            args, kwargs, cast_target = cast_inputs((fresh.args, fresh.kwargs, target), dtype, None, copy=True)
            return eager_step(cast, inputs, loss_fn, n_microbatches, check_grads, args=args, kwargs=kwargs,
                              target=cast_target, backward_each=True)[0]

    try:
        with float64_failure_explained(model):
            result = step()
    except (InputError, LossError) as failed:  # the model's or the loss's ops, tried again
        mode = Float64Ops()
        try:
            result = step(mode)
        except Exception:
            raise failed from None
        if not (mode.exact or mode.in_float32 or mode.mixed):
            raise
    else:
        truth = Truth(**vars(result))
        if eager_dtype == torch.float64:
            _float64_rounding(truth, step)
        return truth
    truth = Truth(**vars(result), exact_ops=tuple(sorted(mode.exact)),
                  float32_ops=tuple(sorted(mode.in_float32 | mode.mixed)))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if truth.exact_ops:
        truth.notes.append(f"the float64 truth computes {', '.join(truth.exact_ops)} with pipecheck's float64 "
                           f"implementation (no float64 kernel on {device.type})")
    why = [f"{', '.join(sorted(ops))} in float32 ({reason})" for ops, reason in (
        (mode.in_float32, f"no float64 kernel on {device.type}"),
        (mode.mixed, "float64 mixed there with a float32 tensor the model makes itself")) if ops]
    if why:
        try:
            truth.error = _difference(result, step(Float64Ops(perturb=torch.Generator().manual_seed(seed))),
                                      strict=True)
        except Exception as err:  # the run's structure follows a value the perturbation moved
            truth.notes.append(f"the float64 truth runs {' and '.join(why)}, and how far that moves "
                               f"each value could not be measured ({type(err).__name__}: {first_line(err)}): the "
                               "tolerance does not account for it")
        else:
            truth.notes.append(f"the float64 truth runs {' and '.join(why)}: the tolerance adds how "
                               f"far {PERTURBATION:g} float32 epsilons there move each value")
    return truth


def _float64_rounding(truth: Truth, step: Callable[..., StepResult]) -> None:
    """A check in float64 has no more precise truth than its own float64 step, which would leave
    the auto tolerance at its floor of 2 epsilons: a correct runner that sums micro-batches in
    another order is off by more where a sum cancels. Its rounding is estimated one rung down the
    precision ladder: the same step in float32 is off the float64 one by float32's error, and
    float64's is that times eps(float64) / eps(float32) (2**-29); ``truth.error`` holds it."""
    ratio = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    try:
        truth.error = _difference(truth, step(dtype=torch.float32), ratio)
    except Exception as err:  # a model that runs only in float64, or whose outputs change with the dtype
        why = first_line(err).split(" Fix: ")[0].rstrip(".") if isinstance(err, InputError) else (
            f"{type(err).__name__}: {first_line(err)}")
        truth.notes.append(f"float64's own rounding could not be estimated, the same step in float32 failed ({why}): "
                           "the tolerance is float64's floor of 2 epsilons alone")


def _difference(result: StepResult, other: StepResult, factor: float = 1.0, strict: bool = False) -> StepResult:
    """``|result - other| * factor`` value by value, in float64 (0 where either is not finite; a
    complex value's as its (real, imaginary) pairs). ``strict``: a value whose shape differs is an
    error, not 0."""

    def diff(a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if strict and not (isinstance(b, torch.Tensor) and b.shape == a.shape):
            raise ValueError(f"a value of shape {tuple(a.shape)} came back as {getattr(b, 'shape', b)!r}")
        if not (isinstance(b, torch.Tensor) and (a.is_floating_point() or a.is_complex()) and a.shape == b.shape
                and a.is_complex() == b.is_complex()):
            return torch.zeros(a.shape, dtype=torch.float64, device=a.device)
        if a.is_complex():
            return (torch.view_as_real(a.to(torch.complex128) - b.to(torch.complex128)).abs() * factor).nan_to_num(
                nan=0.0, posinf=0.0, neginf=0.0)
        return ((a.double() - b.double()).abs() * factor).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    return StepResult(**pytree.tree_map(diff, _values(result), _values(other)))


def _values(result: StepResult) -> dict[str, Any]:
    return {"outputs": result.outputs, "loss": result.loss, "grads": result.grads,
            "input_grads": result.input_grads, "buffers": result.buffers}
