"""An engine in processes of its own that records with ``job.recorder(stage)`` is located as pipecheck's own
runners are: the stage, the micro-batches and the direction of its planted bug; its correct twin passes; a
recording that does not fit the split is said in full (tests/_recording_engine.py is the engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _recording_engine import CUT, RANDOM_CUT, DropSkipNet, SkipNet, TwoProcessEngine

import pipecheck as pc


def _check(engine: TwoProcessEngine, world: Any) -> pc.Report:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    return pc.assert_equivalent(SkipNet, (x,), split_spec=CUT, n_microbatches=4, runner=engine, world=world)


def _failure(engine: TwoProcessEngine, world: Any) -> pc.Report:
    with pytest.raises(pc.EquivalenceError) as caught:
        _check(engine, world)
    return caught.value.report


def test_the_correct_twin_passes(pipecheck_world: Any) -> None:
    assert _check(TwoProcessEngine(), pipecheck_world(2)).ok


def test_a_stage_that_scales_one_microbatch_is_located_there_in_the_forward(pipecheck_world: Any) -> None:
    report = _failure(TwoProcessEngine("scale_mb2"), pipecheck_world(2))
    found = report.first_divergence
    assert found is not None
    # stage 1 received every micro-batch right (the engine's own tensors, named by position) and sent mb 2 wrong
    assert (found.stage, found.direction, found.point, found.value) == (1, "forward", "sent", "output")
    assert (found.microbatches, found.matching) == ((2,), (0, 1, 3))
    assert report.located.startswith("first divergence: stage 1 sent 'output' in the forward: micro-batch 2 differs")


def test_a_dropped_skip_gradient_is_located_where_it_is_received(pipecheck_world: Any) -> None:
    report = _failure(TwoProcessEngine("drop_skip_grad"), pipecheck_world(2))
    found = report.first_divergence
    assert found is not None
    # stage 1 sent the skip's gradient right by its own recording; stage 0 received another for 'embed'
    assert (found.stage, found.direction, found.point, found.value) == (0, "backward", "grad received", "embed")
    assert found.microbatches == (0, 1, 2, 3)


def test_values_recorded_out_of_pipecheck_s_order_are_named_as_swapped(pipecheck_world: Any) -> None:
    report = _failure(TwoProcessEngine("scale_mb2", "inputs_out_of_order"), pipecheck_world(2))
    found = report.first_divergence
    assert found is not None and (found.stage, found.point, found.value) == (1, "received", "block_1")
    assert "what was recorded as 'block_1' is the reference's 'embed': the engine swapped them" in report.located


def test_a_rank_s_recording_of_another_shape_is_said_in_full(pipecheck_world: Any) -> None:
    report = _failure(TwoProcessEngine("scale_mb2", "whole_batch"), pipecheck_world(2))
    assert report.first_divergence is None
    assert report.located.startswith("the divergence was not located: rank 0's recording does not fit pipecheck's "
                                     "split: stage 0's inputs for micro-batch 0: position 0 'x' has shape (8, 16) "
                                     "where pipecheck's split has (2, 16)")
    assert "  0: 'x' (a model input), shape (2, 16) for micro-batch 0" in report.located  # the positions, listed


def test_a_recording_of_another_shape_in_the_check_s_process_is_said_in_full() -> None:
    def whole_batch(job: pc.Job) -> pc.StepResult:  # wrong (outputs scaled), and records the whole batch as mb 0
        model = job.build_model()
        out = model(*job.args) * 1.01
        loss = job.loss_fn(out, job.target)
        loss.backward()
        recorder = job.recorder(0)
        recorder.inputs(0, job.args[0])
        return pc.StepResult(out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                             boundaries=job.recorded([recorder]))

    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(SkipNet, (torch.randn(8, 16),), split_spec=CUT, n_microbatches=4, runner=whole_batch)
    assert caught.value.report.located.startswith(
        "the divergence was not located: the runner's recording does not fit pipecheck's split: stage 0's inputs "
        "for micro-batch 0: position 0 'x' has shape (8, 16) where pipecheck's split has (2, 16)")


def _random_check(engine: TwoProcessEngine, world: Any) -> pc.Report:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    return pc.assert_equivalent(DropSkipNet, (x,), split_spec=RANDOM_CUT, n_microbatches=4, runner=engine,
                                world=world, steps=2)


def test_an_engine_in_its_own_processes_follows_the_randomness_contract(pipecheck_world: Any) -> None:
    """Its ranks call pc.randomness.drawing around their own modules (not pipecheck's split): its dropout
    masks are eager's, step after step."""
    report = _random_check(TwoProcessEngine(), pipecheck_world(2))
    assert report.ok and "2 random ops drawn by pipecheck's randomness contract" in report.headline()


def test_an_engine_in_its_own_processes_drawing_the_next_microbatch_s_numbers_fails_where_it_draws(
        pipecheck_world: Any) -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _random_check(TwoProcessEngine("draws_next_mb"), pipecheck_world(2))
    report = caught.value.report
    assert not report.row("step 0: output").ok
    found = report.first_divergence
    assert found is not None and (found.stage, found.direction, found.optimizer_step) == (0, "forward", 0), \
        report.located


def test_a_bug_in_a_later_optimizer_step_is_located_there_from_the_engine_s_own_recording(pipecheck_world: Any) -> None:
    """Recorded micro-batches are numbered across a training check's run (step 1's j-th is n + j)."""
    torch.manual_seed(0)
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(SkipNet, (torch.randn(8, 16),), split_spec=CUT, n_microbatches=4,
                             runner=TwoProcessEngine("scale_mb2_at_step1"), world=pipecheck_world(2), steps=2)
    report = caught.value.report
    assert report.row("step 0: output").ok and not report.row("step 1: output").ok
    found = report.first_divergence
    assert found is not None, report.located
    assert (found.optimizer_step, found.stage, found.direction, found.point) == (1, 1, "forward", "sent"), \
        report.located
