"""The HuggingFace zoo (tiny GPT-2, Llama, Mixtral, BERT, T5; nothing downloaded) checked with no tracer argument:
``tracer="auto"`` falls back to torch.export, which traces them, and pipecheck's runners match eager.
torch.distributed.pipelining's own results on them are checked too, as the README reports them."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _torch_findings import HF_TIED_CRASH, HF_TIED_RUNS, ROTARY, ROTARY_NO_GRAD, ROTARY_STAGE  # noqa: E402
from pipecheck.fixtures import HF_ZOO, get, hf  # noqa: E402

import pipecheck as pc  # noqa: E402

N_MICROBATCHES = 4


def check(name: str, runner: str, world: Any = None) -> pc.Report:
    entry = get(name)
    args, kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory("spec"), args, kwargs, runner=runner, world=world,
                                n_microbatches=N_MICROBATCHES, **entry.cut("spec"))


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():  # torch's export and pipeline() warn about their own internals
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("name", [entry.name for entry in HF_ZOO])
def test_hf_models_match_on_the_reference_and_the_runtime(pipecheck_world: Any, name: str) -> None:
    for runner, world in (("reference", None), ("distributed", pipecheck_world(2))):
        report = check(name, runner, world)
        assert report.ok and report.tracer == "export" and report.num_stages == 2, (runner, report)
        assert "split by export" in report.headline()
        if runner == "distributed" and name in TIED:  # each stage's copy of the tie holds the full gradient
            replicas = {row.name for row in report.rows if row.name.startswith(f"grad {TIED[name]} (replica")}
            assert replicas == {f"grad {TIED[name]} (replica in stage {s})" for s in (0, 1)}, replicas
        if name in MOE:  # every router's and expert bank's gradient is compared, each on the stage that holds it
            moe = {row.name: row.stages for row in report.rows if ".mlp." in row.name}
            assert moe == MOE[name], (runner, moe)


TIED = {"hf_gpt2": "transformer.wte.weight", "hf_bert": "bert.embeddings.word_embeddings.weight"}
MOE = {"hf_mixtral": {f"grad model.layers.{layer}.mlp.{param}": (layer // 2,) for layer in range(4)
                      for param in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")}}


def test_mixtral_on_transformers_default_grouped_mm_experts_matches_on_an_exact_float64_truth(
        pipecheck_world: Any) -> None:
    """torch._grouped_mm has no float64 kernel on CPU: pipecheck's truth computes it with its own."""
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4).transpose(-2, -1),
                          offs=torch.tensor([4], dtype=torch.int32))
    except (AttributeError, RuntimeError):
        pytest.skip("this torch has no torch._grouped_mm on CPU")
    entry = get("hf_mixtral")
    args, kwargs = entry.inputs()
    factory = functools.partial(hf.mixtral, experts="grouped_mm")
    for runner, world in (("reference", None), ("distributed", pipecheck_world(2))):
        report = pc.assert_equivalent(factory, args, kwargs, runner=runner, world=world,
                                      n_microbatches=N_MICROBATCHES, **entry.cut("spec"))
        assert report.ok and report.num_stages == 2 and report.power < 1e-4, (runner, report)
        assert any("torch.ops.aten._grouped_mm with pipecheck's float64 implementation" in note
                   for note in report.notes), report.notes


# Before transformers 5.24 torch fails on Llama's no_grad rotary embedding first (_torch_findings).
ROTARY_FIRST = pytest.mark.skipif(ROTARY_NO_GRAD, reason="transformers < 5.24: torch fails on the no_grad rotary "
                                  "embedding first (test_torch_calls_the_rotary_embedding_without_its_inputs)")


@pytest.mark.parametrize("name,tied", [("hf_gpt2", "transformer.wte.weight"),
                                       ("hf_bert", "bert.embeddings.word_embeddings.weight"),
                                       pytest.param("hf_llama", "model.embed_tokens.weight", marks=ROTARY_FIRST)])
def test_torch_leaves_the_tied_embeddings_unsynchronised(pipecheck_world: Any, name: str, tied: str) -> None:
    if not HF_TIED_RUNS:  # torch before 2.13 fails stage 1 before any step (_torch_findings)
        with pytest.raises(pc.EngineError) as refused:
            check(name, "torch", pipecheck_world(2))
        assert str(refused.value).splitlines()[0] == HF_TIED_CRASH
        return
    with pytest.raises(pc.EquivalenceError) as caught:
        check(name, "torch", pipecheck_world(2))
    failing = {row.name for row in caught.value.report.failures}  # the tie's gradient alone: every other row matches
    assert failing == {f"grad {tied}{replica}" for replica in ("", " (replica in stage 0)", " (replica in stage 1)")}
    assert "tied parameter not synchronised" in caught.value.report.hints[f"grad {tied}"]


@ROTARY_FIRST
def test_torch_matches_mixtral_whose_embedding_is_untied(pipecheck_world: Any) -> None:
    if not HF_TIED_RUNS:  # as GPT-2 and BERT: torch before 2.13 fails stage 1 before any step (_torch_findings)
        with pytest.raises(pc.EngineError) as refused:
            check("hf_mixtral", "torch", pipecheck_world(2))
        assert str(refused.value).splitlines()[0] == HF_TIED_CRASH
        return
    assert check("hf_mixtral", "torch", pipecheck_world(2)).ok


def test_torch_drops_t5s_encoder_output_and_is_refused(pipecheck_world: Any) -> None:
    with pytest.raises(pc.EngineError) as caught:
        check("hf_t5", "torch", pipecheck_world(2))
    assert str(caught.value).splitlines()[0] == (
        "torch returns only last-stage outputs; output['encoder_last_hidden_state'] is stage 0's")


@pytest.mark.parametrize("name", ["hf_llama", "hf_mixtral"])
def test_torch_calls_the_rotary_embedding_without_its_inputs(pipecheck_world: Any, name: str) -> None:
    """torch's pipeline() outlines the no_grad rotary embedding twice, the first call without arguments:
    fx's interpreter runs out of them (a bare StopIteration, reported by the message above it)."""
    if not ROTARY_NO_GRAD:
        pytest.skip("transformers >= 5.24: the rotary embedding is no longer under no_grad and torch no longer "
                    "outlines it (_torch_findings)")
    with pytest.raises(pc.EngineError) as caught:
        check(name, "torch", pipecheck_world(2))
    first = str(caught.value).splitlines()[0]
    assert first.startswith(ROTARY), first  # worded by release (_torch_findings)
    assert caught.value.rank == 0 and caught.value.stage == ROTARY_STAGE
