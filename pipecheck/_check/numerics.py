"""Compare one tensor of a pipelined run against the eager run, under a tolerance.

    row = compare("grad fc.weight", test, eager, ref64, tolerance=AUTO)
    row.ok, row.max_abs, row.worst_index, row.n_failing

Tolerance ``"auto"``: an fp64 copy of the eager model is the ground truth. A
tensor passes when, at every element, its error against fp64 is at most
``AUTO_MULTIPLE`` times the eager run's own (tensor-wide) error against fp64,
plus a floor of a few machine epsilons of the dtype, relative to the element
and to the tensor's scale. ``Tolerance(rtol, atol)`` compares against the eager
run like ``torch.testing``; ``"exact"`` demands bitwise equality with it.

Every tensor row also knows its power: the smallest error, relative to the
tensor's largest true value, that its tolerance lets it see (``row.power``).
Under "auto" an ill-conditioned float32 run (BatchNorm over two values) widens
the tolerance until a gradient 25% off fits; such a row is ``blind`` (power
above ``POWER_LIMIT``), and the check does not certify it. A tensor whose true
value is zero, or negligible beside the largest of its kind and at the level of
eager's own error of it (a gradient that cancels to zero: float32 cannot
resolve it at all), has no relative power to speak of and is
``numerically_zero``, never blind (:func:`judge_power`, over a check's rows).

Anchored on eager (a check in bfloat16 or float16, :mod:`pipecheck._check.anchor`): float64 is too
far from eager there to anchor a useful tolerance, so a tensor is compared with eager in its own
dtype, given ``noise``: how far legitimate re-orderings of the same math move it from eager. It
passes when every element is within ``2 * noise.largest + eps * s + 2 * eps * |eager|`` (``s``:
eager's largest magnitude) and the whole tensor within ``2 * noise.norm + eps / 2`` of eager's
norm (``row.norm_power``: a spread-out error of that size is seen even where each element hides).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from pipecheck.errors import InputError

AUTO_MULTIPLE = 4.0
AUTO_FLOOR_EPS = 2.0
POWER_LIMIT = 0.1  # a row that cannot see an error of 10% of its tensor's scale sees no gross bug
NEGLIGIBLE = 1e-4  # a tensor whose largest true value is below this fraction of its kind's largest is small
SUBNORMAL_ULPS = 4.0  # anchored on eager: an absolute floor of a few of the dtype's smallest steps
NOISE_LEVEL = 0.25  # ... and numerically zero when eager is off by this fraction of it or more: eager cannot resolve it


@dataclass(frozen=True)
class Tolerance:
    """Explicit tolerance: element passes when ``|test - eager| <= atol + rtol * |eager|``."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        bad = [f"{name}={value!r}" for name, value in (("rtol", self.rtol), ("atol", self.atol))
               if isinstance(value, bool) or type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
               or not isinstance(value, numbers.Real)
               or not 0 <= value < float("inf")]
        if bad:  # a negative bound fails every element: a correct pipeline would be blamed
            raise InputError(f"pc.Tolerance({', '.join(bad)}): rtol and atol must be finite numbers >= 0. "
                             "Fix: e.g. pc.Tolerance(rtol=1e-5, atol=1e-6), or tolerance='auto'.")

    def __str__(self) -> str:
        return f"rtol {self.rtol:.1e} atol {self.atol:.1e}"


@dataclass(frozen=True)
class EagerAnchored:
    """Tolerance "auto" anchored on eager in its own dtype (``dtype``, a low-precision one): each row's
    noise by name (:mod:`pipecheck._check.anchor` measures it; a row it has none for has none). The rows
    ``zero`` are numerically zero (:func:`numerically_zero`): eager's value there is rounding noise, no
    anchor, and they are held to the float64 truth."""

    noise: dict[str, Noise]
    dtype: str
    zero: frozenset[str] = frozenset()
    # What a row is compared with instead of eager's value: the runner's loss where its bits show it is
    # eager's micro-batch losses summed another legitimate way (DeepSpeed adds them, then divides).
    expected: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def noise_of(self, name: str) -> Noise | None:
        """A row's noise (None: anchored on float64); a tied replica's row (``grad w (replica in stage
        2)``) and a data-parallel copy's (``grad w (dp rank 1, stage 0)``) have their gradient's."""
        name = name.split(" (replica in stage ", 1)[0].split(" (dp rank ", 1)[0]
        return None if name in self.zero else self.noise.get(name, Noise())

    def __str__(self) -> str:
        return f"auto, anchored on eager {self.dtype}"


ToleranceLike = Tolerance | str | EagerAnchored


@dataclass(frozen=True)
class Noise:
    """How far legitimate re-orderings of one tensor's math (micro-batches summed in another order
    or dtype, a skip connection's gradients added in another order) move it from eager: the largest
    elementwise deviation, and the largest deviation's norm as a fraction of eager's norm."""

    largest: float = 0.0
    norm: float = 0.0

    def __or__(self, other: Noise) -> Noise:
        return Noise(max(self.largest, other.largest), max(self.norm, other.norm))


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
    n_nan: int = 0  # elements where the runner has NaN and the reference a number
    failing_microbatches: tuple[int, ...] | None = None  # an output's micro-batches that fail (None: not split)
    # The smallest error, as a fraction of the tensor's largest true (or, under an explicit tolerance,
    # eager) value, that the tolerance lets this row see; None where no tolerance applies (not a tensor).
    power: float | None = None
    scale: float = 0.0  # the tensor's largest true value (under an explicit tolerance: eager's)
    bound: float = 0.0  # the largest error its tolerance allows anywhere (atol + rtol * scale)
    eager_off: float | None = None  # under "auto": eager's own error against fp64, as a fraction of the scale
    blind: bool = False  # set by judge_power: power above POWER_LIMIT on a tensor that is not negligible
    numerically_zero: bool = False  # set by judge_power: tiny beside the largest of its kind (see there)
    kind: str = ""  # one of KINDS, set by whoever compares; a row made by hand (a test's) gets its name's
    # Anchored on eager (low precision): ||test - eager|| / ||eager||, the most it may be, and the smallest
    # such error the row sees (None: not anchored on eager, or eager is all zeros there).
    norm_error: float | None = None
    norm_bound: float | None = None

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", kind_of_name(self.name))
        if self.kind not in KINDS:
            raise ValueError(f"Row kind {self.kind!r} is not one of {KINDS}")


KINDS = ("outputs", "loss", "buffers", "grads", "params")  # in dataflow order: what the forward gives, then the step's


def kind_of_name(name: str) -> str:
    """The kind a row's name says (``output...``, ``loss``, ``buffer ...``, ``grad ...``), for rows made
    by hand; the comparison sets each row's kind itself."""
    name = name.split(": ", 1)[1] if name.startswith("step ") and ": " in name else name  # a training check's
    if name.startswith("grad "):
        return "grads"
    if name.startswith("param "):
        return "params"
    if name.startswith("buffer "):
        return "buffers"
    return "loss" if name == "loss" else "outputs"


def _failing_row(name: str, stages: tuple[int, ...], shape: tuple[int, ...], note: str, tol: str) -> Row:
    return Row(name, stages, shape, False, float("inf"), float("inf"), tol, None, 0, 0, note)


_COMPARED_ON: ContextVar[torch.device | None] = ContextVar("compared_on", default=None)


@contextmanager
def compared_on(device: torch.device | None) -> Iterator[None]:
    """Rows compared in the block are computed on ``device`` (None: where each row's eager value is)."""
    token = _COMPARED_ON.set(device)
    try:
        yield
    finally:
        _COMPARED_ON.reset(token)


def compare(name: str, test: Any, eager: Any, ref64: Any, tolerance: ToleranceLike,
            stages: tuple[int, ...] = (), microbatches: int = 0, truth_error: torch.Tensor | None = None,
            kind: str = "") -> Row:
    """One row of the report, of ``kind`` (one of KINDS; by default what its name says); ``ref64``
    is only read under ``"auto"``. With ``microbatches`` > 1 (an output merged from that many equal
    micro-batch slices along dim 0), a failing row also names the micro-batches whose slice holds a
    failing element. ``truth_error``: how far ``ref64`` itself may be off, element by element (a truth
    that ran an op in float32); "auto" adds it to eager's error. :class:`EagerAnchored`: "auto" anchored
    on eager in its own dtype, with each row's legitimate noise (see the module's docstring)."""
    noise = tolerance.noise_of(name) if isinstance(tolerance, EagerAnchored) else None
    if isinstance(tolerance, EagerAnchored) and noise is not None:
        eager = tolerance.expected.get(name, eager)
    plain = "auto" if isinstance(tolerance, EagerAnchored) else tolerance
    row = _compare(name, test, eager, ref64, plain, stages, microbatches, truth_error, noise)
    held = isinstance(tolerance, EagerAnchored) and noise is None  # numerically zero: held to the float64 truth
    return dataclasses.replace(row, kind=kind or row.kind, numerically_zero=held)


def _compare(name: str, test: Any, eager: Any, ref64: Any, tolerance: ToleranceLike,
             stages: tuple[int, ...], microbatches: int, truth_error: torch.Tensor | None,
             noise: Noise | None = None) -> Row:
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
    if eager.is_complex() or test.is_complex():  # compared as (real, imaginary) pairs
        if not (eager.is_complex() and test.is_complex()):
            return _failing_row(name, stages, shape, f"runner's dtype {test.dtype} != eager's {eager.dtype}", tol_text)
        real = torch.view_as_real(ref64.detach().resolve_conj()) if isinstance(ref64, torch.Tensor) and ref64.is_complex() else ref64
        error = (torch.view_as_real(truth_error.resolve_conj()) if isinstance(truth_error, torch.Tensor) and truth_error.is_complex()
                 else truth_error if isinstance(truth_error, torch.Tensor) and truth_error.shape == (*shape, 2)
                 else None)  # pipecheck._check.truth64 gives it as (real, imaginary) pairs
        row = _compare(name, torch.view_as_real(test.detach().resolve_conj()),  # a conjugate view: resolved
                       torch.view_as_real(eager.detach().resolve_conj()), real, tolerance, stages, 0, error, noise)
        index = row.worst_index[:-1] if row.worst_index is not None else None  # the element, not its part
        return dataclasses.replace(row, shape=shape, worst_index=index)
    # compared where eager's result lives (no copy to the host per tensor), or on the check's device
    # when its results wait on the host (pipecheck._check.placement): one row's tensors there at a time
    device = _COMPARED_ON.get() or eager.device
    test64 = test.detach().to(device=device, dtype=torch.float64)
    eager64 = eager.detach().to(device=device, dtype=torch.float64)
    if tolerance == "exact":
        failing = ~((test.detach().to(device) == eager.detach().to(device)) | (test64.isnan() & eager64.isnan()))
        return _row(name, stages, shape, _Diff(test64, eager64), failing, lambda _: "exact", None, microbatches,
                    _Power(_scale(eager64), 0.0, 0.0, None))
    if isinstance(tolerance, Tolerance):
        diff = _Diff(test64, eager64)
        return _row(name, stages, shape, diff, diff.failing(tolerance.atol, tolerance.rtol), lambda _: tol_text, None,
                    microbatches, _Power(_scale(eager64), tolerance.atol, tolerance.rtol, None))
    truth = ref64.detach().to(device=device, dtype=torch.float64)
    eps = torch.finfo(eager.dtype).eps if eager.is_floating_point() else 0.0
    if noise is not None:
        return _against_eager(name, stages, shape, test64, eager64, truth, noise, eager.dtype, microbatches)
    rtol = AUTO_FLOOR_EPS * eps
    if device.type == "cpu" and _all_finite(test64, eager64, truth):  # the common case, without masks
        # (on a GPU the finiteness test would be one more sync per row: the general path runs there)
        diff = _FiniteDiff(test64, truth)
        eager_err = (eager64 - truth).abs_().max()
        if isinstance(truth_error, torch.Tensor) and truth_error.shape == truth.shape:
            eager_err = eager_err + truth_error.to(truth).nan_to_num().max()
        scale = diff.ref_abs.max()
    else:
        finite = torch.isfinite(truth) & torch.isfinite(eager64)  # a -inf mask entry is no measure of error
        if finite.any():  # a tensor: read back with the row's other numbers, in one transfer
            eager_err = torch.where(finite, (eager64 - truth).abs(), 0.0).max()
            if isinstance(truth_error, torch.Tensor) and truth_error.shape == truth.shape:
                eager_err = eager_err + torch.where(finite, truth_error.to(truth).nan_to_num(), 0.0).max()
            scale = torch.where(finite, truth.abs(), 0.0).max()
        else:
            eager_err = scale = torch.zeros((), dtype=torch.float64, device=device)
        diff = _Diff(test64, truth)
    atol = AUTO_MULTIPLE * eager_err + AUTO_FLOOR_EPS * eps * scale
    return _row(name, stages, shape, diff, diff.failing(atol, rtol), lambda a: f"auto: atol {a:.1e} rtol {rtol:.1e}",
                atol, microbatches, _Power(scale, atol, rtol, eager_err))


def _against_eager(name: str, stages: tuple[int, ...], shape: tuple[int, ...], test64: torch.Tensor,
                   eager64: torch.Tensor, truth: torch.Tensor, noise: Noise, dtype: torch.dtype,
                   microbatches: int) -> Row:
    """The row anchored on eager in its own dtype (low precision): elementwise within
    ``2 * noise.largest + eps * s + 2 * eps * |eager|`` (and SUBNORMAL_ULPS of the dtype's subnormals:
    float16 gradients of 1e-7 round there, each engine its own way), and as a norm within
    ``2 * noise.norm + eps / 2``. The truth only measures how far eager itself is off (``row.eager_off``,
    for :func:`judge_power`)."""
    info = torch.finfo(dtype) if dtype.is_floating_point else None  # an integer tensor: exact
    eps, subnormal = (info.eps, info.eps * info.tiny) if info is not None else (0.0, 0.0)
    diff = _Diff(test64, eager64)
    if not eager64.numel():  # nothing to compare, nothing to fail
        return _row(name, stages, shape, diff, diff.failing(0.0, 0.0), lambda _: "eager", None, microbatches)
    scale = _scale(eager64)
    atol = 2 * noise.largest + eps * scale + SUBNORMAL_ULPS * subnormal
    rtol = 2 * eps
    finite = torch.isfinite(eager64) & torch.isfinite(truth)
    true_scale = torch.where(finite, truth.abs(), 0.0).max()
    eager_err = torch.where(finite, (eager64 - truth).abs(), 0.0).max()
    # a NaN or infinity where eager has a number already fails elementwise: the norm reads the rest
    plain = diff.ref_finite & ~diff.nan & torch.isfinite(diff.abs)
    norm = _Norm(torch.where(plain, diff.abs, 0.0).norm(), torch.where(plain, eager64, 0.0).norm(),
                 2 * noise.norm + eps / 2, SUBNORMAL_ULPS * subnormal * diff.abs.numel() ** 0.5)
    row = _row(name, stages, shape, diff, diff.failing(atol, rtol),
               lambda a: f"eager: atol {a:.1e} rtol {rtol:.1e}, norm {norm.bound:.1e}", atol, microbatches,
               _Power(true_scale, atol, rtol, eager_err, eager_scale=scale, norm=norm))
    return row


@dataclass
class _Norm:
    """A row's norm check: ``||test - eager||`` (a device scalar) against ``bound * ||eager||`` plus
    ``floor`` (the subnormals' share)."""

    error: torch.Tensor
    eager: torch.Tensor
    bound: float
    floor: float


def _all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no element of ``tensors`` is NaN or infinite, by their sums (one read back): a NaN or
    an infinity makes a sum non-finite, and a sum that overflows only sends the row the long way."""
    return bool(torch.isfinite(torch.stack([t.sum() for t in tensors])).all()) if tensors[0].numel() else False


def _scale(values: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude (0 for none)."""
    finite = torch.isfinite(values)
    return torch.where(finite, values.abs(), 0.0).max() if values.numel() else torch.zeros((), dtype=torch.float64)


@dataclass
class _Power:
    """What a row's power is computed from (device tensors or numbers, read back with its other numbers):
    the tensor's largest true magnitude, the bound ``atol + rtol * |value|``, and eager's own error
    against the truth (None: no truth). Anchored on eager: the largest magnitude the bound is relative
    to (``eager_scale``; default the true one) and the norm check."""

    scale: torch.Tensor | float
    atol: torch.Tensor | float
    rtol: float
    eager_error: torch.Tensor | float | None
    eager_scale: torch.Tensor | float | None = None
    norm: _Norm | None = None

    def numbers(self, device: torch.device) -> list[torch.Tensor]:
        """Device scalars, read back with the row's other numbers (a Python number is filled on the
        device, never copied from the host: no sync per row on a GPU)."""
        norm = ((self.norm.error - self.norm.floor).clamp_min(0.0), self.norm.eager) if self.norm is not None \
            else (-1.0, -1.0)
        return [v.to(torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                else torch.full((), float(v), dtype=torch.float64, device=device)
                for v in (self.scale, self.atol, -1.0 if self.eager_error is None else self.eager_error,
                          self.scale if self.eager_scale is None else self.eager_scale, *norm)]


def power_of(scale: float, atol: float, rtol: float) -> float:
    """The smallest error a row can see, as a fraction of ``scale`` (its largest true value)."""
    if scale <= 0:
        return 0.0 if atol <= 0 else float("inf")
    return atol / scale + rtol


def judge_power(rows: list[Row]) -> list[Row]:
    """``rows`` with ``blind`` and ``numerically_zero`` (:func:`numerically_zero`, or as the comparison
    found it: an eager-anchored check's rows held to float64) set. A row is blind when it is not
    numerically zero and its power is above POWER_LIMIT."""
    largest = largest_by_kind((row.kind, row.scale) for row in rows)
    judged = []
    for row in rows:
        if row.power is None or not row.numel:
            judged.append(row)
            continue
        zero = row.numerically_zero or numerically_zero(row.kind, row.scale, row.eager_off, largest)
        judged.append(dataclasses.replace(row, numerically_zero=zero,
                                          blind=row.power > POWER_LIMIT and not zero))
    return judged


FILL = 1e30  # a magnitude no computed value reaches but a fill value (a mask's finfo(float32).min)


def largest_by_kind(scales: Iterable[tuple[str, float]]) -> dict[str, float]:
    """The largest true magnitude of each kind of row, from ``(kind, scale)`` pairs; the loss counts
    with the outputs, and a fill value (a mask buffer's) is no magnitude."""
    largest: dict[str, float] = {}
    for kind, scale in scales:
        if scale < FILL:
            largest[kind] = max(largest.get(kind, 0.0), scale)
    largest["loss"] = max(largest.get("loss", 0.0), largest.get("outputs", 0.0))
    return largest


def numerically_zero(kind: str, scale: float, eager_off: float | None, largest: dict[str, float]) -> bool:
    """Whether a tensor's true value (largest magnitude ``scale``) is zero, or below NEGLIGIBLE of the
    largest of its kind (``largest``: :func:`largest_by_kind`; gradients with gradients, outputs with
    outputs, buffers with buffers) while eager is off by NOISE_LEVEL of it or more (``eager_off``, a
    fraction of ``scale``): eager cannot resolve it, a sum that cancels, a running mean of values
    whose mean is zero."""
    return scale == 0 or (scale < NEGLIGIBLE * largest.get(kind, 0.0)
                          and eager_off is not None and eager_off >= NOISE_LEVEL)


class _Diff:
    """``|test - ref|`` elementwise, computed once for a row's verdict and its numbers: 0 where the
    two hold the very same value (equal numbers and infinities, or both NaN), inf where only one is NaN."""

    def __init__(self, test: torch.Tensor, ref: torch.Tensor) -> None:
        self.ref_abs = ref.abs()
        self.ref_finite = torch.isfinite(ref)
        self.same = (test == ref) | (test.isnan() & ref.isnan())
        diff = (test - ref).abs().masked_fill_(self.same, 0.0)
        self.nan = diff.isnan()  # one side NaN: never within any bound
        self.test_nan = self.nan & test.isnan()
        self.abs = diff.masked_fill_(self.nan, float("inf"))

    def failing(self, atol: float | torch.Tensor, rtol: float) -> torch.Tensor:
        """Not within ``atol + rtol * |ref|`` where ``ref`` is finite; a non-finite ``ref`` is matched
        only by the same value, never by an infinite bound."""
        within = (self.abs <= atol + rtol * self.ref_abs) & ~self.nan
        return ~(self.same | (self.ref_finite & within))

    def relative(self) -> torch.Tensor:
        """``|test - ref| / |ref|`` where that means something; 0 where both are the same, inf elsewhere."""
        plain = self.ref_finite & (self.ref_abs != 0)
        return torch.where(plain, self.abs / torch.where(plain, self.ref_abs, 1.0),
                           torch.where(self.abs == 0, 0.0, float("inf")))

    def test_nans(self) -> torch.Tensor:
        """How many elements are NaN in the runner's result alone."""
        return self.test_nan.sum()


class _FiniteDiff(_Diff):
    """``_Diff`` of two tensors that hold no NaN or infinity: equal values are exactly those 0 apart."""

    def __init__(self, test: torch.Tensor, ref: torch.Tensor) -> None:
        self.ref_abs = ref.abs()
        self.abs = (test - ref).abs_()

    def failing(self, atol: float | torch.Tensor, rtol: float) -> torch.Tensor:
        return self.abs > self.ref_abs * rtol + atol  # a bound >= 0: the same values (0 apart) are within

    def relative(self) -> torch.Tensor:
        return (self.abs / self.ref_abs).nan_to_num_(nan=0.0, posinf=float("inf"))  # 0/0: the same; x/0: inf

    def test_nans(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64, device=self.abs.device)


def _row(name: str, stages: tuple[int, ...], shape: tuple[int, ...], diff: _Diff, failing: torch.Tensor,
         tol: Callable[[float], str], atol: torch.Tensor | None = None, microbatches: int = 0,
         power: _Power | None = None) -> Row:
    """The row's numbers, computed where the tensors are and read back in one transfer."""
    absolute = diff.abs
    if not absolute.numel():
        return Row(name, tuple(stages), shape, True, 0.0, 0.0, tol(0.0), None, 0, 0, power=0.0)
    power = power or _Power(_scale(diff.ref_abs), 0.0, 0.0, None)
    rel = diff.relative()
    numbers = torch.stack([absolute.max(), rel.max(), failing.sum().to(torch.float64),
                           torch.argmax(absolute).to(torch.float64),
                           atol if atol is not None else torch.zeros((), dtype=torch.float64, device=absolute.device),
                           diff.test_nans().to(torch.float64), *power.numbers(absolute.device)])
    (max_abs, max_rel, failing_count, flat_any, atol_value, nan_count, scale, atol_bound,
     eager_error, bound_scale, norm_error, norm_eager) = numbers.tolist()
    off = eager_error / scale if eager_error >= 0 and scale > 0 else None
    norm_fields: dict[str, Any] = {}
    if power.norm is not None and norm_eager > 0:  # eager all zeros: the elementwise bound alone
        norm_fields = {"norm_error": norm_error / norm_eager, "norm_bound": power.norm.bound}
    # the worst failing element (only on failure: one more read), else the worst of all
    flat = int(torch.argmax(torch.where(failing, absolute, -1.0))) if failing_count else flat_any
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(int(flat)), absolute.shape)) if absolute.dim() else ()
    by_microbatch = None
    if failing_count and microbatches > 1 and failing.dim() and failing.shape[0] % microbatches == 0:
        per_slice = failing.reshape(microbatches, -1).any(dim=1).tolist()  # only on failure: one more read
        by_microbatch = tuple(mb for mb, fails in enumerate(per_slice) if fails)
    norm_ok = not norm_fields or norm_fields["norm_error"] <= norm_fields["norm_bound"]
    return Row(name, tuple(stages), shape, failing_count == 0 and norm_ok, max_abs, max_rel, tol(atol_value), index,
               int(failing_count), absolute.numel(), n_nan=int(nan_count), failing_microbatches=by_microbatch,
               power=power_of(bound_scale, atol_bound, power.rtol), scale=scale,
               bound=atol_bound + power.rtol * bound_scale, eager_off=off, **norm_fields)


def nonfinite(value: torch.Tensor) -> bool:
    return (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all())
