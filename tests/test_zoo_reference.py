"""Every zoo model, cut every way it supports, matches eager under the reference runner."""

from __future__ import annotations

import pytest
import torch

import pipecheck as pc
from pipecheck import fixtures

CASES = [pytest.param(entry, style, id=f"{entry.name}-{style}") for entry, style in fixtures.cases()]
DTYPES = [pytest.param(None, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _check(entry: fixtures.ZooModel, style: str, **options: object) -> pc.Report:
    args, kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory(style), args, kwargs, runner="reference",
                                loss_fn=entry.loss_fn, target=entry.target(), **entry.cut(style),
                                **options)


@pytest.mark.parametrize("n_microbatches", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("entry", "style"), CASES)
def test_zoo_model_matches_eager(entry: fixtures.ZooModel, style: str, dtype: torch.dtype | None,
                                 n_microbatches: int) -> None:
    report = _check(entry, style, dtype=dtype, n_microbatches=n_microbatches)  # never refused, bfloat16 too
    assert report.ok and not report.blind
    if dtype is torch.bfloat16:  # anchored on eager bfloat16, and it says what it can see
        assert report.tolerance == "auto, anchored on eager bfloat16"
        assert report.norm_power is not None and report.norm_power < 0.05 and report.power < 0.1
    assert report.num_stages == entry.num_stages
    assert report.dtype == ("bfloat16" if dtype is torch.bfloat16 else "float32")


@pytest.mark.parametrize(("entry", "style"), CASES)
def test_zoo_pipe_has_the_intended_number_of_stages(entry: fixtures.ZooModel, style: str) -> None:
    args, kwargs = entry.inputs()
    pipe = pc.split(entry.factory(style)(), args, kwargs, **entry.cut(style))
    assert pipe.num_stages == entry.num_stages


EXPORT_CASES = [
    pytest.param(entry, "markers" if "markers" in entry.cut_styles else entry.cut_styles[0],
                 id=f"{entry.name}-{'markers' if 'markers' in entry.cut_styles else entry.cut_styles[0]}")
    for entry in fixtures.ZOO
]


@pytest.mark.parametrize(("entry", "style"), EXPORT_CASES)
def test_zoo_model_matches_eager_with_export_tracer(entry: fixtures.ZooModel, style: str) -> None:
    # n_microbatches=4: the export trace sees the full batch of 8, the stages run on 2 rows.
    report = _check(entry, style, tracer="export", n_microbatches=4)
    assert report.ok
    assert report.num_stages == entry.num_stages
