"""Generated models with random ops (dropout in its forms, stochastic depth, a checkpointed block with dropout):
drawn only for runners that follow pipecheck's randomness contract, rebuilt exactly by the printed script,
matched by the runners that follow the contract (fx- and export-traced, one step and training), and failed by a
runner that draws another micro-batch's numbers.

The property tests run a few examples each (a fraction of the hypothesis profile's), so the suite's budget holds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample
from mutants.random_draws import DrawingEngine

import pipecheck as pc
from pipecheck import strategies as pst
from pipecheck.strategies import InputSpec, LayerSpec, ModelSpec, OutputSpec

EXACT = settings(database=None, derandomize=True, deadline=None)
RANDOM = set(pst.RANDOM_FEATURES)
CONTRACT = "drawn by pipecheck's randomness contract"


def _few(share: int, least: int) -> settings:
    """A ``share``-th of the profile's examples (ci: 25), at least ``least``: each one runs a whole check."""
    return settings(max_examples=max(least, settings.default.max_examples // share))


RANDOM_SPEC = ModelSpec(  # every random layer: 7 random ops, one of them recomputed in backward
    inputs=(InputSpec("x", "x", 4),),
    layers=(
        LayerSpec("linear", (-1,), 4),
        LayerSpec("dropout", (0,), 4),
        LayerSpec("functional_dropout", (1,), 4),
        LayerSpec("attention_dropout", (2,), 4),
        LayerSpec("channel_dropout", (3,), 4),  # 2 channels of 2 features
        LayerSpec("stochastic_depth", (4, 0), 4),  # l0's output + the branch since, kept or dropped per sample
        LayerSpec("checkpointed_dropout", (5,), 4),
        LayerSpec("linear", (6,), 3),
        LayerSpec("channel_dropout", (7,), 3),  # 3 channels of 1 feature
        LayerSpec("linear", (8,), 2),
    ),
    outputs=OutputSpec("single", (9,)),
    batch=4,
    seed=3,
)


def _forward_backward(model: torch.nn.Module, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return [out.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


def test_every_random_layer_is_named_built_and_rebuilt_exactly_by_the_script() -> None:
    assert pst.features(RANDOM_SPEC) == {"linear", *RANDOM}
    model = pst.build(RANDOM_SPEC)
    assert isinstance(model.l1, torch.nn.Dropout) and isinstance(model.l4.drop, torch.nn.Dropout1d)
    assert (model.l4.channels, model.l8.channels) == (2, 3)
    assert [name for name, _ in model.named_parameters()] == [
        "l0.weight", "l0.bias", "l6.linear.weight", "l6.linear.bias", "l7.weight", "l7.bias", "l9.weight", "l9.bias"]
    source = pst.to_source(RANDOM_SPEC)
    for written in ("torch.nn.Dropout(0.25)", "torch.nn.functional.dropout(h, self.p, training=self.training)",
                    "scaled_dot_product_attention(", "dropout_p=self.p if self.training else 0.0",
                    "torch.nn.Dropout1d(p)", ".bernoulli_(keep) / keep",
                    "checkpoint(self.block, h, use_reentrant=False, preserve_rng_state=True)"):
        assert written in source, written
    namespace: dict[str, Any] = {}
    exec(compile(source, "<script>", "exec"), namespace)
    rebuilt = namespace["make_model"]()
    (x,), _ = pst.make_inputs(RANDOM_SPEC)
    for seed in (0, 1):  # the same draws, the same values and gradients, bit for bit
        built, again = _forward_backward(pst.build(RANDOM_SPEC), x, seed), _forward_backward(rebuilt, x, seed)
        rebuilt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(built, again, strict=True))
    assert not torch.equal(_forward_backward(model, x, 0)[0], _forward_backward(model, x, 1)[0])  # they do draw
    model.eval()
    with torch.no_grad():
        torch.manual_seed(0)
        first = model(x)
        torch.manual_seed(1)
        assert torch.equal(first, model(x))  # and draw nothing in eval mode


def test_the_script_of_every_random_layer_runs_alone_importing_only_torch(tmp_path: Path) -> None:
    script = tmp_path / "random_model.py"
    script.write_text(pst.to_source(RANDOM_SPEC))
    assert re.findall(r"^(?:import|from) .*$", script.read_text(), re.M) == ["import torch"]
    done = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "tensor(" in done.stdout, done.stderr


def test_every_random_op_is_drawn_by_the_contract_and_refused_by_a_runner_that_does_not_follow_it() -> None:
    case = pst.PipelineCase(RANDOM_SPEC, {"l3": pc.SplitPoint.BEGINNING, "l6": pc.SplitPoint.BEGINNING},
                            n_microbatches=2)
    assert f"7 random ops {CONTRACT}" in case.check("reference").headline()
    with pytest.raises(pc.InputError, match="does not say it follows pipecheck's randomness contract"):
        case.run(_plain)


def _random_case(case: pst.PipelineCase) -> bool:
    return bool(case.features() & RANDOM)


def _plain(job: pc.Job) -> pc.StepResult:  # a runner that does not say it follows the contract
    raise AssertionError("never run")


@pytest.mark.parametrize("training", [False, True], ids=["one-step", "training"])
def test_cases_draw_random_ops_only_when_every_runner_follows_the_contract(training: bool) -> None:
    """(pst.models() draws every random feature when asked: test_every_feature_appears_within_200_draws.)"""
    first = settings(EXACT, phases=[Phase.generate])  # the first found: shrinking it is slow, and not the point
    drawn = find(pst.pipeline_cases(training=training), _random_case, settings=first)
    assert drawn.runner == "reference" and (training or drawn.training_arguments() == ())
    find(pst.pipeline_cases(training=training, runners=(DrawingEngine(),)), _random_case, settings=first)
    for runners in (("torch",), ("reference", "torch"), (_plain,)):  # a third of cases draw them where allowed
        with pytest.raises(NoSuchExample):
            find(pst.pipeline_cases(training=training, runners=runners), _random_case,
                 settings=settings(EXACT, max_examples=30))


def test_the_repro_of_an_export_traced_random_case_rebuilds_it_and_passes() -> None:
    case = pst.PipelineCase(RANDOM_SPEC, {"l5": pc.SplitPoint.BEGINNING}, n_microbatches=2, steps=2,
                            optimizer="sgd")
    source = case.repro("reference", tracer="export")
    assert "        tracer='export',\n" in source and "        steps=2,\n" in source
    namespace: dict[str, Any] = {}
    exec(compile(source, "<repro>", "exec"), namespace)
    namespace["test_pipeline_case"]()  # the printed model draws what the case's does: it matches again


# --- generated random models, checked ---------------------------------------------------------------------

# Models made mostly of random layers (each model has one at least), small enough to run in a fraction of a second.
RANDOM_MODELS = pst.models(max_layers=6, features=("linear", "activation", "residual", *pst.RANDOM_FEATURES)) \
    .filter(lambda spec: bool(pst.features(spec) & RANDOM))
TRACERS = st.sampled_from(("fx", "export"))


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


def _matched(case: pst.PipelineCase, runner: Any, tracer: str, **extra: Any) -> pc.Report:
    try:
        report = case.check(runner, tracer=tracer, **extra)
    except pc.PowerError as refused:  # matched, and said where it could not see (a LayerNorm over 2 features)
        report = refused.report
    assert report.ok and CONTRACT in report.headline() and f"split by {tracer}" in report.headline()
    return report


@_few(share=3, least=6)
@given(pst.pipeline_cases(models=RANDOM_MODELS, max_stages=3, schedules=("gpipe", "1f1b", "interleaved")), TRACERS)
def test_generated_random_models_match_in_one_step_on_the_reference_runner(case: pst.PipelineCase, tracer: str) -> None:
    _matched(case, "reference", tracer)


@_few(share=3, least=6)
@given(pst.pipeline_cases(models=RANDOM_MODELS, training=True, max_stages=3, schedules=("gpipe", "1f1b")), TRACERS)
def test_generated_random_models_match_in_training_on_the_reference_runner(case: pst.PipelineCase,
                                                                          tracer: str) -> None:
    _matched(case, "reference", tracer)


@_few(share=6, least=3)
@given(pst.pipeline_cases(models=RANDOM_MODELS, training=True, max_stages=2, schedules=("1f1b",)), TRACERS)
def test_generated_random_models_match_on_the_distributed_runtime(pipecheck_world: Any, case: pst.PipelineCase,
                                                                  tracer: str) -> None:
    _matched(case, "distributed", tracer, world=pipecheck_world(case.world_size * case.data_parallel))


# Element-wise random ops over at least 4 x 4 values per micro-batch: another micro-batch's draws differ (two
# micro-batches' masks of 16 values each, dropped with p = 0.25, agree with probability 0.625 ** 16 < 1e-3).
ELEMENTWISE = {"dropout", "functional_dropout", "attention_dropout", "checkpointed_dropout"}
SHIFTED = pst.pipeline_cases(
    models=pst.models(max_layers=5, min_width=4, batch=8, features=("linear", "activation", *ELEMENTWISE))
    .filter(lambda spec: bool(pst.features(spec) & ELEMENTWISE)),
    runners=(DrawingEngine(shift=1),), max_stages=3, max_microbatches=2, schedules=("gpipe",)) \
    .filter(lambda case: case.n_microbatches == 2)


@_few(share=5, least=4)
@given(SHIFTED, TRACERS)
def test_a_generated_random_model_fails_under_a_runner_that_draws_another_microbatchs_numbers(
        case: pst.PipelineCase, tracer: str) -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        case.run(tracer=tracer)
    hints = " ".join(caught.value.report.hints.values())
    assert "micro-batch 0 drew micro-batch 1's, micro-batch 1 drew micro-batch 0's random numbers" in hints, hints
    assert case.check(DrawingEngine(), tracer=tracer).ok  # the engine without its bug matches
