"""A failing row that a legitimate re-ordering of the same math moves as far is not evidence: it is blind.

    rows, notes = rounding_excused(report.rows, job, seed)   # before a float64-anchored check fails

Under tolerance "auto" in float32 or float64 a row fails where the runner's error exceeds a small multiple
of eager's own error against float64, plus a floor: one sample of eager's rounding. Where the math is
ill-conditioned (a BatchNorm over a few values per channel, as in a ResNet's last stages on small images),
a correct runner that adds in another order moves a few elements further than that sample: pipecheck's
own ranks run fewer intra-op threads than the driver (a convolution's reduction is split by thread), an
engine sums its micro-batches last first. Before such a check fails, pipecheck's reference runs the step
again as it is, on another thread count and with every sum reversed; a failing row whose error is within
its tolerance plus twice the largest difference either re-ordering makes there (against the reference
itself: a split that computes something else is off in every run alike) is blind, not failing: it
certifies nothing, and the check says so (a PowerError where nothing else fails), never that the runner
is wrong. A real bug moves a well-conditioned row far beyond rounding, and still fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipecheck._check.anchor import intra_op_threads
from pipecheck._check.eager import named_tensors
from pipecheck._check.numerics import Row
from pipecheck._core.result import StepResult
from pipecheck._runners.job import Job
from pipecheck._runtime.reference import Accumulation, DetachExecutor
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.model_factory import seeded
from pipecheck.errors import plural

NOISE_MULTIPLE = 2.0  # as the low-precision anchor: a runner's own re-ordering may move a value twice as far


def rounding_excused(rows: list[Row], job: Job, seed: int) -> tuple[list[Row], list[str]]:
    """``rows`` with each failing row that rounding explains made blind (passing, certifying nothing), and
    a note naming them; ``rows`` as they were where none is."""
    failing = {row.name: row for row in rows if not row.ok and not row.note and not row.n_nan}
    if not failing:
        return rows, []
    noise = _rounding_noise(job, seed, set(failing))
    excused: dict[str, Row] = {}
    for name, row in failing.items():
        moved = noise.get(name, 0.0)
        if moved > 0 and row.max_abs <= row.bound + NOISE_MULTIPLE * moved:
            sees = (row.bound + NOISE_MULTIPLE * moved) / row.scale if row.scale > 0 else float("inf")
            excused[name] = dataclasses.replace(row, ok=True, blind=True, power=max(row.power or 0.0, sees))
    if not excused:
        return rows, []
    names = ", ".join(sorted(excused)[:4]) + (f" and {len(excused) - 4} more" if len(excused) > 4 else "")
    note = (f"{plural(len(excused), 'tensor')} ({names}) failed by less than a re-ordering of the same math moves "
            "them (pipecheck's reference on another thread count, or with its sums reversed, against itself): "
            "rounding of an ill-conditioned step, not evidence; they certify nothing")
    return [excused.get(row.name, row) for row in rows], [note]


def _rounding_noise(job: Job, seed: int, names: set[str]) -> dict[str, float]:
    """Each named row's largest elementwise difference between pipecheck's reference as it runs and the same
    reference re-ordered (its sums reversed; another thread count). Measured against the reference itself,
    never against eager: a split that computes something else (a stale graph, a splitter's bug) is off in
    every run alike, and no difference of its own can excuse it."""
    threads = torch.get_num_threads()
    runs = [_step(job, seed, Accumulation(), threads), _step(job, seed, Accumulation(reverse=True), threads),
            _step(job, seed, Accumulation(), 1 if threads > 1 else 2)]
    base = dict(_named(runs[0]))
    noise: dict[str, float] = {}
    for step in runs[1:]:
        for name, value in _named(step):
            mine = base.get(name)
            if name in names and isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) \
                    and value.shape == mine.shape and mine.is_floating_point() and mine.numel():
                moved = float((value.detach().double() - mine.detach().double().to(value.device)).abs().max())
                noise[name] = max(noise.get(name, 0.0), moved)
    return noise


def _step(job: Job, seed: int, accumulation: Accumulation, threads: int) -> StepResult:
    args, kwargs, target = cast_inputs((job.args, job.kwargs, job.target), None, None, copy=True)
    with intra_op_threads(threads), seeded(seed):
        return DetachExecutor(job.split(), accumulation=accumulation, precision=job.precision).step(
            args, kwargs, loss_fn=job.loss_fn, target=target, n_microbatches=job.n_microbatches)


def _named(result: StepResult) -> list[tuple[str, Any]]:
    return named_tensors(result) + [(f"buffer {fqn}", value) for fqn, value in result.buffers.items()]
