"""Where a failing check went wrong: the first divergent boundary value (stage, micro-batch, forward or
backward), which micro-batches of an output fail, and hints fitted from the micro-batches' own gradients."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from mutants.runners import MUTANTS, BaseRunner, check
from pipecheck.fixtures import get

import pipecheck as pc
from pipecheck import merge_microbatches

# private: boundary recording and first_divergence are the runtime's; the locating step is under test
from pipecheck._check.diagnose import microbatch_weights, weights_hint
from pipecheck._runtime.boundaries import instrument


class SendWrongAfterFirst(BaseRunner):
    """Stage 1's activations are corrupted from micro-batch 1 on (a buffer index off after the first)."""

    name = "send_wrong_after_first"

    def send(self, value: Any, src: int, name: str, dst: int, mb: int) -> Any:
        return value * 1.5 if mb > 0 and dst == 1 and isinstance(value, torch.Tensor) else value


class MergeFirstTwice(BaseRunner):
    name = "merge_first_twice"

    def merge(self, outputs: list[Any]) -> Any:
        return merge_microbatches([outputs[0], outputs[0], *outputs[2:]])


def _failure(runner: BaseRunner, model: str = "mlp") -> pc.Report:
    with pytest.raises(pc.EquivalenceError) as caught:
        check(runner, model)
    return caught.value.report


def test_the_first_divergence_names_stage_microbatches_and_direction_as_data_and_text() -> None:
    report = _failure(SendWrongAfterFirst())
    found = report.first_divergence
    assert isinstance(found, pc.Divergence)
    assert (found.stage, found.direction, found.point, found.producer) == (1, "forward", "received", 0)
    assert (found.microbatches, found.matching, found.missing) == ((1, 2, 3), (0,), ())
    assert found.value == "layers_0_norm" and 0 < found.relative < float("inf")
    assert report.located.startswith("first divergence: stage 1 received 'layers_0_norm' (from stage 0) in the "
                                     "forward: micro-batches 1, 2, 3 differ; micro-batch 0 matches, max abs error")


def test_a_failing_output_row_says_which_microbatches_fail() -> None:
    report = _failure(SendWrongAfterFirst())
    row = report.row("output")
    assert row.failing_microbatches == (1, 2, 3)
    assert "in mb 1,2,3" in report.failure_text()
    assert report.row("loss").failing_microbatches is None


def test_an_output_repeated_from_another_microbatch_is_named() -> None:
    report = _failure(MergeFirstTwice())
    assert report.row("output").failing_microbatches == (1,)
    assert "outputs of one micro-batch repeated: merged position <- micro-batch: 1<-0" in report.hints["output"]
    assert "merges the micro-batches' outputs" in report.located


def test_the_runtime_records_on_its_ranks_and_the_driver_locates_the_stage() -> None:
    import _odd_models

    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(_odd_models.WrongOnRank1, (torch.randn(8, 4),), split_spec={"b": pc.SplitPoint.BEGINNING},
                             n_microbatches=2, runner="distributed", tracer="fx")
    found = caught.value.report.first_divergence
    assert found is not None
    assert (found.stage, found.point, found.value, found.microbatches) == (1, "sent", "output", (0, 1))
    assert str(caught.value).splitlines()[1].startswith("first divergence: stage 1 sent 'output' in the forward")


needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason='needs DeepSpeed: pip install "torch-pipecheck[deepspeed]"')
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                      reason='needs torchtitan: pip install "torch-pipecheck[torchtitan]"')


def _engine_failure(check_it: Any) -> tuple[pc.Report, str]:
    with pytest.raises(pc.EquivalenceError) as caught:
        check_it()
    return caught.value.report, str(caught.value).splitlines()[1]


@needs_deepspeed
def test_deepspeed_ranks_record_pipecheck_s_stage_modules(pipecheck_world: Any) -> None:
    import _odd_models

    report, line = _engine_failure(lambda: pc.assert_equivalent(
        _odd_models.WrongOnRank1, (torch.randn(8, 4),), split_spec={"b": pc.SplitPoint.BEGINNING}, n_microbatches=2,
        runner="deepspeed", tracer="fx", world=pipecheck_world(2)))
    found = report.first_divergence
    assert found is not None
    assert (found.stage, found.point, found.value, found.microbatches) == (1, "sent", "output", (0, 1))
    assert line.startswith("first divergence: stage 1 sent 'output' in the forward: micro-batches 0, 1 differ")


@needs_deepspeed
def test_a_deepspeed_layer_list_is_lined_up_with_its_own_stages_run_in_one_process(pipecheck_world: Any) -> None:
    import _odd_models
    from deepspeed.pipe import LayerSpec

    layers = [nn.Linear(4, 4), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 4, 4), LayerSpec(_odd_models.PlusOneOnRank1)]
    report, line = _engine_failure(lambda: pc.engines.deepspeed.check(
        layers, torch.randn(8, 4), num_stages=2, n_microbatches=4, partition_method="uniform",
        world=pipecheck_world(2)))
    found = report.first_divergence
    assert found is not None
    assert (found.stage, found.point, found.value, found.microbatches) == (1, "sent", "output", (0, 1, 2, 3))
    assert line.startswith("first divergence: stage 1 sent 'output' in the forward")


@needs_torchtitan
def test_torchtitan_is_lined_up_with_its_own_stage_modules_run_in_one_process(pipecheck_world: Any) -> None:
    import _odd_models

    report, line = _engine_failure(lambda: pc.assert_equivalent(
        _odd_models.TitanWrongOnRank1, (torch.randn(8, 4),), split_spec={"layers.1": pc.SplitPoint.BEGINNING},
        n_microbatches=2, runner="torchtitan", world=pipecheck_world(2)))
    found = report.first_divergence
    assert found is not None
    assert (found.stage, found.point, found.value, found.microbatches) == (1, "sent", "output", (0, 1))
    # stage 1 received stage 0's output right: the values are lined up across the boundary
    assert line.startswith("first divergence: stage 1 sent 'output' in the forward: micro-batches 0, 1 differ")


def test_a_passing_check_records_nothing() -> None:
    report = check(BaseRunner(), "mlp")
    assert report.first_divergence is None and report.located == "" and "locate_s" not in report.timings


def test_a_runner_that_records_nothing_is_said_to() -> None:
    def own_modules(job: pc.Job) -> pc.StepResult:  # runs the model itself: no split, no boundary values
        model = job.build_model()
        out = model(*job.args) * 2
        loss = job.loss_fn(out, job.target)
        loss.backward()
        return pc.StepResult(out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()})

    entry = get("mlp")
    args, _ = entry.inputs()
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(entry.factory(), args, runner=own_modules, **entry.cut(entry.cut_styles[0]))
    assert "the runner recorded no boundary values" in caught.value.report.located


def test_an_engine_records_values_of_its_own_modules_with_one_call() -> None:
    base = BaseRunner()

    def recording(job: pc.Job) -> pc.StepResult:
        boundaries, job.boundaries = job.boundaries, None  # its own modules: nothing instrumented
        result = MUTANTS["skip_wrong_microbatch"](job)
        if boundaries is not None:  # the check's second run: record by hand what the stage received
            truth = pc.Boundaries()
            base(pc.Job(**{**job.__dict__, "boundaries": truth}))
            for (stage, mb, point, name), value in truth.values.items():
                boundaries.record(stage, mb, point, name, value + (point == "received" and stage == 2))
        return result

    entry = get("skip_one")
    args, kwargs = entry.inputs()
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(entry.factory(), args, kwargs, runner=recording, n_microbatches=4,
                             **entry.cut(entry.cut_styles[0]))
    found = caught.value.report.first_divergence
    assert found is not None and (found.stage, found.point) == (2, "received")


def test_recording_refuses_an_unknown_point() -> None:
    with pytest.raises(ValueError, match="point='forward'"):
        pc.Boundaries().record(0, 0, "forward", "x", torch.zeros(1))


def test_a_recomputed_forward_is_not_a_microbatch() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = pc.split(model, (torch.randn(2, 4),), split_spec={"2": pc.SplitPoint.BEGINNING})
    recorder = pc.Boundaries()
    instrument(pipe, recorder)
    first, second = pipe.stages
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        h = torch.utils.checkpoint.checkpoint(first.module, x, use_reentrant=False)[0]
        out = second.module(h)[0]
        out.sum().backward()
    assert recorder.forwards == {0: 3, 1: 3}  # three micro-batches each, not six forwards of stage 0
    assert {key[:3] for key in recorder.values if key[0] == 0} == {
        (0, mb, point) for mb in range(3) for point in ("received", "sent", "grad received", "grad sent")}


def test_instrumenting_changes_no_bit_of_the_step() -> None:
    entry = get("tiny_gpt")
    args, kwargs = entry.inputs()
    pipe = pc.split(entry.factory(entry.cut_styles[0]), args, kwargs, **entry.cut(entry.cut_styles[0]))
    plain = pc.DetachExecutor(pipe.__deepcopy__({})).step(args, kwargs, n_microbatches=4)
    instrumented = pipe.__deepcopy__({})
    instrument(instrumented, pc.Boundaries())
    recorded = pc.DetachExecutor(instrumented).step(args, kwargs, n_microbatches=4)
    assert torch.equal(plain.outputs, recorded.outputs)
    assert all(torch.equal(plain.grads[k], recorded.grads[k]) for k in plain.grads)



@pytest.mark.parametrize("weights,expected", [
    ([1, 1, 1, 1], None),
    ([0.5, 0.5, 0.5, 0.5], "every micro-batch's gradient is scaled by 0.5"),
    ([4, 4, 4, 4], None),  # n_microbatches times: the scaling hint says it
    ([0.5, 1, 1, 1], "micro-batch 0 weighted 0.5 (the first accumulation step)"),
    ([0, 0, 0, 1], "only the last micro-batch's gradient survives"),
    ([1, 0, 1, 2], "micro-batch 1 missing (never accumulated, or overwritten by a later one); micro-batch 3 counted twice"),
])
def test_weights_read_as_causes(weights: list[float], expected: str | None) -> None:
    hint = weights_hint(weights)
    assert hint == expected if expected is None else expected in (hint or "")


def test_weights_are_fitted_only_when_the_microbatches_can_be_told_apart() -> None:
    torch.manual_seed(0)
    shares = [torch.randn(6, 5) for _ in range(4)]
    test = 0.5 * shares[0] + shares[1] + shares[2] + shares[3]
    assert microbatch_weights(test, shares) == pytest.approx([0.5, 1, 1, 1], abs=1e-5)
    assert microbatch_weights(test, [shares[0]] * 4) is None  # alike: any split of weights fits
    assert microbatch_weights(test + torch.randn(6, 5), shares) is None  # no close fit
    assert microbatch_weights(torch.ones(3), [torch.ones(3)] * 4) is None  # fewer elements than weights


def test_torch_s_tied_embedding_is_located_in_its_gradient_handling_not_its_dataflow() -> None:
    entry = get("tiny_gpt")
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(entry.factory(style), args, kwargs, runner="torch", loss_fn=entry.loss_fn,
                             target=entry.target(), n_microbatches=4, **entry.cut(style))
    report = caught.value.report
    assert {row.name.split(" (")[0] for row in report.failures} == {"grad tok_emb.weight"}
    assert report.first_divergence is None
    # torch's boundary values, recorded on its ranks, match a run of torch's own split in this process
    # up to its gradient scaling (scale_grads divides the parameter gradients at the end)
    assert report.located.startswith("no boundary value diverges from runner 'torch''s own split run in one "
                                     "process (40 values")
    assert "every gradient crossing a stage is 4 times the reference's" in report.located
    assert "tied replicas" in report.located


def test_the_failing_microbatches_of_an_output_are_judged_under_the_row_s_own_tolerance() -> None:
    from pipecheck._check.numerics import compare

    truth = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1e-3, 1e-3], [5.0, 6.0]], dtype=torch.float64)
    eager = truth.float() + torch.tensor([[0.0, 0.0], [0.0, 0.0], [1e-4, 0.0], [0.0, 0.0]])  # eager's own error
    test = eager.clone()
    test[2, 1] += 0.5  # only micro-batch 1 (rows 2-3) is wrong
    row = compare("output", test, eager, truth, "auto", microbatches=2)
    assert not row.ok and row.failing_microbatches == (1,)


def test_a_weights_fit_that_only_absorbs_noise_is_no_hint() -> None:
    torch.manual_seed(0)
    shares = [torch.randn(64) for _ in range(4)]
    noisy = sum(shares) + 0.01 * torch.randn(64)  # a low-precision runner: right, up to noise
    assert microbatch_weights(noisy.to(torch.bfloat16), [s.to(torch.bfloat16) for s in shares]) is None


def test_a_runner_that_records_only_forwards_is_not_blamed_for_missing_gradients() -> None:
    from pipecheck._runtime.boundaries import first_divergence

    truth = {(0, 0, "sent", "h"): torch.ones(2), (0, 0, "grad received", "h"): torch.ones(2)}
    found, _ = first_divergence({(0, 0, "sent", "h"): torch.ones(2)}, truth, 1, 2, {})
    assert found is None


def test_a_received_value_of_another_dtype_says_so() -> None:
    from pipecheck._runtime.boundaries import first_divergence

    truth = {(1, 0, "received", "h"): torch.ones(2)}
    found, _ = first_divergence({(1, 0, "received", "h"): torch.ones(2, dtype=torch.bfloat16)}, truth, 1, 2,
                                {(1, "h"): 0})
    assert found is not None and "dtype bfloat16 where the reference has float32" in found.text()
