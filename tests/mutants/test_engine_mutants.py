"""Planted bugs in the engine adapters: each is caught by the check, naming the tensor, with the hint,
and located after the dataflow (every boundary value the ranks recorded matches).

- DeepSpeed layer list whose TiedLayerSpec pair is replaced by two untied layers (the reference
  keeps the tie): every replica keeps only its own stage's share.
- runner="deepspeed" whose layer chain forgets DeepSpeed's tied modules: the same, on tiny_gpt.
- runner="torchtitan" that gives torchtitan's schedule each micro-batch's loss undivided
  (torchtitan sums micro-batch gradients): gradients n_microbatches times too large.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from pipecheck.fixtures import get

import pipecheck as pc

# private: planted bugs in the engine adapters are subclasses of them
from pipecheck._runners.deepspeed.driver import (
    DeepSpeedLayersRunner,
    DeepSpeedRunner,
    build_layer_list,
)
from pipecheck._runners.torchtitan.driver import TorchtitanRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ranks unpickle _engine_models by name
import _engine_models as em  # noqa: E402

TIED = "tied parameter not synchronised"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason='needs DeepSpeed: pip install "torch-pipecheck[deepspeed]"')
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                      reason='needs torchtitan: pip install "torch-pipecheck[torchtitan]"')


class UntiedLayers(DeepSpeedLayersRunner):
    """DeepSpeed builds the layer list with its TiedLayerSpec pair untied."""

    def engine_layers(self) -> list[Any]:
        return em.tied_layers(untied=True)[0]


def _in_gradient_handling(report: pc.Report) -> None:
    """Every value the stages exchanged matches the engine's own split run in one process: the report
    puts the bug after the dataflow."""
    assert report.first_divergence is None
    assert report.located.startswith("no boundary value diverges")
    assert "how the engine handles gradients after computing them" in report.located


def _caught(run: Any) -> pc.Report:
    with pytest.raises(pc.EquivalenceError) as caught:
        run()
    return caught.value.report


@needs_deepspeed
def test_deepspeed_layer_list_with_its_tied_spec_untied_is_caught(pipecheck_world: Any) -> None:
    layers, tokens, target = em.tied_layers()
    runner = UntiedLayers(layers, num_stages=2)
    report = _caught(lambda: pc.assert_equivalent(
        functools.partial(build_layer_list, layers, runner.parts), (tokens,), runner=runner, loss_fn=em.lm_loss,
        target=target, n_microbatches=4, world=pipecheck_world(2)))
    failing = {row.name for row in report.failures}
    assert {"grad tied_modules.embed.weight (replica in stage 0)",
            "grad tied_modules.embed.weight (replica in stage 1)"} <= failing
    assert TIED in report.hints["grad tied_modules.embed.weight (replica in stage 1)"]
    _in_gradient_handling(report)


@needs_deepspeed
def test_deepspeed_split_without_its_tied_modules_is_caught(pipecheck_world: Any) -> None:
    entry = get("tiny_gpt")
    args, kwargs = entry.inputs()
    report = _caught(lambda: pc.assert_equivalent(
        entry.factory(), args, kwargs, runner=DeepSpeedRunner(em.UntiedSplit), loss_fn=entry.loss_fn,
        target=entry.target(), n_microbatches=4, world=pipecheck_world(4)))
    assert "grad tok_emb.weight (replica in stage 3)" in {row.name for row in report.failures}
    assert TIED in report.hints["grad tok_emb.weight"]
    _in_gradient_handling(report)


@needs_torchtitan
def test_torchtitan_losses_left_undivided_are_caught(pipecheck_world: Any) -> None:
    x, y = em.tokens()
    report = _caught(lambda: pc.assert_equivalent(
        em.Decoder, (x,), runner=TorchtitanRunner(scale_loss=False), loss_fn=em.lm_loss, target=y,
        n_microbatches=4, split_spec={"layers.2": pc.SplitPoint.BEGINNING}, world=pipecheck_world(2)))
    assert "grad tok_embeddings.weight" in {row.name for row in report.failures}
    assert "gradient scaling: gradient is n_microbatches (=4) times too large" in \
        report.hints["grad tok_embeddings.weight"]
    _in_gradient_handling(report)
    assert "every gradient crossing a stage is 4 times the reference's" in report.located
