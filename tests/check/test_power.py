"""A pass must mean something: every compared row knows the smallest error it could see, and a check
whose float32 run is too noisy to see a gross error on some rows does not pass under tolerance "auto"."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import _odd_models
import pytest
import torch
from mutants.runners import BaseRunner, check
from pipecheck.fixtures import get

import pipecheck as pc
from pipecheck._check.numerics import NEGLIGIBLE, POWER_LIMIT, Row, compare, judge_power, power_of
from pipecheck._check.report import percent_ceiling

# private: the reference runner's function, wrapped to plant bugs; zoo_cell is the zoo's verdict cell
from pipecheck._runners.base import run_reference

CUT = {"layers.2": pc.SplitPoint.BEGINNING}


def grads_scaled(factor: float, prefixes: tuple[str, ...] = ("",)) -> Callable[[pc.Job], pc.StepResult]:
    """A broken runner: the reference's step with the gradients of parameters named ``prefixes...``
    scaled by ``factor`` (0.75: a micro-batch of four lost; 2: a gradient summed twice)."""

    def run(job: pc.Job) -> pc.StepResult:
        result = run_reference(job)
        grads = {name: grad * factor if name.startswith(prefixes) else grad for name, grad in result.grads.items()}
        return dataclasses.replace(result, grads=grads, stage_grads=[], replica_grads={})

    return run


def _ill_conditioned(runner: object, **settings: object) -> pc.Report:
    return pc.assert_equivalent(_odd_models.NearlyEqualBatchNorm, (_odd_models.nearly_equal_samples(),),
                                n_microbatches=4, split_spec=CUT, runner=runner, **settings)


def test_a_well_conditioned_check_says_what_it_can_see() -> None:
    report = check(BaseRunner(), "mlp")
    assert report.power is not None and report.power < 1e-4
    assert not report.blind
    assert "can see errors >= " in report.headline()
    assert all(row.power is not None and row.power < 1e-4 for row in report.rows if not row.numerically_zero)


def test_a_correct_runner_on_an_ill_conditioned_model_is_refused_not_certified() -> None:
    with pytest.raises(pc.PowerError) as caught:
        _ill_conditioned("reference")
    report = caught.value.report
    assert isinstance(report, pc.Report) and report.ok
    assert report.blind and all(row.power is not None and row.power > POWER_LIMIT for row in report.blind)
    text = str(caught.value)
    assert text.startswith(f"runner 'reference' matched eager, but that certifies nothing: {len(report.blind)} of")
    assert "eager float32 off float64 by" in text
    assert "dtype=torch.float64" in text and "pc.Tolerance(" in text and "larger micro-batches" in text
    assert len(text.splitlines()) <= 40


@pytest.mark.parametrize("bug", [grads_scaled(0.75, ("layers.0", "layers.1")), grads_scaled(2.0, ("layers.0",))],
                         ids=["stage-0-lost-microbatch", "stage-0-doubled"])
def test_a_bug_hidden_by_an_ill_conditioned_float32_run_never_passes(bug: Callable[..., pc.StepResult]) -> None:
    # before rows knew their power, both passed: 'matches eager (32 tensors)'
    with pytest.raises((pc.PowerError, pc.EquivalenceError)):
        _ill_conditioned(bug)
    with pytest.raises(pc.EquivalenceError) as caught:  # float64 throughout sees it
        _ill_conditioned(bug, dtype=torch.float64)
    assert any(row.name.startswith("grad layers.0") for row in caught.value.report.failures)


@pytest.mark.parametrize("runner", ["reference", "distributed"])
def test_float64_checks_an_ill_conditioned_model_that_float32_cannot(runner: str) -> None:
    report = _ill_conditioned(runner, dtype=torch.float64)
    assert report.dtype == "float64" and not report.blind
    # float64's rounding, estimated from float32's (2**-29 of it): a gradient that cancels (a bias before a
    # BatchNorm, 1e-15 of the largest) is resolved to a few percent; every other row to 1e-8
    assert max(row.power for row in report.rows if row.power is not None and row.scale > 1e-6) < 1e-7


def test_an_explicit_tolerance_is_the_user_s_to_accept_and_still_reports_its_power() -> None:
    report = _ill_conditioned("reference", tolerance=pc.Tolerance(rtol=0.5, atol=0.1))
    assert report.power is not None and report.power > POWER_LIMIT
    assert report.blind  # said, not refused


def test_a_failing_check_with_blind_rows_says_their_pass_certifies_nothing() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _ill_conditioned(grads_scaled(0.5))
    assert "their passing rows certify nothing" in str(caught.value)


def test_a_gradient_that_cancels_to_zero_is_numerically_zero_not_blind() -> None:
    entry = get("running_stats")  # Linear biases before BatchNorm: their true gradient is 0
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    report = pc.assert_equivalent(entry.factory(style), args, kwargs, runner="reference", loss_fn=entry.loss_fn,
                                  target=entry.target(), n_microbatches=4, **entry.cut(style))
    zero = [row for row in report.rows if row.numerically_zero]
    assert "grad fc0.bias" in {row.name for row in zero}
    assert not report.blind
    assert f"but {len(zero)} numerically zero" in report.headline()


@pytest.mark.parametrize(("scale", "atol", "rtol", "expected"), [
    (1.0, 0.0, 0.0, 0.0),
    (2.0, 0.1, 0.01, 0.06),
    (0.0, 0.0, 0.0, 0.0),  # exactly zero, exactly matched
    (0.0, 1e-6, 0.0, float("inf")),
])
def test_power_is_the_bound_over_the_scale(scale: float, atol: float, rtol: float, expected: float) -> None:
    assert power_of(scale, atol, rtol) == pytest.approx(expected)


def _row(name: str, scale: float, bound: float, eager_off: float | None = 0.01, numel: int = 4) -> Row:
    return Row(name, (0,), (numel,), True, 0.0, 0.0, "auto", None, 0, numel, power=power_of(scale, bound, 0.0),
               scale=scale, bound=bound, eager_off=eager_off)


def test_blind_and_numerically_zero_are_judged_against_the_largest_value_of_the_kind() -> None:
    rows = judge_power([
        _row("output", 2.0, 1e-6), _row("grad a", 1.0, 1e-6), _row("grad b", 0.5, 0.2),
        _row("grad c", 1e-9, 1e-9, eager_off=1.0), _row("grad d", 1e-9, 1e-9, eager_off=0.05),
        _row("grad e", 0.0, 1e-8), _row("grad f", 0.0, 0.0, numel=0),
        _row("loss", 1e-12, 4e-12, eager_off=1.0), _row("buffer m", 1e-9, 1e-9, eager_off=1.0),
        _row("buffer big", 1e9, 1.0), _row("grad x", 1.0, 0.5, eager_off=None)])
    judged = {row.name: (row.blind, row.numerically_zero) for row in rows}
    assert judged == {
        "output": (False, False),
        "grad a": (False, False),  # sees 1e-6 of its scale
        "grad b": (True, False),  # cannot see 40% of a gradient as large as the others
        "grad c": (False, True),  # a billionth of the largest, and eager cannot resolve it at all
        "grad d": (True, False),  # as small, but eager resolves it to 5%: a bug there can hide
        "grad e": (False, True),  # exactly zero
        "grad f": (False, False),  # empty: nothing to judge
        "loss": (False, True),  # a loss that cancels, beside outputs of size 2
        "buffer m": (False, True),  # a running mean of values whose mean is zero, beside a large buffer
        "buffer big": (False, False),
        "grad x": (True, False),  # an explicit tolerance: no truth to call it zero by
    }
    assert NEGLIGIBLE < POWER_LIMIT
    # a mask buffer's fill value (finfo(float32).min) is no magnitude: it excuses no neighbour
    beside_a_mask = judge_power([_row("buffer mask", 3.4e38, 0.0), _row("buffer m", 1e-9, 1e-9, eager_off=1.0)])
    assert [(row.blind, row.numerically_zero) for row in beside_a_mask] == [(False, False), (True, False)]


def test_an_infinite_power_is_said_in_words() -> None:
    assert percent_ceiling(float("inf")) == "any size"
    assert percent_ceiling(2.8e-6) == "0.001%" and percent_ceiling(0.03) == "10%"


def test_a_row_s_power_is_its_bound_over_its_scale() -> None:
    truth = torch.tensor([4.0, -2.0], dtype=torch.float64)
    eager = torch.tensor([4.001, -2.0])
    row = compare("grad w", eager.clone(), eager, truth, "auto")
    eps = torch.finfo(torch.float32).eps
    eager_error = float((eager.double() - truth).abs().max())
    assert row.power == pytest.approx((4 * eager_error + 2 * eps * 4.0) / 4.0 + 2 * eps)
    assert row.eager_off == pytest.approx(eager_error / 4.0)
    assert compare("w", eager, eager, None, "exact").power == 0.0


def test_a_refused_zoo_cell_reads_refused_and_says_why() -> None:
    from pipecheck._cli.zoo import zoo_cell

    cell = zoo_cell(lambda: _ill_conditioned("reference"))
    assert cell.outcome == "refused"
    assert cell.text.startswith("REFUSED: ") and "blind" in cell.text
    assert "certifies nothing" in cell.message


@pytest.mark.parametrize("n", [1, 2])
def test_a_buffer_that_is_rounding_noise_around_zero_is_numerically_zero_not_blind(n: int) -> None:
    """MobileNetV3's pattern: a BatchNorm after a bias-free 1x1 conv fed by another BatchNorm keeps a
    running mean of ~1e-10 in float32 (float64: ~1e-18). Judged blind ("36295419732%") it refused every
    train-mode check of the model; it is numerically zero, as a gradient that cancels is."""
    report = pc.assert_equivalent(_odd_models.zero_mean_batchnorm, (_odd_models.images(),), n_microbatches=n,
                                  split_spec={"pw": pc.SplitPoint.BEGINNING}, runner="reference")
    assert report.ok and not report.blind
    assert report.row("buffer bn2.running_mean").numerically_zero
    assert not report.row("buffer bn2.running_var").numerically_zero
