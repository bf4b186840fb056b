"""runner="torchtitan" and pc.engines.torchtitan.check: torchtitan's module split and schedule builder.

Without torchtitan: module names derived from pipecheck's cut, names torchtitan would silently
ignore, ModuleList renumbering mapped back. With it (``pip install "torch-pipecheck[torchtitan]"``):
models written the torchtitan way match eager under 1F1B, GPipe, interleaved and "V" schedules;
what torchtitan computes wrong without an error (tied weights, parameters of the root module, a
value the forward does not pass along) fails the check; a forward that cannot run without a
stage's removed modules is refused with the reason, and the World stays up.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipecheck.fixtures import get

import pipecheck as pc
from pipecheck._runners.torchtitan.driver import (
    module_names_per_stage,
    name_problems,
    titan_schedule,
)
from pipecheck._runners.torchtitan.rank import original_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ranks unpickle _engine_models by name
import _engine_models as em  # noqa: E402

N_MICROBATCHES = 4
BEGIN = pc.SplitPoint.BEGINNING


def _names(name: str) -> list[list[str]]:
    entry = get(name)
    args, kwargs = entry.inputs()
    style = entry.cut_styles[0]
    model = entry.factory(style)()
    return module_names_per_stage(model, pc.split(model, args, kwargs, **entry.cut(style)))


# --- no torchtitan needed -----------------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [
    ("mlp", [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "head"]]),
    ("titan_lm", [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2", "norm", "output"]]),
    ("alias_reuse", [["proj", "shared"], ["mid"], ["shared", "head"]]),  # one module called on two stages
    ("tiny_gpt", [["tok_emb"], ["blocks.0"], ["blocks.1"], ["blocks.2", "ln_f", "lm_head"]]),  # pos_emb: the root's
])
def test_module_names_per_stage_are_derived_from_the_cut(name: str, expected: list[list[str]]) -> None:
    assert _names(name) == expected


def test_a_cut_inside_a_module_torchtitan_keeps_whole_is_refused() -> None:
    with pytest.raises(pc.EngineError, match="the cut runs through 'encoder' in stages 0, 1, 2") as caught:
        _names("nested_spec")
    assert (caught.value.engine, caught.value.stage) == ("torchtitan", 0)


@pytest.mark.parametrize("names,expected", [
    pytest.param([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]], [],
                 id="valid"),
    pytest.param([["tok_embeddings", "layers"], ["norm", "output"]], ["'layers' names a whole ModuleDict: "
                 "torchtitan empties it on every stage"], id="whole-container"),
    pytest.param([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm.weight", "output"]],
                 ["'norm.weight' is nested inside 'norm': torchtitan ignores nested names",
                  "modules holding parameters are on no stage, so torchtitan drops them: ['norm']"], id="nested"),
    pytest.param([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.9", "norm", "output"]],
                 ["'layers.9': layers has no entry '9'", "drops them: ['layers.3']"], id="missing-entry"),
    pytest.param([["embed", "layers.0", "layers.1", "layers.2", "layers.3"], ["norm", "output"]],
                 ["'embed' is not a child of Decoder", "drops them: ['tok_embeddings']"], id="unknown"),
])
def test_names_torchtitan_would_silently_ignore_are_problems(names: list[list[str]], expected: list[str]) -> None:
    found = "\n".join(name_problems(em.Decoder(), names))
    assert all(text in found for text in expected), found
    assert bool(found) == bool(expected)


def test_a_stage_module_list_is_renumbered_back_to_the_model() -> None:
    original = original_names(em.Decoder(as_list=True), ["layers.2", "layers.3", "norm", "output"])
    assert original("layers.0.attn.weight") == "layers.2.attn.weight"
    assert original("layers.1.mlp.bias") == "layers.3.mlp.bias"
    assert original("norm.weight") == "norm.weight"
    dict_original = original_names(em.Decoder(), ["layers.2", "layers.3"])
    assert dict_original("layers.2.attn.weight") == "layers.2.attn.weight"  # a ModuleDict keeps its keys


@pytest.mark.parametrize("schedule,per_rank,expected", [
    ("1f1b", 1, "1F1B"), ("gpipe", 1, "GPipe"), ("gpipe", 2, "LoopedBFS"), ("interleaved", 2, "Interleaved1F1B"),
    ("zb", 1, "InterleavedZeroBubble"), ("zbv", 2, "ZBVZeroBubble"), ("ZBVZeroBubble", 2, "ZBVZeroBubble"),
])
def test_schedule_names(schedule: str, per_rank: int, expected: str) -> None:
    assert titan_schedule(schedule, per_rank) == expected


# --- with torchtitan ---------------------------------------------------------------------------------------

needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                      reason='needs torchtitan: pip install "torch-pipecheck[torchtitan]"')
TWO = {"layers.2": BEGIN}
FOUR = {"layers.1": BEGIN, "layers.2": BEGIN, "layers.3": BEGIN}


def _check(world: pc.World, model: Any, split_spec: dict[str, Any] = TWO, **options: Any) -> pc.Report:
    x, y = em.tokens()
    return pc.assert_equivalent(model, (x,), runner="torchtitan", loss_fn=em.lm_loss, target=y,
                                n_microbatches=N_MICROBATCHES, split_spec=split_spec, world=world, **options)


@needs_torchtitan
@pytest.mark.parametrize("model,split_spec,schedule,per_rank", [
    pytest.param(em.Decoder, TWO, "1f1b", 1, id="dict-1f1b"),
    pytest.param(em.list_decoder, TWO, "1f1b", 1, id="list-1f1b"),
    pytest.param(em.Decoder, TWO, "gpipe", 1, id="dict-gpipe"),
    pytest.param(em.list_decoder, FOUR, "interleaved", 2, id="list-interleaved"),
    pytest.param(em.Decoder, FOUR, "ZBVZeroBubble", 2, id="dict-zbv"),
    pytest.param(em.list_decoder, TWO, "zb", 1, id="list-zero-bubble"),
    pytest.param(em.Decoder, FOUR, "dualpipev", 2, id="dict-dualpipev"),
])
def test_a_torchtitan_style_model_matches_eager(pipecheck_world: Any, model: Any, split_spec: dict[str, Any],
                                                schedule: str, per_rank: int) -> None:
    report = _check(pipecheck_world(2), model, split_spec, schedule=schedule, stages_per_rank=per_rank)
    assert report.ok
    assert report.num_stages == 2 * per_rank


@needs_torchtitan
def test_a_keyword_input_reaches_every_stage_and_its_gradient_comes_back(pipecheck_world: Any) -> None:
    x, y = em.tokens()
    gate = em._randn(em.BATCH, em.SEQ, em.WIDTH, seed=9).requires_grad_()  # torchtitan reads it on stage 1
    report = pc.assert_equivalent(em.GatedDecoder, (x,), {"gate": gate}, runner="torchtitan", loss_fn=em.lm_loss,
                                  target=y, n_microbatches=N_MICROBATCHES, split_spec=TWO, world=pipecheck_world(2))
    assert report.ok
    assert report.row("grad input gate").numel == gate.numel()


@needs_torchtitan
def test_tied_weights_are_never_summed(pipecheck_world: Any) -> None:
    entry = get("titan_lm")
    args, kwargs = entry.inputs()
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(entry.factory(), args, kwargs, runner="torchtitan", loss_fn=entry.loss_fn,
                             target=entry.target(), n_microbatches=N_MICROBATCHES, world=pipecheck_world(3))
    report = caught.value.report
    assert {row.name for row in report.failures} == {
        "grad tok_embeddings.weight", "grad tok_embeddings.weight (replica in stage 0)",
        "grad tok_embeddings.weight (replica in stage 2)"}
    assert "tied parameter not synchronised" in report.hints["grad tok_embeddings.weight (replica in stage 2)"]


@needs_torchtitan
def test_a_root_parameter_used_on_two_stages_keeps_one_share_per_stage(pipecheck_world: Any) -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _check(pipecheck_world(2), em.RootScaleDecoder)
    failing = {row.name for row in caught.value.report.failures}
    assert failing == {"grad scale", "grad scale (replica in stage 0)", "grad scale (replica in stage 1)"}
    assert "tied parameter not synchronised" in caught.value.report.hints["grad scale"]


@needs_torchtitan
def test_a_value_the_forward_does_not_pass_along_fails_silently_and_the_check_says_so(pipecheck_world: Any) -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _check(pipecheck_world(2), em.SkipDecoder)
    failing = {row.name for row in caught.value.report.failures}
    assert {"output", "loss", "grad tok_embeddings.weight"} <= failing
    # torchtitan's own split run in one process drops the value too: the line says the split may be the cause
    located = caught.value.report.located
    assert located.startswith("no boundary value diverges from runner 'torchtitan''s own split run in one process")
    assert "either that split itself computes the model wrong" in located


@needs_torchtitan
def test_check_with_module_names_cuts_where_the_names_say(pipecheck_world: Any) -> None:
    x, y = em.tokens()
    names = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]
    report = pc.engines.torchtitan.check(em.Decoder, (x,), module_names_per_stage=names, loss_fn=em.lm_loss,
                                         target=y, n_microbatches=N_MICROBATCHES, world=pipecheck_world(2))
    assert report.ok
    assert report.row("grad layers.1.attn.weight").stages == (1,)


# --- training: torchtitan's schedule across optimizer steps, its own clipping ------------------------------


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def token_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")


@needs_torchtitan
@pytest.mark.parametrize("model,split_spec,schedule,per_rank", [
    pytest.param(em.Decoder, TWO, "1f1b", 1, id="dict-1f1b"),
    pytest.param(em.list_decoder, FOUR, "interleaved", 2, id="list-interleaved"),
])
def test_torchtitan_trains_with_its_pipeline_clipping_like_eager(pipecheck_world: Any, model: Any,
                                                                 split_spec: dict[str, Any], schedule: str,
                                                                 per_rank: int) -> None:
    x, y = em.tokens()
    y[:2, :3] = -100  # padding: the token mean counts the valid tokens of the whole optimizer step
    report = pc.assert_equivalent(model, (x,), runner="torchtitan", loss_fn=token_lm_loss, target=y,
                                  loss_reduction="token_mean", n_microbatches=N_MICROBATCHES, split_spec=split_spec,
                                  schedule=schedule, stages_per_rank=per_rank, world=pipecheck_world(2), steps=3,
                                  accumulation_steps=2, optimizer=adamw, clip_grad_norm=0.05)
    assert report.ok
    assert report.row("step 2: param output.weight").ok and report.row("step 2: grad tok_embeddings.weight").ok


@needs_torchtitan
def test_torchtitan_training_refuses_what_it_cannot_run(pipecheck_world: Any) -> None:
    x, y = em.tokens()
    options = dict(runner="torchtitan", loss_fn=em.lm_loss, n_microbatches=N_MICROBATCHES, split_spec=TWO,
                   steps=2, optimizer=adamw)
    with pytest.raises(pc.InputError, match="torchtitan composes data parallel through FSDP/DDP"):
        pc.assert_equivalent(em.Decoder, (x,), target=y, data_parallel=2, world=pipecheck_world(4), **options)
    longer = torch.cat([x, x], dim=1)
    with pytest.raises(pc.InputError, match="trains on batches of one shape"):
        pc.assert_equivalent(em.Decoder, (x,), batches=[pc.Batch((x,), target=y), pc.Batch((longer,),
                             target=torch.cat([y, y], dim=1))], world=pipecheck_world(2), **options)


@needs_torchtitan
def test_names_torchtitan_would_ignore_are_refused_before_any_rank_runs() -> None:
    x, y = em.tokens()
    names = [["tok_embeddings", "layers"], ["norm", "output"]]
    world = pc.World(2)
    try:
        with pytest.raises(pc.EngineError, match="names a whole ModuleDict"):
            pc.engines.torchtitan.check(em.Decoder, (x,), module_names_per_stage=names, loss_fn=em.lm_loss,
                                        target=y, n_microbatches=N_MICROBATCHES, world=world)
        assert world.pids == ()
    finally:
        world.close()


@needs_torchtitan
def test_a_forward_that_needs_removed_modules_is_refused_and_the_world_stays_up(pipecheck_world: Any) -> None:
    world = pipecheck_world(4)
    entry = get("mlp")
    args, kwargs = entry.inputs()
    world.run(em.rank_resources)  # started
    pids = world.pids
    with pytest.raises(pc.EngineError) as caught:
        pc.assert_equivalent(entry.factory(), args, kwargs, runner="torchtitan", n_microbatches=N_MICROBATCHES,
                             world=world)
    err = caught.value
    assert (err.engine, err.rank, err.stage) == ("torchtitan", 0, 0)
    assert str(err).startswith("stage 0 forward() fails with removed modules (TypeError: 'NoneType' object is "
                               "not callable)")
    assert world.pids == pids
