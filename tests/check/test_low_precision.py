"""A check in bfloat16 or float16 certifies a correct pipeline and still catches small bugs: "auto" is
anchored on eager in the check's dtype while the runner's forward is bit for bit eager's, each tensor's
tolerance measured from legitimate re-orderings of the same math (pipecheck._check.anchor)."""

from __future__ import annotations

import dataclasses
from typing import Any

import _odd_models
import pytest
import torch
from mutants.low_precision import BUGS, CORRECT, summed_in_bfloat16
from pipecheck.fixtures import get

import pipecheck as pc
import pipecheck._check.anchor as anchor
from pipecheck._check.numerics import EagerAnchored, Noise, compare

# private: the reference runner's function, wrapped to plant bugs
from pipecheck._runners.base import run_reference

LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _zoo(name: str, runner: Any, dtype: torch.dtype = torch.bfloat16, n: int = 4, **options: Any) -> pc.Report:
    entry = get(name)
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory(style), args, kwargs, runner=runner, dtype=dtype, n_microbatches=n,
                                loss_fn=entry.loss_fn, target=entry.target(), **entry.cut(style), **options)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("runner", list(CORRECT))
@pytest.mark.parametrize("name", ["skip_one", "tiny_gpt", "encoder_decoder", "running_stats"])
def test_a_correct_runner_is_certified_in_low_precision_and_says_what_it_can_see(
        name: str, runner: str, dtype: torch.dtype) -> None:
    for seed in (0, 1):
        report = _zoo(name, CORRECT[runner], dtype, seed=seed)
        named = str(dtype).removeprefix("torch.")
        assert report.ok and not report.blind and report.tolerance == f"auto, anchored on eager {named}"
        power, norm = report.power, report.norm_power
        assert power is not None and norm is not None
        # in the check's own terms: bfloat16's epsilon is 2**-7, float16's 2**-10
        eps = torch.finfo(dtype).eps
        assert 2 * eps < power < 12 * eps and eps / 2 <= norm < 6 * eps
        assert "on every element, >= " in report.headline() and "as a norm" in report.headline()


@pytest.mark.parametrize("n", [1, 4])
def test_four_stages_and_one_microbatch_in_bfloat16_is_certified(n: int) -> None:
    report = _zoo("long_skip", "reference", n=n)  # nothing to reorder across micro-batches: still certified
    assert report.ok and report.norm_power is not None


BUG_MODELS = {
    "all grads x0.9": ["mlp", "encoder_decoder", "tiny_gpt"],
    "stage 0 x0.9": ["skip_one", "encoder_decoder", "tiny_gpt"],
    "micro-batch 1 dropped": ["mlp", "long_skip", "titan_lm"],
    "tied share missing": ["tiny_gpt", "alias_reuse", "titan_lm"],
    "outputs of mb 0, 1 swapped": ["mlp", "dict_outputs"],
}


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize(("bug", "name"), [(bug, name) for bug, names in BUG_MODELS.items() for name in names])
def test_a_planted_bug_is_caught_in_bfloat16(bug: str, name: str, n: int) -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _zoo(name, BUGS[bug], n=n)
    assert caught.value.report.failures


def test_a_gradient_off_by_a_hundredth_is_named_in_float16() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _zoo("tiny_gpt", BUGS["stage 0 x0.99"], torch.float16)  # float16 sees 1%: its epsilon is 8x smaller
    assert {row.name for row in caught.value.report.failures} >= {"grad pos_emb"}


def _forward_off_by_an_ulp(job: pc.Job) -> pc.StepResult:
    """A correct runner whose kernels round the outputs differently (one ulp up)."""
    result = run_reference(job)
    up = result.outputs.nextafter(torch.full_like(result.outputs, float("inf")))
    return dataclasses.replace(result, outputs=up)


def test_a_forward_that_is_not_eagers_bit_for_bit_falls_back_on_float64_and_says_so() -> None:
    report = _zoo("mlp", _forward_off_by_an_ulp)  # mlp in bfloat16: float64 can anchor it
    assert report.tolerance == "auto" and report.norm_power is None
    assert any("not bit for bit eager's (output differs in 32 elements of 32)" in note for note in report.notes)
    with pytest.raises(pc.PowerError) as refused:  # tiny_gpt: float64 is too far from eager, refused as before
        _zoo("tiny_gpt", _forward_off_by_an_ulp)
    assert "anchored on float64" in str(refused.value) and "not bit for bit eager's" in str(refused.value)


def test_a_bug_in_the_references_reordering_never_widens_a_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference whose reversed sums lose a tenth of stage 0's gradients would widen every stage-0
    tolerance to 10% and let the same bug in a runner pass: its float64 run vouches against it."""
    step = anchor.DetachExecutor.step

    def buggy(self: Any, *args: Any, **kwargs: Any) -> pc.StepResult:
        result = step(self, *args, **kwargs)
        if self.accumulation.reverse:
            stage0 = set(self.pipe.stages[0].local_to_fqn.values())
            result.grads = {fqn: g * 0.9 if fqn in stage0 else g for fqn, g in result.grads.items()}
        return result

    monkeypatch.setattr(anchor.DetachExecutor, "step", buggy)
    with pytest.raises(pc.EquivalenceError) as caught:
        _zoo("skip_one", BUGS["stage 0 x0.9"])
    assert any("reference runner in float64 is off the float64 truth on grad a.fc.bias, grad a.fc.weight" in note
               for note in caught.value.report.notes)
    assert _zoo("skip_one", "reference").ok  # and a correct runner still passes


def test_the_eager_anchored_rule_in_numbers() -> None:
    eager = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    noise = EagerAnchored({"grad w": Noise(largest=0.01, norm=0.02)}, "bfloat16")
    truth = eager.double()
    bound = 2 * 0.01 + eps * 4.0  # plus 2 eps |eager| per element
    just_in = eager.double() + torch.tensor([bound + 2 * eps * 1.0 - 1e-6, 0, 0, 0], dtype=torch.float64)
    row = compare("grad w", just_in, eager, truth, noise)
    assert row.ok and row.tolerance.startswith("eager: atol 5.1e-02 rtol 1.6e-02, norm 4.4e-02")
    assert row.power == pytest.approx(bound / 4.0 + 2 * eps) and row.norm_bound == pytest.approx(2 * 0.02 + eps / 2)
    out = eager.double() + torch.tensor([bound + 2 * eps * 1.0 + 1e-3, 0, 0, 0], dtype=torch.float64)
    assert not compare("grad w", out, eager, truth, noise).ok
    quiet = EagerAnchored({"grad w": Noise(largest=0.01, norm=0.001)}, "bfloat16")
    spread = eager.double() * (1 + 0.008)  # every element 0.8% off: inside each element's bound, not as a norm
    row = compare("grad w", spread, eager, truth, quiet)
    assert not row.ok and row.n_failing == 0 and row.norm_error == pytest.approx(0.008)
    assert "norm off 8.0e-03 > 5.9e-03" in pc.Report("r", [row]).table()
    assert compare("grad w (replica in stage 1)", spread, eager, truth, quiet).norm_bound == row.norm_bound


FLOAT32_SUMS = pc.Precision(torch.bfloat16, grad_accumulation=torch.float32)
AUTOCAST = pc.Precision(autocast=torch.bfloat16)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "encoder_decoder"])
def test_gradients_summed_in_float32_certify_a_main_grad_engine_and_catch_bfloat16_sums(name: str, n: int) -> None:
    report = _zoo(name, "reference", None, n, precision=FLOAT32_SUMS)
    assert report.ok
    assert "bfloat16 (gradients accumulated in float32)" in report.headline()
    grads = [row for row in report.rows if row.kind == "grads"]
    assert grads and all(row.norm_bound is not None and row.norm_bound < 0.03 for row in grads)
    with pytest.raises(pc.EquivalenceError) as caught:
        _zoo(name, summed_in_bfloat16, None, n, precision=FLOAT32_SUMS)
    assert any(row.kind == "grads" for row in caught.value.report.failures)


def test_the_distributed_runtime_follows_the_precision_setting(pipecheck_world: Any) -> None:
    world = pipecheck_world(4)
    for precision in (FLOAT32_SUMS, AUTOCAST):
        report = _zoo("tiny_gpt", "distributed", None, 4, precision=precision, world=world)
        assert report.ok and report.tolerance.startswith("auto, anchored on eager bfloat16")
    assert "under autocast" in report.tolerance


def test_autocast_over_float32_weights_is_checked_as_eager_runs_it() -> None:
    report = _zoo("encoder_decoder", "reference", None, 4, precision=AUTOCAST)
    assert report.ok and report.dtype == "bfloat16" and "(autocast bfloat16)" in report.headline()
    grads = [row for row in report.rows if row.kind == "grads"]
    assert grads and all(row.norm_bound is not None for row in grads)


@pytest.mark.parametrize(("settings", "message"), [
    ({"precision": pc.Precision(torch.bfloat16), "dtype": torch.float16}, "disagree. Fix: give the dtype once"),
    ({"precision": "bf16"}, "is not a pc.Precision"),
    ({"precision": FLOAT32_SUMS, "runner": "torch"}, "runner 'torch' does not say it runs as pc.Precision"),
    ({"precision": FLOAT32_SUMS, "steps": 2, "optimizer": torch.optim.SGD},
     "is checked one step at a time for now"),
], ids=["dtype twice", "not a Precision", "torch runner", "training"])
def test_a_precision_the_check_cannot_honour_is_refused_with_the_fix(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(pc.InputError, match=message):
        _zoo("mlp", settings.pop("runner", "reference"), settings.pop("dtype", None), 4, **settings)


@pytest.mark.parametrize(("bad", "message"), [
    ({"dtype": torch.int32}, r"dtype=torch.int32 is not a floating-point torch.dtype. Fix: "),
    ({"grad_accumulation": "fp32"}, r"pc.Precision\(grad_accumulation='fp32'\): .* Fix: e.g. pc.Precision"),
    ({"autocast": torch.float32}, r"pc.Precision\(autocast=torch.float32\): .* Fix: e.g. pc.Precision"),
], ids=["dtype", "grad_accumulation", "autocast"])
def test_a_bad_precision_names_the_value_and_the_fix(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(pc.InputError, match=message):
        pc.Precision(**bad)


@pytest.mark.gpu(n=1)
def test_a_bfloat16_check_on_a_gpu_is_anchored_on_eager_and_still_catches() -> None:
    """On CUDA the reference's and the runtime's bfloat16 forwards are eager's bit for bit (the same kernels
    on the same micro-batch shapes), so the check anchors on eager there too; a planted bug is caught."""
    for name in ("tiny_gpt", "encoder_decoder"):
        report = _zoo(name, "reference", device="cuda")
        assert report.ok and report.tolerance == "auto, anchored on eager bfloat16", report.notes
    with pytest.raises(pc.EquivalenceError):
        _zoo("tiny_gpt", BUGS["stage 0 x0.9"], device="cuda")
    with pc.World(4, device="cuda") as world:
        report = _zoo("tiny_gpt", "distributed", device="cuda", world=world)
        assert report.ok and report.tolerance == "auto, anchored on eager bfloat16", report.notes
        assert _zoo("mlp", "distributed", None, 4, device="cuda", world=world, precision=FLOAT32_SUMS).ok


@pytest.mark.parametrize("runner", ["reference", "torch"])
def test_three_microbatches_divided_after_summing_is_a_legitimate_order(runner: str, pipecheck_world: Any) -> None:
    """torch's pipelining sums the micro-batches' unscaled gradients and divides by their count at the
    end (scale_grads): with 3 micro-batches (1/3 is not exact) its bfloat16 gradients round otherwise
    than eager's loss / 3 (a false alarm before that order was measured). An empty buffer compares as empty."""
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(0))
    for seed in (0, 1):
        report = pc.assert_equivalent(_odd_models.LayerNormStack, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING},
                                      n_microbatches=3, runner=runner, dtype=torch.bfloat16, seed=seed,
                                      world=pipecheck_world(2) if runner == "torch" else None)
        assert report.ok and report.tolerance == "auto, anchored on eager bfloat16"


def test_a_loss_summed_as_deepspeed_sums_it_is_compared_with_that_sum_not_widened() -> None:
    """DeepSpeed adds the micro-batches' bfloat16 losses one by one, then divides: an ulp off eager's mean.
    Its bits show it is that sum, and its row is compared with it; a wider tolerance from the ulp made
    this cancelling loss (0.004, eager 11% off float64) blind, and refused a correct engine."""
    report = _zoo("nested_spec", CORRECT["summed last first"], seed=2)
    assert report.ok and not report.blind and report.row("loss").max_abs == 0.0
    assert "the runner's loss is eager's micro-batch losses added one by one, then divided" in report.notes[0]


def test_float16_gradients_that_underflow_are_refused_with_loss_scaling_as_the_fix() -> None:
    """BERT's query and key gradients are ~3e-6 in float16, below its smallest normal number: subnormal
    rounding steps, 10-18% off float64, which no tolerance can certify. The refusal names underflow and
    loss scaling, and a loss scaled by 1024 (a GradScaler's job) is certified."""
    pytest.importorskip("transformers")
    entry = get("hf_bert")
    args, kwargs = entry.inputs()
    labels = torch.randint(0, 128, args[0].shape, generator=torch.Generator().manual_seed(3))

    def check(scale: float) -> pc.Report:
        def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
            logits = out.logits.reshape(-1, out.logits.shape[-1]).float()
            return torch.nn.functional.cross_entropy(logits, target.reshape(-1)) * scale
        return pc.assert_equivalent(entry.factory("spec"), args, kwargs, runner="reference", dtype=torch.float16,
                                    n_microbatches=4, loss_fn=loss, target=labels, **entry.cut("spec"))

    with pytest.raises(pc.PowerError, match="lose bits to underflow: scale the loss"):
        check(1.0)
    assert check(1024.0).ok
