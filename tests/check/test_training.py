"""Training checks: several optimizer steps, accumulation, loss conventions, against planted bugs."""

from __future__ import annotations

import re

import _odd_models
import pytest
import torch
import torch.nn as nn
from _training_models import (
    GainBeforeBatchNorm,
    Trainer,
    WritesItsInput,
    adamw,
    lbfgs,
    make_dropout_net,
    make_frozen_lm,
    make_tied_lm,
    make_untied_lm,
    mean_ce,
    momentum,
    mse,
    sgd,
    token_ce,
    tokens,
)

import pipecheck as pc

LOOP = dict(n_microbatches=4, steps=3, accumulation_steps=2, optimizer=adamw, clip_grad_norm=0.5)


def _check(runner, model=make_tied_lm, **settings):  # type: ignore[no-untyped-def]
    x, y = tokens(pad=3)
    options = {**LOOP, "loss_fn": token_ce, "target": y, "loss_reduction": "token_mean", **settings}
    return pc.assert_equivalent(model, (x,), runner=runner, **options)


@pytest.mark.parametrize("data_parallel", [1, 2])
@pytest.mark.parametrize("runner", ["reference", Trainer()], ids=["reference", "users-engine"])
@pytest.mark.parametrize("reduction, loss_fn", [("token_mean", token_ce), ("mean", mean_ce), ("sum", mean_ce)])
def test_correct_engines_pass_every_step(runner, reduction, loss_fn, data_parallel) -> None:  # type: ignore[no-untyped-def]
    report = _check(runner, loss_reduction=reduction, loss_fn=loss_fn, data_parallel=data_parallel)
    assert report.ok
    names = [row.name for row in report.rows]
    assert "step 2: param emb.weight (replica in stage 1)" in names
    assert "step 2: grad l2.weight" in names and "step 0: output (schedule step 1 of 2)" in names
    assert "3 steps of adamw, gradients clipped to norm 0.5, 2 accumulation steps each" in report.headline()
    if data_parallel == 2:
        assert report.row("step 2: param emb.weight (dp rank 1, stage 1)").ok


def test_pp2_dp2_on_a_world_of_four(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    report = _check("distributed", world=pipecheck_world(4), data_parallel=2, steps=2)
    assert report.ok
    assert report.row("step 1: param emb.weight (dp rank 1, stage 1)").ok
    assert report.row("step 1: grad l2.bias (dp rank 1, stage 1)").ok


def test_data_parallel_asks_for_the_world_it_needs(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pc.InputError, match=re.escape("data_parallel=2 replicas of a pipeline of 2 ranks need 4 ranks, "
                                                      "but the World has 2")):
        _check("distributed", world=pipecheck_world(2), data_parallel=2)


@pytest.mark.parametrize("optimizer", [sgd, momentum, adamw])
def test_the_distributed_runtime_trains_like_eager(optimizer, pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    report = _check("distributed", optimizer=optimizer, world=pipecheck_world(2))
    assert report.ok
    assert report.row("step 2: param emb.weight (replica in stage 1)").ok


def test_the_distributed_runtime_takes_batches_of_other_shapes(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    batches = [pc.Batch((x,), target=y) for x, y in (tokens(8, 5, 1, 2), tokens(12, 7, 2, 3), tokens(4, 3, 3, 1),
                                                     tokens(8, 6, 4, 0))]
    report = pc.assert_equivalent(make_tied_lm, batches[0].args, loss_fn=token_ce, n_microbatches=4, runner="distributed",
                                  world=pipecheck_world(2), batches=batches, steps=2, accumulation_steps=2, optimizer=sgd,
                                  loss_reduction="token_mean")
    assert report.ok
    assert report.row("step 1: output (schedule step 0 of 2)").shape == (4, 3, 11)


@pytest.mark.parametrize("bug, first, hint", [
    ("grads_not_zeroed", "step 1: grad", "not zeroed between optimizer steps"),
    ("replica_not_stepped", "step 0: param emb.weight (replica in stage 1)", "does not update every replica"),
    ("mean_of_means", "step 0: loss", None),
    ("rescaled_each_step", "step 0: grad", "gradient scaling"),
    ("clip_counts_replicas", "step 0: param", "optimizer step differs"),
    ("clip_counts_replicas-adamw", "step 1: param", "optimizer step differs"),  # Adam's first step ignores scale
    ("dp_replica_not_reduced-dp", "step 0: grad l1.weight (dp rank 1, stage 0)", None),
    ("dp_not_averaged-dpmean", "step 0: loss", "not divided by data_parallel=2"),
    ("trains_frozen-frozen", "step 0: param l1.weight", "a frozen parameter (requires_grad=False) changed"),
])
def test_planted_training_bugs_are_caught_at_the_right_value(bug, first, hint) -> None:  # type: ignore[no-untyped-def]
    bug, _, variant = bug.partition("-")
    with pytest.raises(pc.EquivalenceError) as caught:
        _check(Trainer(bug), optimizer=adamw if variant == "adamw" else sgd, data_parallel=2 if "dp" in variant else 1,
               **({"loss_reduction": "mean", "loss_fn": mean_ce} if variant == "dpmean" else {}),
               **({"model": make_frozen_lm} if variant == "frozen" else {}))
    report = caught.value.report
    assert report.located.startswith("first divergence: optimizer step " + first.split(":")[0].split()[1])
    failing = [row.name for row in report.failures]
    assert any(name.startswith(first) for name in failing), failing
    if hint is not None:
        assert any(hint in text for text in report.hints.values()), report.hints


def test_a_mean_of_means_engine_passes_the_mean_convention_it_implements() -> None:
    """The same engine is right under "mean" (it is what it computes) and wrong under "token_mean"."""
    x, y = tokens(pad=3)
    report = pc.assert_equivalent(make_tied_lm, (x,), runner=Trainer("mean_of_means"), loss_fn=mean_ce, target=y,
                                  **{**LOOP, "loss_reduction": "mean"})
    assert report.ok


def test_one_step_runs_of_grads_not_zeroed_pass_and_two_fail() -> None:
    """The bug a one-step check cannot see: it needs a second step."""
    assert _check(Trainer("grads_not_zeroed"), steps=1).ok
    with pytest.raises(pc.EquivalenceError, match="not zeroed"):
        _check(Trainer("grads_not_zeroed"), steps=2, optimizer=None, clip_grad_norm=None)


def test_uneven_microbatches_are_checked_where_the_convention_weighs_tokens() -> None:
    x, y = tokens(batch=10, pad=2)
    report = pc.assert_equivalent(make_tied_lm, (x,), loss_fn=token_ce, target=y, n_microbatches=4,
                                  loss_reduction="token_mean", runner="reference")
    assert report.ok
    with pytest.raises(pc.InputError, match="not divisible by n_microbatches=4"):
        pc.assert_equivalent(make_tied_lm, (x,), loss_fn=mean_ce, target=y, n_microbatches=4, steps=2,
                             runner="reference")


def test_the_users_model_and_inputs_are_left_as_they_were() -> None:
    model = make_tied_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = tokens(pad=3)
    x0, y0 = x.clone(), y.clone()
    pc.assert_equivalent(model, (x,), loss_fn=token_ce, target=y, runner="reference", loss_reduction="token_mean",
                         **LOOP)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(x, x0) and torch.equal(y, y0)
    assert all(p.grad is None for p in model.parameters())


def _one_call(job):  # type: ignore[no-untyped-def]
    raise AssertionError("never called: refused before any work")


@pytest.mark.parametrize("settings, message", [
    ({"steps": 0}, "steps=0 must be a positive int"),
    ({"accumulation_steps": 1.5}, "accumulation_steps=1.5 must be a positive int"),
    ({"data_parallel": 0}, "data_parallel=0 must be a positive int"),
    ({"optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1)}, "an optimizer already built"),
    ({"optimizer": "adam"}, "is not a factory"),
    ({"clip_grad_norm": 1.0}, "clip_grad_norm was given without optimizer"),
    ({"optimizer": sgd, "clip_grad_norm": -1}, "must be a positive number"),
    ({"loss_reduction": "avg"}, "loss_reduction='avg' is not known"),
    ({"loss_reduction": "token_mean", "loss_fn": None, "target": None}, "needs loss_fn returning every token's loss"),
    ({"batches": [1, 2]}, "must be a non-empty list of pc.Batch (item 0 is int)"),
    ({"batches": [pc.Batch((torch.zeros(4, 5, dtype=torch.long),))], "steps": 2}, "batches has 1 batches"),
    ({"steps": 2, "runner": _one_call}, "runs one step per call"),
    ({"loss_fn": None, "target": None, "batches": [pc.Batch((torch.zeros(8, 5, dtype=torch.long),), target=1)]},
     "batches have targets but no loss_fn"),
    ({"optimizer": lambda params: "sgd"}, "returned str, not a torch.optim.Optimizer"),
    ({"optimizer": lbfgs}, "pipecheck steps each optimizer once per optimizer step, without a closure"),
    ({"optimizer": lambda params: torch.optim.SGD(params, lr=0.1), "runner": "distributed"},
     "optimizer '<lambda>' cannot be pickled to send it to the ranks of runner 'distributed'"),
    ({"data_parallel": 3, "optimizer": sgd}, "batch 0 has batch size 8 on dim 0, which data_parallel=3 replicas of "
                                              "n_microbatches=1 cannot share equally"),
], ids=["steps", "accumulation", "data-parallel", "built-optimizer", "optimizer-str", "clip-alone", "clip-negative", "reduction",
        "token-mean-no-loss", "batches-type", "batches-count", "one-call-runner", "batch-target-no-loss",
        "optimizer-returns-str", "lbfgs", "lambda-to-ranks", "dp-uneven-mean"])
def test_bad_training_arguments_are_refused_with_the_fix(settings, message) -> None:  # type: ignore[no-untyped-def]
    x, y = tokens()
    options = {"loss_fn": mean_ce, "target": y, "runner": "reference", **settings}
    with pytest.raises(pc.InputError, match=re.escape(message)) as caught:
        pc.assert_equivalent(make_tied_lm, (x,), **options)
    assert "Fix:" in str(caught.value)


def test_token_mean_needs_per_token_losses() -> None:
    with pytest.raises(pc.LossError, match="must return every token's loss"):
        _check("reference", loss_fn=mean_ce)


@pytest.mark.gpu(n=1)
def test_training_checks_on_a_gpu() -> None:
    """The eager, float64 and reference training on CUDA; pipecheck's runtime with 2 x 2 ranks sharing it."""
    assert _check("reference", device="cuda").ok
    with pc.World(4, device="cuda") as world:
        report = _check("distributed", device="cuda", world=world, data_parallel=2, steps=2)
        assert report.row("step 1: param emb.weight (dp rank 1, stage 1)").ok
        dropout = pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, device="cuda",
                                       runner="distributed", world=world, steps=2, optimizer=sgd, data_parallel=2)
    assert dropout.ok  # masks drawn on the CPU by the contract, moved to the GPU: the same as eager's


class _Broken:
    """A runner whose train method is wrong in the ways an engine's adapter can be."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __call__(self, job):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    def train(self, job):  # type: ignore[no-untyped-def]
        if self.how == "raises":
            raise RuntimeError("engine exploded")
        results = Trainer().train(job)
        return results[:1] if self.how == "short" else {"steps": results}


@pytest.mark.parametrize("how, message", [
    ("raises", "failed to train: RuntimeError: engine exploded"),
    ("short", "returned 1 items; it must return a list of 3 pc.StepResults, one per optimizer step"),
    ("dict", "returned dict; it must return a list of 3 pc.StepResults"),
])
def test_a_runner_that_trains_wrongly_is_an_engine_error(how, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pc.EngineError, match=re.escape(message)):
        _check(_Broken(how))


@pytest.mark.parametrize("reduction, loss_fn", [("token_mean", token_ce), ("mean", mean_ce)])
def test_torch_pipelining_trains_an_untied_model_like_eager(pipecheck_world, reduction, loss_fn) -> None:  # type: ignore[no-untyped-def]
    x, y = tokens(pad=3)
    report = pc.assert_equivalent(make_untied_lm, (x,), loss_fn=loss_fn, target=y, runner="torch",
                                  world=pipecheck_world(2), loss_reduction=reduction, **LOOP)
    assert report.ok and report.row("step 2: param head.weight").ok


def test_torch_pipelining_s_unsynchronised_tied_weight_shows_in_training(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    """torch never sums a tied weight's replicas: each steps on its own stage's share."""
    with pytest.raises(pc.EquivalenceError) as caught:
        _check("torch", world=pipecheck_world(2), optimizer=sgd)
    report = caught.value.report
    assert report.located.startswith("first divergence: optimizer step 0 of 3, in its gradients before the optimizer: "
                                     "step 0: grad emb.weight")
    assert report.row("step 0: grad l1.weight").ok  # the untied weights' gradients still match
    assert not report.row("step 0: param emb.weight (replica in stage 1)").ok


def test_torch_pipelining_has_no_data_parallel_here(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pc.InputError, match="composing it with DDP or FSDP is not supported yet"):
        _check("torch", world=pipecheck_world(4), data_parallel=2)


@pytest.mark.parametrize("runner, data_parallel", [("reference", 1), ("reference", 2), ("distributed", 1),
                                                   ("distributed", 2), ("torch", 1)])
def test_dropout_draws_by_the_contract_in_eager_and_every_runner(pipecheck_world, runner, data_parallel) -> None:  # type: ignore[no-untyped-def]
    world = pipecheck_world(2 * data_parallel) if runner == "distributed" else None
    report = pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner=runner, world=world,
                                  steps=2, optimizer=sgd, accumulation_steps=2, data_parallel=data_parallel)
    assert report.ok
    assert "3 random ops drawn by pipecheck's randomness contract" in report.headline()


def test_a_one_step_check_of_a_dropout_model_draws_by_the_contract_too() -> None:
    report = pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner="reference")
    assert report.ok and "1 step" in report.headline()


def draws_its_own_masks(job: pc.Job) -> pc.StepResult:
    """A runner of one's own that does not say it follows the randomness contract (no follows_random_contract)."""
    raise NotImplementedError("refused before it runs")


def test_dropout_under_a_runner_that_draws_its_own_masks_is_refused_with_a_fix_that_does_not_hide_it() -> None:
    with pytest.raises(pc.InputError) as refused:
        pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner=draws_its_own_masks)
    text = str(refused.value)
    assert text.startswith("DropoutNet draws random numbers in train mode (stage 0: d0 (Dropout), stage 0: block.1 "
                           "(Dropout), stage 1: d1 (Dropout1d)), and runner 'draws_its_own_masks' does not say it "
                           "follows pipecheck's randomness contract"), text
    assert "runner='reference', 'distributed' or 'torch' (they follow it)" in text
    assert "pc.randomness.drawing(job.random_seed" in text
    assert "model.eval() checks the deterministic model only: it leaves the engine's handling of randomness" in text


def test_dropout_in_a_split_made_by_torch_export_draws_by_the_contract() -> None:
    report = pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner="reference",
                                  tracer="export")
    assert report.ok and report.tracer == "export" and "3 random ops" in report.headline()


def test_a_recompute_that_draws_fresh_masks_is_caught_in_the_gradients() -> None:
    from _training_models import FreshRecompute

    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(make_dropout_net, (torch.randn(8, 8),), n_microbatches=2, runner=FreshRecompute(),
                             steps=1)
    report = caught.value.report
    assert report.row("output").ok and report.row("loss").ok
    assert not report.row("grad l0.weight").ok and report.row("grad l2.weight").ok
    hint = " ".join(report.hints.values())
    assert "recomputes a forward with fresh random numbers" in hint and "preserve_rng_state=False" in hint, hint
    assert "stage 0: d0 (Dropout); stage 0: block.1 (Dropout)" in hint


@pytest.mark.parametrize("optimizer", [sgd, adamw])
@pytest.mark.parametrize("seed", range(8))
def test_a_gradient_that_is_rounding_noise_after_the_first_step_is_no_false_alarm(seed, optimizer) -> None:  # type: ignore[no-untyped-def]
    """After step 0 a correct engine's parameters differ from eager's by rounding, and the scalar gain's
    gradient (pure noise: BatchNorm cancels it) is its own noise: 'auto' adds the drift eager itself
    shows when trained again on gradients moved by its own error (found by review: 10 of 30 seeds
    failed with SGD before)."""
    torch.manual_seed(seed)
    model, x, y = GainBeforeBatchNorm(), torch.randn(16, 8), torch.randn(16, 4)
    try:
        report = pc.assert_equivalent(model, (x,), loss_fn=mse, target=y, n_microbatches=4, steps=3,
                                      optimizer=optimizer, runner="reference")
    except pc.PowerError as refused:  # an honest "certifies nothing", never a failure: eager float32 is itself
        # far from float64 on these (s's gradient is noise; AdamW steps a.bias, whose true gradient is 0, by +-lr)
        assert all(row.name.endswith(("a.bias", "running_mean", "grad s")) for row in refused.report.blind)
    else:
        assert report.ok


def test_uneven_microbatches_and_shards_run_on_the_runtime_and_with_batchnorm(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    """10 rows in 4 micro-batches on pipecheck's runtime (layouts travel with each micro-batch), and
    14 rows in 2 replicas of 3 micro-batches cut as the runners cut them (BatchNorm sees the same rows)."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    assert pc.assert_equivalent(GainBeforeBatchNorm(), (x,), loss_fn=mse, target=y, n_microbatches=4, steps=2,
                                optimizer=sgd, loss_reduction="sum", runner="distributed", world=pipecheck_world(2)).ok
    x, y = torch.randn(14, 8), torch.randn(14, 4)
    assert pc.assert_equivalent(GainBeforeBatchNorm(), (x,), loss_fn=mse, target=y, n_microbatches=3, optimizer=sgd,
                                loss_reduction="sum", data_parallel=2, runner="reference").ok


def test_a_model_that_writes_into_its_input_trains_on_clean_copies_everywhere() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    x0 = x.clone()
    for n in (1, 2):
        assert pc.assert_equivalent(WritesItsInput(), (x,), loss_fn=mse, target=y, n_microbatches=n, steps=2,
                                    optimizer=sgd, runner="reference").ok
    assert torch.equal(x, x0)


@pytest.mark.parametrize("runner, data_parallel", [("reference", 1), ("reference", 2), ("distributed", 1),
                                                   ("distributed", 2), ("torch", 1), (Trainer(), 1)],
                         ids=["reference", "reference-dp2", "distributed", "distributed-dp2", "torch", "users-engine"])
def test_a_frozen_parameter_is_held_to_its_value_after_every_step(runner, data_parallel, pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    world = pipecheck_world(2 * data_parallel) if runner in ("distributed", "torch") else None
    try:
        report = _check(runner, model=make_frozen_lm, world=world, data_parallel=data_parallel)
    except pc.EquivalenceError as err:  # torch never sums the tied embedding's replicas
        assert runner == "torch"
        report = err.report
        step0 = {row.name for row in report.failures if row.name.startswith("step 0: ")}
        assert step0 == {"step 0: grad emb.weight", "step 0: grad emb.weight (replica in stage 0)",
                         "step 0: grad emb.weight (replica in stage 1)", "step 0: param emb.weight",
                         "step 0: param emb.weight (replica in stage 0)",
                         "step 0: param emb.weight (replica in stage 1)"}, step0
    else:
        assert report.ok
    assert report.row("step 2: param l1.weight").ok
    assert "step 2: grad l1.weight" not in {row.name for row in report.rows}
    if data_parallel == 2:
        assert report.row("step 2: param l1.weight (dp rank 1, stage 0)").ok


def test_each_data_parallel_replica_keeps_the_buffers_its_own_forwards_update(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    """A running mean the output reads: eager runs replica 1's shard on replica 1's buffers, not on what
    replica 0's shard left (found by a random run of pipeline_cases(training=True))."""
    from pipecheck.strategies import InputSpec, LayerSpec, ModelSpec, OutputSpec, PipelineCase

    spec = ModelSpec(inputs=(InputSpec("x", "x", 2),), outputs=OutputSpec("single", (1,)), batch=4, seed=0,
                     layers=(LayerSpec("running", (-1,), 2), LayerSpec("linear", (0,), 2, bias=False)))
    case = PipelineCase(spec, {"l1": pc.SplitPoint.BEGINNING}, n_microbatches=1, data_parallel=2, steps=2,
                        optimizer="sgd")
    assert case.check("reference").ok
    assert case.check("distributed", world=pipecheck_world(4)).ok


@pytest.mark.parametrize("cut", ["1", "3"])
def test_float64_training_leaves_a_correct_engine_its_own_rounding(cut: str) -> None:
    """In float64 eager is its own truth: a reference that sums 4 micro-batches in another order moves the
    parameters by an ulp, and step 1's gradients of biases before a BatchNorm (rounding noise, ~5e-18)
    failed against atol 1.7e-33. float64's rounding is now estimated from a float32 run, as the one-step
    check's is; a planted bug is still caught."""
    settings = {"split_spec": {cut: pc.SplitPoint.BEGINNING}, "n_microbatches": 4, "steps": 3, "optimizer": sgd,
                "dtype": torch.float64}
    report = pc.assert_equivalent(_odd_models.conv_batchnorm_cnn, (_odd_models.images(),), runner="reference",
                                  **settings)
    assert report.ok and report.dtype == "float64" and report.power is not None and report.power < 1e-9
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(_odd_models.conv_batchnorm_cnn, (_odd_models.images(),),
                             runner=Trainer("rescaled_each_step"), **settings, accumulation_steps=2)
    assert caught.value.report.located.startswith("first divergence: optimizer step 0 of 3")



@pytest.mark.parametrize("data_parallel", [1, 2])
@pytest.mark.parametrize("runner", ["reference", Trainer()], ids=["reference", "users-engine"])
def test_a_bfloat16_training_check_is_anchored_on_eager_and_certifies_a_correct_engine(runner, data_parallel) -> None:  # type: ignore[no-untyped-def]
    """After the first optimizer step a correct engine's parameters are no longer eager's bits: each value's
    noise, step by step, is how far eager trained again with its micro-batch gradients summed in another
    order moves it (AdamW, clipping and accumulation as LOOP has them)."""
    report = _check(runner, dtype=torch.bfloat16, data_parallel=data_parallel)
    assert report.ok and not report.blind and report.tolerance == "auto, anchored on eager bfloat16"
    assert report.norm_power is not None and report.norm_power < 0.1


@pytest.mark.parametrize("bug, first", [
    ("grads_not_zeroed", "step 1: grad"),
    ("replica_not_stepped", "step 0: param emb.weight (replica in stage 1)"),
    ("mean_of_means", "step 0: grad"),
    ("dp_replica_not_reduced-dp", "step 0: grad emb.weight (dp rank 1, stage 0)"),
    ("trains_frozen-frozen", "step 0: param l1.weight"),
])
def test_planted_training_bugs_are_caught_in_bfloat16(bug, first) -> None:  # type: ignore[no-untyped-def]
    bug, _, variant = bug.partition("-")
    with pytest.raises(pc.EquivalenceError) as caught:
        _check(Trainer(bug), dtype=torch.bfloat16, data_parallel=2 if variant == "dp" else 1,
               **({"model": make_frozen_lm} if variant == "frozen" else {}))
    assert any(row.name.startswith(first) for row in caught.value.report.failures)


@pytest.mark.gpu(n=1)
def test_a_bfloat16_training_check_on_a_gpu_is_anchored_on_eager() -> None:
    report = _check("reference", device="cuda", dtype=torch.bfloat16)
    assert report.ok and report.tolerance == "auto, anchored on eager bfloat16", report.notes
    with pytest.raises(pc.EquivalenceError):
        _check(Trainer("grads_not_zeroed"), device="cuda", dtype=torch.bfloat16)
