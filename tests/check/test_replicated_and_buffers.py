"""Inputs every micro-batch gets whole (``pc.Replicated``) and buffers after the step, through every
runner: the eager reference, DetachExecutor, pipecheck's runtime and torch.distributed.pipelining."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipecheck as pc
from pipecheck import fixtures

# private: the reference runner's function, wrapped to plant bugs
from pipecheck._runners.base import run_reference

BATCH, WIDTH = 8, 4


class Scaled(nn.Module):
    """``scale`` has no batch dimension: it must reach every micro-batch whole (it is (WIDTH,) and
    WIDTH divides the batch too, so splitting it on dim 0 would silently broadcast a slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, flag: torch.Tensor | None = None) -> torch.Tensor:
        torch._assert(scale.shape[0] == WIDTH, "scale arrived split")  # traceable: it runs in every stage
        h = self.a(x) * scale
        pc.pipe_split()
        out = self.b(h) * scale
        return out if flag is None else out * flag


class ScaledOnce(Scaled):
    def forward(self, x: torch.Tensor, scale: torch.Tensor, flag: torch.Tensor | None = None) -> torch.Tensor:
        torch._assert(scale.shape[0] == WIDTH, "scale arrived split")
        h = self.a(x) * scale
        pc.pipe_split()
        return self.b(h)


def _inputs(grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, WIDTH, generator=g)
    scale = torch.linspace(0.5, 1.5, WIDTH).requires_grad_(grad)
    return x, scale, torch.full((1,), 2.0)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_replicated_input_reaches_every_microbatch_whole(tracer: str) -> None:
    x, scale, flag = _inputs(grad=True)
    report = pc.assert_equivalent(Scaled, (x, pc.Replicated(scale)), {"flag": pc.Replicated(flag)},
                                  runner="reference", n_microbatches=4, tracer=tracer)
    assert report.ok and report.row("grad input scale").ok  # summed over micro-batches, as eager
    assert report.row("grad input scale").shape == (WIDTH,)


def test_replicated_inputs_through_the_runtime_and_torch(pipecheck_world: Any) -> None:
    x, scale, flag = _inputs(grad=False)
    args, kwargs = (x, pc.Replicated(scale)), {"flag": pc.Replicated(flag)}
    assert pc.assert_equivalent(Scaled, args, kwargs, runner="distributed", n_microbatches=4,
                                world=pipecheck_world(2)).ok
    with warnings.catch_warnings():  # torch feeds model inputs to stage 0 only: scale used there alone
        warnings.simplefilter("ignore", FutureWarning)
        assert pc.assert_equivalent(ScaledOnce, (x, pc.Replicated(scale)), runner="torch", n_microbatches=4,
                                    world=pipecheck_world(2)).ok


def test_replicated_input_gradient_is_summed_by_the_runtime(pipecheck_world: Any) -> None:
    x, scale, _ = _inputs(grad=True)
    report = pc.assert_equivalent(Scaled, (x, pc.Replicated(scale)), runner="distributed", n_microbatches=4,
                                  world=pipecheck_world(2))
    assert report.ok and report.row("grad input scale").shape == (WIDTH,)


def test_split_microbatches_hands_a_replicated_value_to_every_chunk_unwrapped() -> None:
    x, scale, _ = _inputs()
    chunks = pc.split_microbatches({"x": x, "scale": pc.Replicated(scale)}, 4)
    assert [tuple(c["x"].shape) for c in chunks] == [(2, WIDTH)] * 4
    assert all(c["scale"] is scale for c in chunks)
    assert repr(pc.Replicated(3)) == "pc.Replicated(3)"


def test_a_non_batched_input_that_does_not_divide_says_to_replicate_it() -> None:
    x = torch.randn(BATCH, WIDTH)
    with pytest.raises(pc.InputError, match=r"pass it as pc\.Replicated\(value\)"):
        pc.split_microbatches((x, torch.ones(3)), 4)


def test_the_users_replicated_tensor_is_never_touched() -> None:
    x, scale, _ = _inputs(grad=True)
    before = scale.detach().clone()
    pc.assert_equivalent(Scaled, (x, pc.Replicated(scale)), runner="reference", n_microbatches=2)
    assert scale.grad is None and torch.equal(scale.detach(), before)


# --------------------------------------------------------------------------- buffers after the step

def _running_stats(runner: Any, **kwargs: Any) -> pc.Report:
    entry = fixtures.get("running_stats")
    args, call_kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory(), args, call_kwargs, runner=runner, n_microbatches=4, **kwargs)


BUFFER_ROWS = ["buffer mean_seen", "buffer bn.running_mean", "buffer bn.running_var",
               "buffer bn.num_batches_tracked"]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_buffers_a_forward_updates_are_compared_after_the_step(tracer: str) -> None:
    report = _running_stats("reference", tracer=tracer)
    assert report.ok and [r.name for r in report.rows if r.name.startswith("buffer")] == BUFFER_ROWS
    assert report.row("buffer bn.num_batches_tracked").stages == (0,)
    assert report.row("buffer mean_seen").stages == (1,)


def test_buffers_after_the_step_through_the_runtime_and_torch(pipecheck_world: Any) -> None:
    for runner in ("distributed", "torch"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            report = _running_stats(runner, world=pipecheck_world(3))
        assert report.ok and [r.name for r in report.rows if r.name.startswith("buffer")] == BUFFER_ROWS, runner


def _corrupt_running_mean(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.buffers["bn.running_mean"] = result.buffers["bn.running_mean"] * 1.01
    return result


def _no_buffers(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    result.buffers = {}
    return result


def _drops_one_buffer(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    del result.buffers["mean_seen"]
    return result


def test_a_corrupted_buffer_fails_by_name() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _running_stats(_corrupt_running_mean)
    assert [row.name for row in caught.value.report.failures] == ["buffer bn.running_mean"]


def test_a_runner_reporting_no_buffers_is_noted_not_failed() -> None:
    report = _running_stats(_no_buffers)
    assert report.ok and not any(r.name.startswith("buffer") for r in report.rows)
    assert report.notes == ["buffers were not compared: the runner reported none (4 of 4 buffers change during "
                            "the eager step)"]
    assert str(report).endswith("\nnote: " + report.notes[0])


def test_a_changed_buffer_left_out_fails_as_missing() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _running_stats(_drops_one_buffer)
    row = caught.value.report.row("buffer mean_seen")
    assert not row.ok and row.note == "missing from the runner's result"


def test_unchanged_buffers_need_not_be_reported() -> None:
    report = pc.assert_equivalent(fixtures.get("buffers").factory(), *fixtures.get("buffers").inputs(),
                                  runner=_drops_scale, n_microbatches=2)
    assert report.ok and "buffer scale" not in [row.name for row in report.rows]


def _drops_scale(job: pc.Job) -> pc.StepResult:
    result = run_reference(job)
    del result.buffers["scale"]
    return result


# --------------------------------------------------------------------------- outputs that are not pytrees

class Result:
    """An output class not registered with torch.utils._pytree."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> Result:
        h = self.a(x)
        pc.pipe_split()
        return Result(self.b(h))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_output_of_an_unregistered_class_is_refused_at_split_time(tracer: str) -> None:
    with pytest.raises(pc.SplitError) as caught:
        pc.split(ReturnsAnObject(), (torch.randn(BATCH, WIDTH),), tracer=tracer)
    message = str(caught.value)
    assert "Result" in message and "torch.utils._pytree.register_pytree_node" in message
    assert "Fix: return a tuple, dict or NamedTuple of tensors" in message
