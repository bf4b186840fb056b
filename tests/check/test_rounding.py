"""A failing row that a re-ordering of the same math moves as far is blind, not failing; a real error still
fails (pipecheck._check.rounding)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import pipecheck as pc
from pipecheck._check import rounding
from pipecheck._check.numerics import Row

sys.path.insert(0, __file__.rsplit("/check/", 1)[0])
from _odd_models import NearlyEqualBatchNorm, nearly_equal_samples  # noqa: E402


def _row(name: str, max_abs: float, bound: float = 1.0, ok: bool = False) -> Row:
    return Row(name, (0,), (4,), ok, max_abs, max_abs, "auto", (0,), 0 if ok else 1, 4, power=0.01, scale=10.0,
               bound=bound)


def test_a_failure_within_rounding_becomes_blind_and_one_beyond_it_stays(monkeypatch: Any) -> None:
    monkeypatch.setattr(rounding, "_rounding_noise", lambda job, seed, names: {
        "grad a": 0.3, "grad b": 0.3, "grad c": 0.0})
    rows = [_row("grad a", 1.5), _row("grad b", 1.7), _row("grad c", 1.1), _row("grad d", 0.5, ok=True)]
    got, notes = rounding.rounding_excused(rows, None, 0)  # type: ignore[arg-type]
    by_name = {row.name: row for row in got}
    assert by_name["grad a"].ok and by_name["grad a"].blind and by_name["grad a"].power == pytest.approx(0.16)
    assert not by_name["grad b"].ok and not by_name["grad c"].ok  # beyond bound + 2 x noise; no noise at all
    assert by_name["grad d"] is rows[3]
    assert notes == ["1 tensor (grad a) failed by less than a re-ordering of the same math moves them (pipecheck's "
                     "reference on another thread count, or with its sums reversed, against itself): rounding of an "
                     "ill-conditioned step, not evidence; they certify nothing"]


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return NearlyEqualBatchNorm(depth=4)


def halves_one_gradient(job: pc.Job) -> pc.StepResult:
    """An engine that loses half of one parameter's gradient (a tied replica's share, say)."""
    result = pc.DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                                 n_microbatches=job.n_microbatches)
    result.grads["head.weight"] = result.grads["head.weight"] / 2
    return result


def test_a_real_error_on_an_ill_conditioned_model_still_fails() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(make, (nearly_equal_samples(1e-3, batch=8),), split_spec={"layers.1": pc.SplitPoint.BEGINNING},
                             n_microbatches=4, runner=halves_one_gradient)
    assert [row.name for row in caught.value.report.failures] == ["grad head.weight"]


def resnet() -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50()


@pytest.mark.slow
def test_resnet50_on_small_images_through_the_runtime_is_refused_as_blind_not_failed(pipecheck_world: Any) -> None:
    """Found by the real-model suite: the ranks' other thread count moved 14 elements of two BatchNorm'd
    gradients past the auto tolerance (reported as a mismatch before)."""
    pytest.importorskip("torchvision")
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(pc.PowerError):
        pc.assert_equivalent(resnet, (x,), policy=pc.policies.balanced_params(2), n_microbatches=2,
                             world=pipecheck_world(2))
