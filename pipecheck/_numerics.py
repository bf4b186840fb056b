"""Compare one tensor of a pipelined run against the eager run, under a tolerance.

    row = compare("grad fc.weight", test, eager, ref64, tolerance=AUTO)
    row.ok, row.max_abs, row.worst_index, row.n_failing

Tolerance ``"auto"``: an fp64 copy of the eager model is the ground truth. A
tensor passes when, at every element, its error against fp64 is at most
``AUTO_MULTIPLE`` times the eager run's own (tensor-wide) error against fp64,
plus a floor of a few machine epsilons of the dtype, relative to the element
and to the tensor's scale. ``Tolerance(rtol, atol)`` compares against the eager
run like ``torch.testing``; ``"exact"`` demands bitwise equality with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipecheck._errors import InputError

AUTO_MULTIPLE = 4.0
AUTO_FLOOR_EPS = 2.0


@dataclass(frozen=True)
class Tolerance:
    """Explicit tolerance: element passes when ``|test - eager| <= atol + rtol * |eager|``."""

    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol {self.rtol:.1e} atol {self.atol:.1e}"


ToleranceLike = Tolerance | str


def check_tolerance(tolerance: Any) -> ToleranceLike:
    if isinstance(tolerance, Tolerance) or tolerance in ("auto", "exact"):
        return tolerance
    raise InputError(f"tolerance={tolerance!r} is not understood. "
                     "Fix: use 'auto', 'exact' or pc.Tolerance(rtol=..., atol=...).")


@dataclass(frozen=True)
class Row:
    """The verdict on one tensor."""

    name: str
    stages: tuple[int, ...]
    shape: tuple[int, ...]
    ok: bool
    max_abs: float
    max_rel: float
    tolerance: str
    worst_index: tuple[int, ...] | None
    n_failing: int
    numel: int
    note: str = ""  # e.g. "missing", "shape differs", "not a tensor"


def _failing_row(name: str, stages: tuple[int, ...], shape: tuple[int, ...], note: str, tol: str) -> Row:
    return Row(name, stages, shape, False, float("inf"), float("inf"), tol, None, 0, 0, note)


def compare(name: str, test: Any, eager: Any, ref64: Any, tolerance: ToleranceLike,
            stages: tuple[int, ...] = ()) -> Row:
    """One row of the report; ``ref64`` is only read under ``"auto"``."""
    tol_text = "exact" if tolerance == "exact" else str(tolerance)
    if not isinstance(eager, torch.Tensor):
        try:
            ok = not isinstance(test, torch.Tensor) and bool(test == eager)
        except Exception:  # an object whose == does not give a bool
            ok = False
        return Row(name, stages, (), bool(ok), 0.0, 0.0, "equal", None, 0 if ok else 1, 1,
                   "" if ok else f"value {test!r} != eager {eager!r}")
    shape = tuple(eager.shape)
    if test is None:
        return _failing_row(name, stages, shape, "missing from the runner's result", tol_text)
    if not isinstance(test, torch.Tensor):
        return _failing_row(name, stages, shape, f"runner gave {type(test).__name__}, not a tensor", tol_text)
    if tuple(test.shape) != shape:
        return _failing_row(name, stages, shape, f"runner's shape {tuple(test.shape)} != eager's {shape}", tol_text)
    test64 = test.detach().to("cpu", torch.float64)
    eager64 = eager.detach().to("cpu", torch.float64)
    if tolerance == "exact":
        failing = ~((test.detach().cpu() == eager.detach().cpu()) | (test64.isnan() & eager64.isnan()))
        return _row(name, stages, shape, test64, eager64, failing, "exact")
    if isinstance(tolerance, Tolerance):
        bound = tolerance.atol + tolerance.rtol * eager64.abs()
        return _row(name, stages, shape, test64, eager64, ~((test64 - eager64).abs() <= bound), tol_text)
    truth = ref64.detach().to("cpu", torch.float64)
    eps = torch.finfo(eager.dtype).eps if eager.is_floating_point() else 0.0
    scale = truth.abs().max().item() if truth.numel() else 0.0
    eager_err = (eager64 - truth).abs().max().item() if truth.numel() else 0.0
    atol = AUTO_MULTIPLE * eager_err + AUTO_FLOOR_EPS * eps * scale
    rtol = AUTO_FLOOR_EPS * eps
    failing = ~((test64 - truth).abs() <= atol + rtol * truth.abs())
    return _row(name, stages, shape, test64, truth, failing, f"auto: atol {atol:.1e} rtol {rtol:.1e}")


def _row(name: str, stages: tuple[int, ...], shape: tuple[int, ...], test: torch.Tensor,
         ref: torch.Tensor, failing: torch.Tensor, tol: str) -> Row:
    diff = (test - ref).abs()
    diff = torch.where(test.isnan() & ref.isnan(), torch.zeros_like(diff), diff)
    diff = torch.where(diff.isnan(), torch.full_like(diff, float("inf")), diff)
    zero_ref = ref == 0
    rel = torch.where(zero_ref, torch.where(diff == 0, 0.0, float("inf")), diff / torch.where(zero_ref, 1.0, ref.abs()))
    n_failing = int(failing.sum())
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_rel = rel.max().item() if rel.numel() else 0.0
    worst = None
    if diff.numel():
        flat = int(torch.argmax(torch.where(failing, diff, torch.full_like(diff, -1.0)) if n_failing else diff))
        worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    return Row(name, tuple(stages), shape, n_failing == 0, max_abs, max_rel, tol, worst, n_failing, diff.numel())


def nonfinite(value: torch.Tensor) -> bool:
    return value.is_floating_point() and not bool(torch.isfinite(value).all())
