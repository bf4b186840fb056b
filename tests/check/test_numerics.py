"""One tensor's verdict under each tolerance, infinities and NaNs included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
from pipecheck._check.numerics import compare

INF, NAN = float("inf"), float("nan")
EAGER = torch.tensor([0.0, -INF, 1.0])  # e.g. a causal mask, or masked logits


@pytest.mark.parametrize("tolerance", ["auto", pc.Tolerance(1e-3, 1e-3), "exact"], ids=str)
@pytest.mark.parametrize("test,ok", [
    pytest.param([0.0, -INF, 1.0], True, id="same-infinity"),
    pytest.param([0.0, 0.0, 1.0], False, id="finite-for-infinite"),
    pytest.param([0.0, INF, 1.0], False, id="opposite-infinity"),
    pytest.param([0.0, NAN, 1.0], False, id="nan-for-infinite"),
    pytest.param([0.0, -INF, 1.1], False, id="finite-part-off"),
])
def test_infinities_match_only_themselves(test: list[float], ok: bool, tolerance: object) -> None:
    row = compare("x", torch.tensor(test), EAGER, EAGER.double(), tolerance)  # type: ignore[arg-type]
    assert row.ok is ok
    assert row.max_abs == row.max_abs and row.max_rel == row.max_rel  # never NaN in the table
    if ok:
        assert (row.max_abs, row.n_failing) == (0.0, 0)


def test_an_infinite_entry_does_not_widen_the_auto_tolerance() -> None:
    eager = torch.tensor([1.0, -INF, 2.0])
    truth = torch.tensor([1.0, -INF, 2.0], dtype=torch.float64)
    row = compare("x", torch.tensor([1.0, -INF, 2.5]), eager, truth, "auto")
    assert not row.ok and "atol 4.8e-07" in row.tolerance  # 2 eps x scale 2: the finite entries only


class CausalMask(nn.Module):
    """A constant -inf mask buffer, as attention layers keep one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), -INF), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pc.pipe_split()
        return self.b(torch.softmax(h.unsqueeze(-1) + self.mask, dim=-1).sum(-1))


def test_a_model_with_an_infinite_buffer_passes() -> None:
    report = pc.assert_equivalent(CausalMask, (torch.randn(8, 4),), runner="reference", n_microbatches=2)
    assert report.ok and report.row("buffer mask").ok


class ComplexPhase(nn.Module):
    """A complex parameter, and a complex value crossing the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.a(x) * self.phase
        pc.pipe_split()
        return self.b(z.imag) + self.b(z.real)


def imaginary_part_of_a_grad_dropped(job: pc.Job) -> pc.StepResult:
    # private: the reference runner's function, wrapped to plant a bug
    from pipecheck._runners.base import run_reference

    result = run_reference(job)
    result.grads["phase"] = result.grads["phase"].real.to(torch.complex64)
    return result


def test_complex_parameters_keep_their_imaginary_part_and_are_compared_as_pairs() -> None:
    """The fp64 ground truth casts them to complex128, not to a real dtype; a runner that loses the
    imaginary part of their gradient fails on that row."""
    x = torch.randn(8, 4)
    report = pc.assert_equivalent(ComplexPhase, (x,), runner="reference", n_microbatches=2)
    assert report.row("grad phase").shape == (4,) and report.row("grad phase").max_abs < 1e-5
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(ComplexPhase, (x,), runner=imaginary_part_of_a_grad_dropped, n_microbatches=2)
    failing = caught.value.report.row("grad phase")
    assert [row.name for row in caught.value.report.rows if not row.ok] == ["grad phase"]
    assert failing.shape == (4,) and failing.worst_index is not None and len(failing.worst_index) == 1


class ComplexOutput(nn.Module):
    """A complex output (a spectrum): the default loss projects both parts of every element."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        pc.pipe_split()
        h = self.b(h)
        return h, torch.fft.fft(h)


def spectrum_conjugated(job: pc.Job) -> pc.StepResult:
    from pipecheck._runners.base import run_reference

    result = run_reference(job)
    result.outputs = (result.outputs[0], result.outputs[1].conj())
    return result


def test_a_complex_output_is_checked_with_the_default_loss_in_both_its_parts() -> None:
    """Before, the projection of a complex output was complex and its backward refused it."""
    x = torch.randn(8, 8)
    for dtype in (None, torch.float64):
        report = pc.assert_equivalent(ComplexOutput, (x,), runner="reference", n_microbatches=2, dtype=dtype)
        assert report.ok and report.row("output[1]").shape == (8, 8) and report.row("grad a.weight").numel
    with pytest.raises(pc.EquivalenceError) as caught:  # only the imaginary parts differ
        pc.assert_equivalent(ComplexOutput, (x,), runner=spectrum_conjugated, n_microbatches=2)
    assert [row.name for row in caught.value.report.failures] == ["output[1]"]


@pytest.mark.parametrize("case", ["noise", "exact", "zeros in truth", "one bad element", "tiny", "scalar",
                                  "truth error", "all bad"])
def test_the_all_finite_path_gives_the_general_paths_row(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of finite tensors take a shorter path; every number in the row is the general path's."""
    import pipecheck._check.numerics as numerics

    g = torch.Generator().manual_seed(len(case))
    truth = torch.randn(64, 33, generator=g, dtype=torch.float64)
    if case == "zeros in truth":
        truth[::3] = 0.0
    if case == "tiny":
        truth = truth * 1e-30
    if case == "scalar":
        truth = truth[0, 0]
    eager = (truth + torch.randn(truth.shape, generator=g, dtype=torch.float64) * 1e-7 * truth.abs()).float()
    noise = torch.randn(truth.shape, generator=g, dtype=torch.float64) * 1e-8 * truth.abs()
    test = eager.clone() if case == "exact" else (eager.double() + noise).float()
    if case == "one bad element":
        test[5, 7] += 1.0
    if case == "all bad":
        test = test * 1.5
    truth_error = truth.abs() * 1e-9 if case == "truth error" else None
    shorter, finite_diff = [], numerics._FiniteDiff
    monkeypatch.setattr(numerics, "_FiniteDiff", lambda *a: shorter.append(1) or finite_diff(*a))
    fast = compare("grad w", test, eager, truth, "auto", (1,), microbatches=4, truth_error=truth_error)
    assert shorter  # the row took the shorter path
    monkeypatch.undo()
    monkeypatch.setattr(numerics, "_all_finite", lambda *tensors: False)
    general = compare("grad w", test, eager, truth, "auto", (1,), microbatches=4, truth_error=truth_error)
    assert fast == general
    assert fast.ok is (case not in ("one bad element", "all bad"))
