"""``job.recorder(stage)``: an engine's stage values named by position in pipecheck's terms, checked for
count, micro-batch and shape, carried to another process and back, and hooked onto a module with ``watch``."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing
import torch.nn as nn
from _recording_engine import CUT, SkipNet, StageOne, watched_stage_one

import pipecheck as pc

MB = 4


def _job(recording: bool = False) -> pc.Job:
    torch.manual_seed(0)
    job = pc.Job(SkipNet, (torch.randn(8, 16),), split_spec=CUT, n_microbatches=MB)
    if recording:  # as the check's second run has it: the reference's shapes
        job.boundaries = pc.Boundaries(shapes={
            (stage, mb, point, name): (2, 16) for mb in range(MB) for stage, point, name in [
                (0, "received", "x"), (0, "sent", "embed"), (0, "sent", "block_1"), (1, "received", "block_1"),
                (1, "received", "embed"), (1, "grad sent", "block_1"), (1, "grad sent", "embed")]}
            | {(1, mb, "sent", "output"): (2, 4) for mb in range(MB)})
    return job


def test_a_recorder_lists_its_stage_s_positions_with_pipecheck_s_names() -> None:
    job = _job()
    assert str(job.recorder(0)) == """\
StageRecorder of stage 0 of 2, 4 micro-batches (not recording: the check records on its second run, after a failure)
  inputs, in pipecheck's order (recorder.inputs and recorder.input_grads take them so):
    0: 'x' (a model input)
  outputs, in pipecheck's order (recorder.outputs and recorder.output_grads take them so):
    0: 'embed' (to stage 1)
    1: 'block_1' (to stage 1)"""
    assert [src.name for src in job.structure().stages[1].inputs] == ["block_1", "embed"]
    assert "    0: 'block_1' (from stage 0)\n    1: 'embed' (from stage 0)\n" in str(job.recorder(1))
    assert repr(job.recorder(1)) == "<StageRecorder stage 1 of 2: 2 inputs, 1 output, inactive>"


def test_a_recorder_records_only_while_the_check_records() -> None:
    idle = _job().recorder(1)
    idle.inputs(0, torch.zeros(2, 16), torch.zeros(2, 16))
    assert not idle.active and idle.exported() == {} and idle.watch(nn.Linear(2, 2)) == []
    with pytest.raises(pc.RecordingError, match="1 value given"):  # a count is checked on every run
        idle.inputs(0, torch.zeros(2, 16))


def test_values_are_named_by_position_and_travel_back_pickled() -> None:
    job = _job(recording=True)
    first, second = job.recorder(0), job.recorder(1)
    y, h = torch.randn(2, 16), torch.randn(2, 16)
    second.inputs(3, y, h)
    second.input_grads(3, y * 2, None)  # None: no gradient recorded for 'embed'
    second.outputs(3, torch.ones(2, 4))
    first.outputs(1, h, (y, y + 1))  # a nested value: its leaves are name[0], name[1]
    back = [pickle.loads(pickle.dumps(rec)) for rec in (first, second)]
    recorded = job.recorded(back)
    assert sorted(recorded) == sorted([(1, 3, "received", "block_1"), (1, 3, "received", "embed"),
                                       (1, 3, "grad sent", "block_1"), (1, 3, "sent", "output"),
                                       (0, 1, "sent", "embed"), (0, 1, "sent", "block_1[0]"),
                                       (0, 1, "sent", "block_1[1]")])
    assert torch.equal(recorded[(1, 3, "received", "embed")], h)
    assert torch.equal(recorded[(0, 1, "sent", "block_1[1]")], y + 1)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"h": h, "logits": self.b(h)}


class TwoHeadsLast(nn.Module):
    """TwoHeads's stage 1 as an engine holds it: it returns the model's output, a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": h, "logits": self.b(h)}


def test_the_last_stage_takes_the_model_s_output_whole_or_as_its_leaves() -> None:
    job = pc.Job(TwoHeads, (torch.randn(4, 4),), split_spec={"b": pc.SplitPoint.BEGINNING}, n_microbatches=2,
                 boundaries=pc.Boundaries())
    last = job.recorder(1)
    names = [slot.name for slot in last.output_slots]
    assert names == ["output['h']", "output['logits']"]
    whole, leaves = {"h": torch.zeros(2, 4), "logits": torch.ones(2, 2)}, (torch.zeros(2, 4), torch.ones(2, 2))
    last.outputs(0, whole)
    last.outputs(1, *leaves)
    assert sorted(key[1:] for key in last.exported()) == [(0, "sent", name) for name in names] + [
        (1, "sent", name) for name in names]


def _call(method: str, *args: Any) -> Callable[[pc.StageRecorder], Any]:
    return lambda rec: getattr(rec, method)(*args)


Z = torch.zeros(2, 16)
BAD_CALLS = [  # (stage, call, what the message says)
    pytest.param(1, _call("inputs", 0, Z), ["stage 1's inputs for micro-batch 0: 1 value given, but pipecheck's split "
                                             "has 2 values there", "  0: 'block_1' (from stage 0), shape (2, 16)",
                                             "  1: 'embed' (from stage 0)", "Fix: call recorder.inputs(mb, ...) with "
                                             "one value per position, in this order"], id="too-few-inputs"),
    pytest.param(0, _call("outputs", 2, Z, Z, Z), ["stage 0's outputs for micro-batch 2: 3 values given",
                                                   "  1: 'block_1' (to stage 1)"], id="too-many-outputs"),
    pytest.param(1, _call("input_grads", 0, Z), ["stage 1's input gradients for micro-batch 0: 1 value given",
                                                 "None for a gradient the stage has not"], id="a-gradient-left-out"),
    pytest.param(1, _call("outputs", 0, Z, Z), ["stage 1's outputs for micro-batch 0: 2 values given",
                                                "or the model's output as one value, flattened to 1 leaves"],
                 id="last-stage-outputs"),
    pytest.param(0, _call("inputs", 4, Z), ["stage 0's recorder.inputs(microbatch=4, ...): the job runs 4 "
                                            "micro-batches, 0 to 3"], id="microbatch-out-of-range"),
    pytest.param(0, _call("outputs", True, Z, Z), ["recorder.outputs(microbatch=True"], id="microbatch-a-bool"),
    pytest.param(1, _call("inputs", 0, torch.zeros(4, 16), Z), [
        "stage 1's inputs for micro-batch 0: position 0 'block_1' has shape (4, 16) where pipecheck's split has "
        "(2, 16).", "each the value of micro-batch 0 alone (pc.split_microbatches"], id="a-whole-batch"),
    pytest.param(1, _call("outputs", 0, torch.zeros(2, 16)), [
        "position 0 'output' has shape (2, 16) where pipecheck's split has (2, 4)"], id="an-output-of-another-shape"),
    pytest.param(1, _call("input_grads", 0, torch.zeros(2, 8), None), [
        "stage 1's input gradients for micro-batch 0: position 0 'block_1' has shape (2, 8)"],
        id="a-gradient-of-another-shape"),
]


@pytest.mark.parametrize("stage,call,said", BAD_CALLS)
def test_a_recording_that_does_not_fit_the_split_is_refused_with_its_positions(
        stage: int, call: Callable[[pc.StageRecorder], Any], said: list[str]) -> None:
    recorder = _job(recording=True).recorder(stage)
    with pytest.raises(pc.RecordingError) as caught:
        call(recorder)
    for words in said:
        assert words in str(caught.value)
    assert recorder.exported() == {}  # nothing of a refused call is kept


def test_values_of_swapped_shapes_are_said_to_be_out_of_order() -> None:
    job = _job(recording=True)
    job.boundaries.shapes[(1, 0, "received", "embed")] = (2, 8)  # type: ignore[union-attr]
    with pytest.raises(pc.RecordingError, match="the values are not in pipecheck's order"):
        job.recorder(1).inputs(0, torch.zeros(2, 8), torch.zeros(2, 16))


@pytest.mark.parametrize("stage", [2, -1, True, "1"])
def test_a_stage_the_split_does_not_have_is_refused(stage: Any) -> None:
    with pytest.raises(pc.RecordingError, match=r"pipecheck's split of this job has 2 stages, 0 to 1"):
        _job().recorder(stage)


def test_recorded_takes_recorders_only() -> None:
    job = _job(recording=True)
    with pytest.raises(pc.RecordingError, match="job.recorded\\(\\) takes the StageRecorders .* got dict"):
        job.recorded([job.recorder(0).exported()])  # type: ignore[list-item]


def test_watch_records_a_module_in_another_process_forward_and_backward() -> None:
    job = _job(recording=True)
    torch.manual_seed(1)
    inputs = [(torch.randn(2, 16), torch.randn(2, 16)) for _ in range(MB)]
    spawn = torch.multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    worker = spawn.Process(target=watched_stage_one, args=(job.recorder(1), inputs, queue), daemon=True)
    worker.start()
    try:
        recorder = pickle.loads(queue.get(timeout=120))
    finally:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert worker.exitcode == 0
    recorded = job.recorded([recorder])
    torch.manual_seed(0)  # the worker's module, here
    module = StageOne(SkipNet())
    for mb, (y, h) in enumerate(inputs):
        y, h = y.clone().requires_grad_(), h.clone().requires_grad_()
        out = module(y, h)
        out.sum().backward()
        expected = {"received": {"block_1": y, "embed": h}, "sent": {"output": out},
                    "grad received": {"output": torch.ones(2, 4)}, "grad sent": {"block_1": y.grad, "embed": h.grad}}
        for point, values in expected.items():
            for name, value in values.items():
                assert torch.equal(recorded.pop((1, mb, point, name)), value.detach()), (mb, point, name)
    assert recorded == {}


def test_a_watched_module_called_otherwise_than_the_split_is_refused() -> None:
    recorder = _job(recording=True).recorder(1)
    module = StageOne(SkipNet())
    recorder.watch(module)
    with pytest.raises(pc.RecordingError, match="called with keyword arguments \\['h'\\]"):
        module(Z, h=Z)
    with pytest.raises(pc.RecordingError, match="stage 1's inputs for micro-batch 0: 3 values given"):
        nn.Module.__call__(module, Z, Z, Z)


def test_a_watched_last_stage_may_return_the_model_s_output_whole() -> None:
    job = pc.Job(TwoHeads, (torch.randn(4, 4),), split_spec={"b": pc.SplitPoint.BEGINNING}, n_microbatches=2,
                 boundaries=pc.Boundaries())
    recorder, module = job.recorder(1), TwoHeadsLast()
    assert [src.name for src in job.structure().stages[1].inputs] == ["a"]
    recorder.watch(module)
    for _ in range(2):
        out = module(torch.randn(2, 4, requires_grad=True))
        assert sorted(out) == ["h", "logits"]  # the engine gets its own structure back
        (out["h"].sum() + 2 * out["logits"].sum()).backward()
    recorded = recorder.exported()
    assert {key[1:3] for key in recorded} == {(mb, point) for mb in range(2)
                                              for point in ("received", "sent", "grad received", "grad sent")}
    assert torch.equal(recorded[(1, 1, "grad received", "output['logits']")], torch.full((2, 2), 2.0))
