"""A failing training check says where within its first failing optimizer step the runs part, with the
one-step check's hints (pipecheck._check.train_locate); a passing one never pays for it, and the
diagnosis never changes a verdict."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _training_models import Trainer, make_tied_lm, mean_ce, sgd, token_ce, tokens
from mutants.training import TrainingRunner
from pipecheck.fixtures import get

import pipecheck as pc

# private: the module under test, and the runners' registry and recorder for the runtime's re-run
import pipecheck._check.train_locate as train_locate
import pipecheck._check.training as training
from pipecheck._runners.registry import runner_named
from pipecheck._runtime.boundaries import Boundaries


def _check(runner: Any, **settings: Any) -> pc.Report:
    x, y = tokens(pad=3)
    options = {"loss_fn": token_ce, "target": y, "loss_reduction": "token_mean", "n_microbatches": 4, "steps": 3,
               "optimizer": sgd, **settings}
    return pc.assert_equivalent(make_tied_lm, (x,), runner=runner, **options)


def _caught(runner: Any, **settings: Any) -> pc.Report:
    with pytest.raises(pc.EquivalenceError) as caught:
        _check(runner, **settings)
    return caught.value.report


def test_a_passing_training_check_never_locates(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_: Any) -> None:
        raise AssertionError("a passing check located")

    monkeypatch.setattr(training, "locate_step", never)
    report = _check("reference")
    assert report.ok and "locate_s" not in report.timings


def test_locating_that_fails_keeps_the_verdict_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    located = _caught(Trainer("grads_not_zeroed"))

    def out_of_memory(*_: Any) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(train_locate, "reference_step", out_of_memory)
    report = _caught(Trainer("grads_not_zeroed"))
    assert [(row.name, row.ok) for row in report.rows] == [(row.name, row.ok) for row in located.rows]
    assert report.located.splitlines()[0] == located.located.splitlines()[0]
    assert report.located.splitlines()[1] == ("within it, the divergence was not located: the reference could not "
                                              "run the step (RuntimeError: CUDA out of memory)")
    assert report.first_divergence is None and "locate_s" in report.timings


def test_gradients_not_zeroed_are_after_the_dataflow_of_step_1() -> None:
    report = _caught(Trainer("grads_not_zeroed"))
    assert report.first_divergence is None
    assert report.located.splitlines()[1].startswith(
        "within it: no boundary value diverges (28 values the stages received and sent, forward and backward, match "
        "the reference): the bug is in how the engine handles gradients after computing them")


def test_an_optimizer_bug_is_placed_after_gradients_that_match() -> None:
    report = _caught(Trainer("clip_counts_replicas"), clip_grad_norm=0.5)
    assert report.located.splitlines()[1].endswith(
        "and the gradients before the optimizer match: the bug is in the optimizer step (clipping, the update, which "
        "parameters and replicas it steps)")


def test_a_runner_that_records_nothing_is_told_how() -> None:
    class Unrecorded(Trainer):
        def train(self, job: pc.Job) -> list[pc.StepResult]:
            return super().train(dataclasses.replace(job, boundaries=None))

    report = _caught(Unrecorded("mean_of_means"))
    assert report.located.splitlines()[1].startswith("within it, not located: the runner recorded no boundary values")
    assert "weighted (1.75, 1.75, 0.7, 0.7)" in report.hints["step 0: grad l1.weight"]  # the fit needs none


def test_data_parallel_steps_are_not_located_yet_and_say_so() -> None:
    report = _caught(Trainer("dp_not_averaged"), data_parallel=2, loss_reduction="mean", loss_fn=mean_ce)
    assert report.located.splitlines()[1] == ("within it, not located: with data_parallel=2 the boundary values and "
                                              "micro-batch shares of one step are not compared yet")


class SkipDropped(TrainingRunner):
    name = "skip_dropped"

    def sent_back(self, stage: Any, fwd: Any, in_grads: Any, mb: int) -> Any:
        return [None if src.stage is not None and stage.index - src.stage > 1 else grads
                for src, grads in zip(stage.inputs, in_grads)]


class MergedReversed(TrainingRunner):
    name = "merged_reversed"

    def merge(self, outputs: list[Any]) -> Any:
        return super().merge(outputs[::-1])


def _skip_one(runner: Any) -> pc.Report:
    entry = get("skip_one")
    args, kwargs = entry.inputs()
    style = entry.cut_styles[0]
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(entry.factory(style), args, kwargs, runner=runner, loss_fn=entry.loss_fn,
                             target=entry.target(), n_microbatches=4, steps=2, optimizer=sgd, **entry.cut(style))
    return caught.value.report


def test_a_dropped_skip_gradient_in_training_gets_the_one_step_checks_hint() -> None:
    report = _skip_one(SkipDropped())
    assert report.hints["step 0: grad a.fc.weight"].startswith("skip-connection gradient dropped: the gradients match "
                                                              "a run in which the gradient of 'a_norm' (stage 0 -> "
                                                              "stage 2) never flows back")
    assert report.located.splitlines()[1].startswith("within it: stage 0 received the gradient of 'a_norm' in the "
                                                     "backward: micro-batches 0, 1, 2, 3 differ")


def test_outputs_merged_out_of_order_in_training_get_the_one_step_checks_hint() -> None:
    report = _skip_one(MergedReversed())
    assert report.hints["step 0: output"].startswith("outputs permuted across micro-batches: merged position <- "
                                                     "micro-batch: 0<-3, 1<-2, 2<-1, 3<-0")
    assert "the bug is in how the engine merges the micro-batches' outputs" in report.located


def test_a_tied_weight_left_unsynchronised_in_training_gets_the_one_step_checks_hint(pipecheck_world: Any) -> None:
    report = _caught("torch", world=pipecheck_world(2))
    assert report.hints["step 0: grad emb.weight"].startswith("tied parameter not synchronised: gradient equals stage "
                                                              "0's share only")
    assert report.located.splitlines()[1].startswith("within it, not located: runner 'torch' cuts the model itself")


def test_the_distributed_runtime_returns_each_steps_boundary_values_numbered_across_the_run(pipecheck_world: Any
                                                                                             ) -> None:
    """What a failing check's re-run compares: the runtime's values are the reference runner's, keyed alike."""
    x, y = tokens(pad=3)
    job = pc.Job(make_tied_lm, (x,), loss_fn=token_ce, target=y, n_microbatches=4, world=pipecheck_world(2),
                 training=dataclasses.replace(pc.Job(make_tied_lm, (x,)).training, steps=2, accumulation_steps=2,
                                              optimizer=sgd, loss_reduction="token_mean"))
    recorded: dict[str, Any] = {}
    for name in ("reference", "distributed"):
        boundaries = Boundaries()
        for result in runner_named(name).load().train(dataclasses.replace(job, boundaries=boundaries)):
            boundaries.imported(result.boundaries)  # the runtime's, recorded on its ranks
        recorded[name] = boundaries.values
    assert set(recorded["distributed"]) == set(recorded["reference"])
    assert {mb for _, mb, _, _ in recorded["reference"]} == set(range(2 * 2 * 4))  # 2 steps x 2 schedule steps x 4
    for key, value in recorded["reference"].items():
        torch.testing.assert_close(recorded["distributed"][key], value, rtol=1e-5, atol=1e-6, msg=str(key))

