"""An engine that keeps pipecheck's randomness contract with public API only passes; its two planted
bugs (a recompute that does not restore the RNG state, masks of another micro-batch) fail where they
happen, each with a hint naming it."""

from __future__ import annotations

import pytest
import torch
from _training_models import make_dropout_net

import pipecheck as pc

from .random_draws import DrawingEngine

X = torch.randn(8, 8)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_an_engine_that_keeps_the_contract_passes(recompute: bool) -> None:
    report = pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=4, steps=2,
                                  runner=DrawingEngine(recompute=recompute))
    assert report.ok and "3 random ops drawn by pipecheck's randomness contract" in report.headline()


def test_a_recompute_that_does_not_restore_the_rng_state_fails_in_the_gradients_with_its_hint() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=4, steps=2,
                             runner=DrawingEngine(recompute=True, preserve_rng_state=False))
    report = caught.value.report
    assert report.row("step 0: output").ok and report.row("step 0: loss").ok
    assert not report.row("step 0: grad l0.weight").ok
    hint = " ".join(report.hints.values())
    assert "recomputes a forward with fresh random numbers" in hint and "preserve_rng_state=False" in hint


def test_masks_drawn_for_another_microbatch_fail_in_the_outputs_naming_the_microbatches() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=4, runner=DrawingEngine(shift=1))
    report = caught.value.report
    assert not report.row("output").ok
    hint = " ".join(report.hints.values())
    assert ("micro-batch 0 drew micro-batch 1's, micro-batch 1 drew micro-batch 2's, micro-batch 2 drew "
            "micro-batch 3's, micro-batch 3 drew micro-batch 0's random numbers") in hint, report.hints
