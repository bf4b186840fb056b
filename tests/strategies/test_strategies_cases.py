"""Tests of pipecheck.strategies' cut_points(), inputs(), pipeline_cases() and PipelineCase:
valid draws, biased cuts, shrinking, reprs, argument errors, and a planted bug found,
shrunk and reproduced by the printed script."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import pipecheck as pc
from pipecheck import strategies as pst
from pipecheck.errors import InputError
from pipecheck.strategies import InputSpec, LayerSpec, ModelSpec, OutputSpec, PipelineCase

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXACT = settings(database=None, derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
B = pc.SplitPoint.BEGINNING

# l0 linear, l1 relu, l2 + optional k1 (not passed), l3 + k0, l4 = l3 + x, l5 tied to l0
SKIP_TIED = ModelSpec(
    inputs=(InputSpec("x", "x", 3), InputSpec("k0", "kwarg", 3),
            InputSpec("k1", "kwarg", 3, required=False, passed=False)),
    layers=(
        LayerSpec("linear", (-1,), 3),
        LayerSpec("activation", (0,), 3, op="relu"),
        LayerSpec("kwarg", (1,), 3, input_name="k1"),  # not passed: computes nothing
        LayerSpec("kwarg", (2,), 3, input_name="k0"),
        LayerSpec("add", (3, -1), 3),
        LayerSpec("tied", (4,), 3, tied_to=0, bias=False),
    ),
    outputs=OutputSpec("tuple", (5, 1)),
    batch=4,
    seed=3,
)
TWO_LINEARS = ModelSpec((InputSpec("x", "x", 2),),
                        (LayerSpec("linear", (-1,), 2, bias=False),
                         LayerSpec("linear", (0,), 2, bias=False)),
                        OutputSpec("single", (1,)), batch=4, seed=0)


def tied_grads_not_summed(job: pc.Job) -> pc.StepResult:
    """PLANTED BUG: a tied parameter's gradient is its lowest stage's share, never summed."""
    result = pc.DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn,
                                                 target=job.target,
                                                 n_microbatches=job.n_microbatches)
    lowest: dict[str, torch.Tensor] = {}
    for stage_grads in result.stage_grads:  # stage order: the first share seen is the lowest
        for fqn, grad in stage_grads.items():
            lowest.setdefault(fqn, grad)
    return dataclasses.replace(result, grads=lowest)


def run_script(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a fresh script; this directory is importable (for the planted runner)."""
    script = tmp_path / "repro_case.py"
    script.write_text(source)
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})


# --- cut_points --------------------------------------------------------------------------


def test_cut_plan_lists_the_places_worth_cutting() -> None:
    plan = pst._internal.cuts.cut_plan(SKIP_TIED)
    assert plan.positions == (1, 3, 4, 5)  # l0 is stage 0's; l2 computes nothing
    assert dict(plan.groups) == {
        "first": ((1,),),
        "last": ((5,),),
        "output": ((1, 3), (5,)),  # before output h1 or right after it; before h5
        "tied": ((1, 3, 4, 5),),
        "skip": ((1, 3, 4),),
        "input": ((1, 3),),  # before k0's layer
    }


@FEW
@given(st.data())
def test_cut_points_give_stages_that_each_compute(data: st.DataObject) -> None:
    spec = data.draw(pst.models(min_layers=2))
    if pst._internal.cuts.cut_plan(spec).max_stages < 2:
        return
    split_spec = data.draw(pst.cut_points(spec, max_stages=3))
    assert 2 <= len(split_spec) + 1 <= 3
    assert all(point is B for point in split_spec.values())
    layers = [int(name[1:]) for name in split_spec]
    assert layers == sorted(set(layers)) and all(spec.computes(k) for k in layers)
    args, kwargs = pst.make_inputs(spec)
    assert pc.split(pst.build(spec), args, kwargs, split_spec=split_spec).num_stages == len(layers) + 1


def test_cut_points_often_cut_where_pipelines_go_wrong() -> None:
    seen: set[str] = set()

    @settings(EXACT, max_examples=60)
    @given(pst.cut_points(SKIP_TIED, min_stages=2, max_stages=4))
    def collect(split_spec: dict[str, Any]) -> None:
        seen.update(pst._internal.cuts.crossings(SKIP_TIED, split_spec))

    collect()
    assert seen == set(pst.CROSSINGS)


def test_cut_points_shrink_to_fewer_stages_and_earlier_cuts() -> None:
    assert find(pst.cut_points(SKIP_TIED), lambda s: True, settings=EXACT) == {"l1": B}
    three = find(pst.cut_points(SKIP_TIED, max_stages=4), lambda s: len(s) == 2, settings=EXACT)
    assert three == {"l1": B, "l3": B}
    tied_apart = find(pst.cut_points(SKIP_TIED), settings=EXACT, condition=lambda s: "l5" in s)
    assert tied_apart == {"l5": B}


# --- inputs ------------------------------------------------------------------------------


@FEW
@given(st.data())
def test_inputs_fit_the_model_and_shrink_to_make_inputs(data: st.DataObject) -> None:
    spec = data.draw(pst.models(features=["linear", "embedding", "kwarg", "kwarg_default"]))
    args, kwargs = data.draw(pst.inputs(spec, dtype=torch.bfloat16))
    want_args, want_kwargs = pst.make_inputs(spec, torch.bfloat16)
    assert [(a.shape, a.dtype) for a in args] == [(a.shape, a.dtype) for a in want_args]
    assert {k: (v.shape, v.dtype) for k, v in kwargs.items()} == \
        {k: (v.shape, v.dtype) for k, v in want_kwargs.items()}
    for spec_input, value in zip([i for i in spec.inputs if i.role != "kwarg"], args, strict=True):
        if spec_input.role == "ids":
            assert value.dtype == torch.int64 and 0 <= value.min() and value.max() < spec_input.width
    pst.build(spec).to(torch.bfloat16)(*args, **kwargs)


def test_inputs_shrink_to_exactly_make_inputs() -> None:
    args, kwargs = find(pst.inputs(SKIP_TIED), lambda _: True, settings=EXACT)
    want_args, want_kwargs = pst.make_inputs(SKIP_TIED)
    assert all(torch.equal(a, b) for a, b in zip(args, want_args, strict=True))
    assert kwargs.keys() == want_kwargs.keys() == {"k0"}
    assert torch.equal(kwargs["k0"], want_kwargs["k0"])


# --- pipeline_cases ----------------------------------------------------------------------


@FEW
@given(pst.pipeline_cases(dtypes=(torch.bfloat16, torch.float32), max_world_size=2,
                          runners=("reference", "distributed")))
def test_generated_layouts_always_fit(case: PipelineCase) -> None:
    assert case.spec.batch % case.n_microbatches == 0
    assert case.world_size * case.stages_per_rank == case.num_stages
    assert 1 <= case.world_size <= 2 and case.stages_per_rank <= 2
    assert case.schedule not in ("1f1b", "zb") or case.stages_per_rank == 1
    assert case.schedule != "zbv" or (case.stages_per_rank == 2 and case.num_stages % 2 == 0)
    if case.schedule == "interleaved" and case.stages_per_rank > 1:
        assert case.n_microbatches % case.world_size == 0
    pc.schedules.make_schedule(case.schedule, case.num_stages, case.n_microbatches,
                               case.stages_per_rank)
    assert eval(repr(case), {"PipelineCase": PipelineCase, "SplitPoint": pc.SplitPoint,
                             "torch": torch, **vars(pst)}) == case


@FEW
@given(pst.pipeline_cases(schedules=("zb", "zbv"), max_world_size=2, runners=("distributed",)))
def test_zero_bubble_cases_get_their_layouts(case: PipelineCase) -> None:
    want = {"zb": 1, "zbv": 2}[case.schedule]
    assert case.stages_per_rank == want and case.world_size * want == case.num_stages <= 4
    pc.schedules.make_schedule(case.schedule, case.num_stages, case.n_microbatches, case.stages_per_rank)


def test_zbv_is_drawn_and_shrinks_to_two_stages_on_one_rank() -> None:
    simplest = find(pst.pipeline_cases(schedules=("zbv",)), lambda _: True, settings=EXACT)
    assert (simplest.schedule, simplest.num_stages, simplest.stages_per_rank, simplest.world_size) == \
        ("zbv", 2, 2, 1)


def test_the_simplest_case_is_two_linears_in_two_stages_on_gpipe_in_fp32() -> None:
    simplest = find(pst.pipeline_cases(dtypes=(torch.bfloat16, torch.float32),
                                       schedules=("interleaved", "1f1b", "gpipe")),
                    lambda _: True, settings=EXACT)
    assert simplest == PipelineCase(TWO_LINEARS, {"l1": B}, n_microbatches=1, schedule="gpipe",
                                    stages_per_rank=1, world_size=2, dtype=torch.float32,
                                    runner="reference")


def test_a_case_runs_the_exact_call_its_repro_prints() -> None:
    case = PipelineCase(SKIP_TIED, {"l3": B, "l5": B}, n_microbatches=2, schedule="1f1b",
                        stages_per_rank=1, world_size=3, dtype=torch.bfloat16)
    report = case.check(tolerance="auto")
    assert report.ok and report.num_stages == 3 and report.dtype == "bfloat16"
    source = case.repro(tolerance="auto", world=object())
    assert source.endswith('''\
def test_pipeline_case() -> None:
    """The pipeline check pipecheck.strategies generated."""
    args, kwargs = make_inputs()
    pc.assert_equivalent(
        make_model,
        args,
        kwargs,
        split_spec={'l3': pc.SplitPoint.BEGINNING, 'l5': pc.SplitPoint.BEGINNING},
        n_microbatches=2,
        schedule='1f1b',
        stages_per_rank=1,
        world_size=3,
        dtype=torch.bfloat16,
        runner='reference',
        tolerance='auto',
        # world=... left out: the runner makes its own
    )


if __name__ == "__main__":
    test_pipeline_case()
''')
    namespace: dict[str, Any] = {"__name__": "pasted_test"}
    exec(compile(source, "<repro>", "exec"), namespace)
    namespace["test_pipeline_case"]()  # passes, as the case did


def test_a_case_lays_its_stages_one_per_rank_unless_told() -> None:
    assert PipelineCase(SKIP_TIED, {"l3": B, "l5": B}).world_size == 3
    assert PipelineCase(TWO_LINEARS, {"l1": B}, stages_per_rank=2).world_size == 1


def test_check_appends_the_repro_to_a_raising_loss_fn_s_loss_error() -> None:
    def broken_loss(output: Any, target: Any) -> torch.Tensor:
        raise ValueError("loss exploded")

    case = PipelineCase(TWO_LINEARS, {"l1": B})
    with pytest.raises(pc.LossError, match="loss_fn 'broken_loss' raised ValueError: loss exploded") as info:
        case.check(loss_fn=broken_loss)
    assert "def test_pipeline_case()" in str(info.value)
    assert "loss_fn=NotImplemented,  # <function" in str(info.value)  # a local: no source form


def _policy_that_divides_by_zero(units: Any) -> list[int]:
    return [len(units) // 0]


def test_check_notes_the_repro_on_errors_outside_pipecheck() -> None:
    case = PipelineCase(TWO_LINEARS, {"l1": B})
    with pytest.raises(ZeroDivisionError) as info:  # the user's own policy, raising
        case.check(split_spec=None, policy=_policy_that_divides_by_zero)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "def test_pipeline_case()" in notes
    assert "policy=" in notes


def test_planted_tied_bug_is_found_shrunk_and_reproduced_by_the_printed_script(
    tmp_path: Path,
) -> None:
    tried: list[PipelineCase] = []

    # No explain phase: it re-runs the shrunk case hundreds of times to annotate it.
    @settings(EXACT, max_examples=150, report_multiple_bugs=False,
              phases=[Phase.generate, Phase.shrink])
    @given(pst.pipeline_cases(runners=(tied_grads_not_summed,)))
    def prop(case: PipelineCase) -> None:
        tried.append(case)
        case.check()

    with pytest.raises(pc.EquivalenceError) as info:
        prop()
    smallest = tried[-1]  # hypothesis replays the shrunk example last
    assert len(smallest.spec.layers) <= 4 and smallest.num_stages <= 2
    assert "tied_across_stages" in smallest.features()
    message = str(info.value)
    assert "tied parameter not synchronised" in message
    script = message.split(pst._internal.repro.BANNER + "\n\n", 1)[1]
    assert script == smallest.repro()
    assert "from test_strategies_cases import tied_grads_not_summed" in script
    assert "        runner=tied_grads_not_summed,\n" in script

    done = run_script(script, tmp_path)
    assert done.returncode != 0
    assert "pipecheck.errors.EquivalenceError" in done.stderr, done.stderr[-3000:]
    assert "tied parameter not synchronised" in done.stderr


# --- repr and arguments ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: pst.pipeline_cases(), "pipeline_cases()"),
        (lambda: pst.pipeline_cases(dtypes=(torch.float32, torch.bfloat16), max_stages=3),
         "pipeline_cases(dtypes=(torch.float32, torch.bfloat16), max_stages=3)"),
        (lambda: pst.pipeline_cases(models=pst.models(max_layers=4), runners=["distributed"]),
         "pipeline_cases(models=models(max_layers=4), runners=['distributed'])"),
        (lambda: pst.cut_points(TWO_LINEARS, max_stages=2),
         f"cut_points({TWO_LINEARS!r}, max_stages=2)"),
        (lambda: pst.inputs(TWO_LINEARS, dtype=torch.bfloat16),
         f"inputs({TWO_LINEARS!r}, dtype=torch.bfloat16)"),
    ],
    ids=["cases-defaults", "cases-dtypes", "cases-models", "cut_points", "inputs"],
)
def test_repr_reproduces_the_call(make: Any, expected: str) -> None:
    strategy = make()
    namespace = {"torch": torch, **vars(pst)}
    assert re.sub(r"\s+", " ", repr(strategy)) == re.sub(r"\s+", " ", expected)
    assert repr(eval(repr(strategy), namespace)) == repr(strategy)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pst.cut_points("model"), "spec='model' must be a ModelSpec"),
        (lambda: pst.cut_points(TWO_LINEARS, min_stages=0), "min_stages=0 must be at least 1"),
        (lambda: pst.cut_points(TWO_LINEARS, min_stages=3, max_stages=2),
         "min_stages=3 is greater than max_stages=2; pass min_stages <= max_stages"),
        (lambda: pst.cut_points(TWO_LINEARS, max_stages=2.0), "max_stages=2.0 must be an int"),
        (lambda: pst.cut_points(TWO_LINEARS, min_stages=3, max_stages=4),
         "min_stages=3 but spec has only 2 layers that compute"),
        (lambda: pst.inputs(TWO_LINEARS, dtype=torch.int64),
         "dtype=torch.int64 must be a floating torch.dtype"),
        (lambda: pst.inputs(None), "spec=None must be a ModelSpec"),
        (lambda: pst.pipeline_cases(models=TWO_LINEARS), "must be a strategy of ModelSpec"),
        (lambda: pst.pipeline_cases(runners="reference"),
         "runners='reference' must be a collection, e.g. runners=['reference']"),
        (lambda: pst.pipeline_cases(runners=["nccl"]),
         "runners has 'nccl', which is neither one of ['reference', 'distributed', 'torch']"),
        (lambda: pst.pipeline_cases(dtypes=()), "dtypes=[] is empty; give at least one"),
        (lambda: pst.pipeline_cases(dtypes=[torch.int32]),
         "dtypes has torch.int32, which is not a floating torch.dtype"),
        (lambda: pst.pipeline_cases(schedules=["zb-h1"]),
         "schedules has 'zb-h1'; choose from ['gpipe', '1f1b', 'interleaved', 'zb', 'zbv']"),
        (lambda: pst.pipeline_cases(schedules=["zbv"], max_stages_per_rank=1),
         "schedules=['zbv'] places 2 stages on each rank (a V), but max_stages_per_rank=1"),
        (lambda: pst.pipeline_cases(max_world_size=0), "max_world_size=0 must be at least 1"),
        (lambda: pst.pipeline_cases(max_microbatches=True), "max_microbatches=True must be an int"),
        (lambda: pst.pipeline_cases(min_stages=5, max_stages=8, max_world_size=2),
         "min_stages=5 stages do not fit on max_world_size=2 ranks of max_stages_per_rank=2"),
        (lambda: pst.pipeline_cases(max_stages_per_rank=0, dtypes=[]),
         "- dtypes=[] is empty; give at least one\n- max_stages_per_rank=0 must be at least 1"),
        (lambda: PipelineCase(TWO_LINEARS, {"l1": B}, world_size=3),
         "world_size=3 ranks of stages_per_rank=1 do not hold the 2 stages of split_spec; "
         "pass world_size * stages_per_rank == 2"),
        (lambda: PipelineCase(TWO_LINEARS, {"l1": B}, n_microbatches=3),
         "n_microbatches=3 must divide the batch of 4"),
    ],
    ids=["cut-spec-type", "cut-min-zero", "cut-crossed", "cut-max-float", "cut-too-few-layers",
         "inputs-int-dtype", "inputs-spec-none", "cases-models-spec", "cases-runners-str",
         "cases-runner-unknown", "cases-dtypes-empty", "cases-dtype-int", "cases-schedule", "cases-zbv-one-per-rank",
         "cases-world-zero", "cases-microbatches-bool", "cases-stages-do-not-fit",
         "cases-all-problems-at-once", "case-layout", "case-microbatches"],
)
def test_invalid_arguments_raise_input_error_when_called(call: Any, message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        call()
