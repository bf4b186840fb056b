"""Planted training bugs: each is caught, and located within its first failing optimizer step (the stage,
the micro-batches, forward or backward, and the hint); each correct twin passes the same check.

- token mean of means (in this process, and on pipecheck's distributed runtime): the gradients' per-micro-batch
  weights are fitted and named, and said to be the micro-batches' own token means;
- a receive buffer stage 1 keeps across optimizer steps, whose gradient hook fires again on the next one:
  step 0 matches, and step 1 is located where the gradient stage 1 sent back arrives twice at stage 0.
"""

from __future__ import annotations

from typing import Any

import pytest
from _training_models import adamw, make_untied_lm, sgd, token_ce, tokens

import pipecheck as pc

from .training import (
    DistributedTokenMeanOfMeans,
    PersistentRecvBuffer,
    TokenMeanOfMeans,
    TrainingRunner,
)

# tokens(pad=3): micro-batches 0 and 1 hold 4 valid tokens each, 2 and 3 hold 10 (28 in the step), so the
# token mean of means weighs them 28 / (4 x 4) = 1.75 and 28 / (4 x 10) = 0.7 where eager weighs 1 each.
WEIGHTS = "(1.75, 1.75, 0.7, 0.7)"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


def _train(runner: Any, **settings: Any) -> pc.Report:
    x, y = tokens(pad=3)
    options = {"loss_fn": token_ce, "target": y, "n_microbatches": 4, "steps": 3, "optimizer": sgd,
               "loss_reduction": "token_mean", **settings}
    return pc.assert_equivalent(make_untied_lm, (x,), runner=runner, **options)


def _caught(runner: Any, **settings: Any) -> pc.Report:
    with pytest.raises(pc.EquivalenceError) as caught:
        _train(runner, **settings)
    report = caught.value.report
    assert str(caught.value).splitlines()[1:3] == report.located.splitlines()  # said above the table
    return report


@pytest.mark.parametrize("twin", [TrainingRunner(), PersistentRecvBuffer(fixed=True)], ids=lambda r: r.__name__)
@pytest.mark.parametrize("optimizer", [sgd, adamw])
def test_the_correct_twins_pass(twin: Any, optimizer: Any) -> None:
    assert _train(twin, optimizer=optimizer).ok


def _token_mean_of_means_located(report: pc.Report, weights: str = WEIGHTS) -> None:
    assert report.located.startswith("first divergence: optimizer step 0 of 3, in its loss")
    found = report.first_divergence
    assert found is not None
    assert (found.optimizer_step, found.stage, found.direction, found.point, found.value) == \
        (0, 1, "backward", "grad received", "output")
    assert found.microbatches == (0, 1, 2, 3)
    assert "within it: stage 1 received the gradient of 'output' in the backward: micro-batches 0, 1, 2, 3 differ" \
        in report.located
    hint = report.hints["step 0: grad emb.weight"]
    assert hint.startswith(f"token mean of means: the gradient is the micro-batches' eager gradients weighted {weights}")
    assert "divided by its own valid tokens" in hint
    assert report.hints["step 0: loss"].startswith("the loss is the micro-batches' losses weighted as the gradients are")


def test_a_token_mean_of_means_is_located_with_the_micro_batches_weights() -> None:
    _token_mean_of_means_located(_caught(TokenMeanOfMeans()))


def test_a_token_mean_of_means_over_accumulation_steps_fits_every_micro_batch_of_the_step() -> None:
    x0, y0 = tokens(pad=3)
    x1, y1 = tokens(pad=1, seed=1)
    batches = [pc.Batch((x0,), target=y0), pc.Batch((x1,), target=y1)] * 2
    report = _caught(TokenMeanOfMeans(), steps=2, accumulation_steps=2, batches=batches)
    assert "within it (schedule step 0 of 2): stage 1 received the gradient of 'output'" in report.located
    assert report.first_divergence is not None and report.first_divergence.schedule_step == 0
    hint = report.hints["step 0: grad l1.weight"]
    # 4, 4, 10, 10 valid tokens, then 8, 8, 10, 10: 64 in the step's 8 micro-batches
    assert "weighted (2, 2, 0.8, 0.8, 1, 1, 0.8, 0.8)" in hint and "(4, 4, 10, 10, 8, 8, 10, 10)" in hint, hint


def test_a_token_mean_of_means_on_the_distributed_runtime_is_located_too(pipecheck_world: Any) -> None:
    world = pipecheck_world(2)
    assert _train(DistributedTokenMeanOfMeans(fixed=True), world=world).ok
    _token_mean_of_means_located(_caught(DistributedTokenMeanOfMeans(), world=world))


def test_a_receive_buffer_whose_hook_fires_again_is_located_in_stage_1s_backward_of_step_1() -> None:
    report = _caught(PersistentRecvBuffer())
    assert report.located.startswith("first divergence: optimizer step 1 of 3 (step 0 matches), in its gradients "
                                     "before the optimizer: step 1: grad emb.weight")
    found = report.first_divergence
    assert found is not None
    assert (found.optimizer_step, found.stage, found.direction, found.point) == (1, 0, "backward", "grad received")
    assert found.microbatches == (0, 1, 2, 3)
    within = report.located.splitlines()[1]
    assert within.startswith("within it: stage 0 received the gradient of 'tanh' in the backward: micro-batches "
                             "0, 1, 2, 3 differ"), within
    assert ("stage 1 sent its gradient back right: it arrived 2 times what was sent (delivered twice: a gradient "
            "hook or a receive registered again") in within
    assert "scaled by 2" in report.hints["step 1: grad l1.weight"]  # the weight fit: every micro-batch twice
    assert all(row.ok for row in report.rows if row.name.startswith("step 0: "))
