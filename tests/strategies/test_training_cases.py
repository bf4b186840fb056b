"""pipeline_cases(training=True): generated training loops, run on the runners that train."""

from __future__ import annotations

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample, Unsatisfiable

import pipecheck as pc
from pipecheck import strategies as pst

EXACT = settings(database=None, derandomize=True, deadline=None)


# The generated loops themselves run in test_properties.py, as many as the hypothesis profile says.


def test_data_parallel_cases_are_drawn_where_they_fit() -> None:
    case = find(pst.pipeline_cases(training=True, max_world_size=4), lambda c: c.data_parallel == 2, settings=EXACT)
    assert case.spec.batch % (2 * case.n_microbatches) == 0 and case.world_size * 2 <= 4
    assert case.call_arguments()["world_size"] == 2 * case.world_size


def test_a_training_case_shrinks_to_one_step_without_an_optimizer() -> None:
    simplest = find(pst.pipeline_cases(training=True), lambda _: True, settings=EXACT)
    assert (simplest.steps, simplest.accumulation_steps, simplest.optimizer, simplest.loss_reduction) == \
        (1, 1, None, "mean")
    assert "steps=" not in repr(simplest)


def test_a_training_case_says_its_loop_in_its_repr_and_repro() -> None:
    case = find(pst.pipeline_cases(training=True), lambda c: c.steps > 1 and c.optimizer is not None,
                settings=EXACT)
    assert f"steps={case.steps}" in repr(case) and f"optimizer={case.optimizer!r}" in repr(case)
    source = case.repro("reference")
    assert f"steps={case.steps}," in source and f"optimizer={case.optimizer}," in source
    namespace: dict[str, object] = {}
    exec(compile(source, "<repro>", "exec"), namespace)  # the repro's call is the case's own
    namespace["test_pipeline_case"]()  # type: ignore[operator]


def test_the_optimizers_are_factories_of_torch_optimizers() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    assert all(isinstance(factory(params), torch.optim.Optimizer) for factory in pst.OPTIMIZERS.values())
    assert set(pst.LOSS_REDUCTIONS) <= set(pc.losses.LOSS_REDUCTIONS)


def test_training_cases_draw_dropout_and_it_matches_on_both_runners_that_follow_the_contract(pipecheck_world) -> None:  # type: ignore[no-untyped-def]
    case = find(pst.pipeline_cases(training=True, max_stages=2, schedules=("1f1b",)),
                lambda c: "dropout" in c.features() and c.steps > 1 and c.optimizer is not None,
                settings=settings(EXACT, max_examples=2000))
    assert "torch.nn.Dropout(0.25)" in case.repro("reference")
    assert case.check("reference").ok
    assert case.check("distributed", world=pipecheck_world(case.world_size * case.data_parallel)).ok


def test_dropout_is_drawn_only_where_asked_for() -> None:
    """Plain models() have no randomness (most runners refuse it); features=[...] names it. Cases draw it for the
    runners that follow the randomness contract (test_random_cases.py)."""
    assert "dropout" in pst.FEATURES and "dropout" in pst.RANDOM_FEATURES
    with pytest.raises(NoSuchExample):
        find(pst.models(), lambda spec: "dropout" in pst.features(spec), settings=EXACT)
    spec = find(pst.models(features=["linear", "dropout"]), lambda spec: "dropout" in pst.features(spec),
                settings=EXACT)
    assert isinstance(pst.build(spec).get_submodule("l0"), torch.nn.Dropout)


def _draws_its_own_masks(job: pc.Job) -> pc.StepResult:  # a runner without follows_random_contract
    raise NotImplementedError


def test_dropout_is_not_drawn_for_a_runner_that_draws_its_own_masks() -> None:
    with pytest.raises(NoSuchExample):
        find(pst.pipeline_cases(training=True, runners=("reference", _draws_its_own_masks)),
             lambda case: "dropout" in case.features(), settings=EXACT)


@pytest.mark.parametrize("runner", ["distributed"])
def test_dropout_is_drawn_for_the_built_in_runners_that_follow_the_contract(runner: str) -> None:
    case = find(pst.pipeline_cases(training=True, runners=(runner,)), lambda case: "dropout" in case.features(),
                settings=settings(EXACT, max_examples=500))  # a dropout model is one draw in dozens
    assert case.runner == runner


STEEP = pst.PipelineCase(  # a chain of products: three SGD steps blow its eager loss up to inf
    pst.ModelSpec(inputs=(pst.InputSpec("x", "x", 2),), batch=4, seed=410, outputs=pst.OutputSpec("tuple", (5, 0)),
                  layers=(pst.LayerSpec("linear", (-1,), 2, bias=False), pst.LayerSpec("multiply", (0, -1), 2),
                          pst.LayerSpec("multiply", (1, 0), 2), pst.LayerSpec("multiply", (2, 1), 2),
                          pst.LayerSpec("multiply", (3, -1), 2), pst.LayerSpec("multiply", (4, 2), 2))),
    {"l1": pc.SplitPoint.BEGINNING}, steps=3, optimizer="sgd")


def test_a_case_whose_eager_run_blows_up_is_rejected_in_a_hypothesis_test_and_raised_outside() -> None:
    with pytest.raises(pc.NonFiniteError):
        STEEP.check("reference")

    @settings(EXACT, max_examples=3)
    @given(st.just(STEEP))
    def judged(case: pst.PipelineCase) -> None:
        case.check("reference")

    with pytest.raises(Unsatisfiable):  # every example rejected: none failed
        judged()
