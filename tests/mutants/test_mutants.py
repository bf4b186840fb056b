"""Planted bugs: every mutant runner is caught by assert_equivalent on every zoo model it declares,
with the right tensor named and the right hint; the correct base runner passes on the whole zoo."""

from __future__ import annotations

import pytest

import pipecheck as pc

from .runners import ALL, BASES, MUTANTS, BaseRunner, cases, check

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


@pytest.mark.parametrize("base,model", [pytest.param(b, m, id=f"{b.name}-{m}") for b in BASES for m in ALL])
def test_base_runner_passes(base: BaseRunner, model: str) -> None:
    report = check(base, model)
    assert report.ok


@pytest.mark.parametrize("runner,model", [pytest.param(r, m, id=f"{r.name}-{m}") for r, m in cases()])
def test_mutant_is_caught(runner: BaseRunner, model: str) -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        check(runner, model)
    report = caught.value.report
    failing = [row.name for row in report.failures]
    expected = runner.expect(model)
    assert expected, f"{runner.name} declares {model} but expects no tensor"
    assert set(expected) <= set(failing), f"expected {expected} among failures {failing}"
    for name in expected:
        assert name in str(caught.value)
    hint = runner.expected_hint(model)
    if hint is not None:
        assert hint in report.hints.get(expected[0], ""), report.hints
    # where it went wrong, above the table: the first divergent boundary value, or why there is none
    assert runner.located, f"{runner.name} declares no first-divergence line"
    assert runner.located in report.located, report.located
    assert str(caught.value).splitlines()[1] == report.located


def test_suite_covers_every_planted_bug() -> None:
    assert len(MUTANTS) >= 17
    assert {"weight_run_twice", "weight_dropped", "weight_crosses_microbatches"} <= set(MUTANTS)
    assert {model for runner in MUTANTS.values() for model in runner.applies_to} == set(ALL)
    for runner in MUTANTS.values():
        assert set(runner.applies_to) <= set(ALL), runner.name
