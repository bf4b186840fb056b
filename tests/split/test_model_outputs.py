"""HuggingFace models as users configure them: a generation cache in the outputs (use_cache at its
default), and the model's own loss (labels=) as the check's loss."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pipecheck as pc  # noqa: E402

IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))


def llama() -> torch.nn.Module:
    """Llama as its config class makes it: use_cache=True, so forward returns a DynamicCache."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def t5() -> torch.nn.Module:
    """T5 with its default use_cache=True: an EncoderDecoderCache (dropout off: randomness is refused)."""
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0))


CASES = {
    "llama": (llama, {}, {"model.layers.1": pc.SplitPoint.BEGINNING}, "DynamicCache", ["logits"]),
    "t5": (t5, {"decoder_input_ids": IDS}, {"decoder.block.0": pc.SplitPoint.BEGINNING}, "EncoderDecoderCache",
           ["logits", "encoder_last_hidden_state"]),
}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():  # torch's export warns about its own internals
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("name", list(CASES))
def test_a_generation_cache_in_the_outputs_is_left_out_with_a_note(pipecheck_world: Any, name: str) -> None:
    factory, kwargs, spec, cache, compared = CASES[name]
    for runner, world in (("reference", None), ("distributed", pipecheck_world(2))):
        report = pc.assert_equivalent(factory, (IDS,), kwargs, split_spec=spec, n_microbatches=2, runner=runner,
                                      world=world)
        assert report.ok, report
        assert [row.name for row in report.rows if row.name.startswith("output")] == [
            f"output[{key!r}]" for key in compared]
        assert report.notes == [
            f"output['cache'] ({cache}, the generation cache that use_cache=True builds) is left out of the "
            "comparison: the loss cannot read it and no stage hands it on; the keys and values it holds feed the "
            "attention outputs, which are compared. Fix, to leave it unbuilt: use_cache=False in the model's config "
            "or call."], report.notes


def test_the_users_model_keeps_its_class_and_its_cache() -> None:
    model = llama()
    pipe = pc.split(model, (IDS,), split_spec={"model.layers.1": pc.SplitPoint.BEGINNING})
    assert type(model) is transformers.LlamaForCausalLM  # only pipecheck's copy is adapted
    assert isinstance(model(IDS).cache, transformers.DynamicCache)
    assert pipe.num_stages == 2
    outputs = pc.DetachExecutor(pipe).step((IDS,)).outputs
    assert outputs.cache is None and outputs.logits.shape == (4, 8, 64)


def test_the_models_own_loss_is_the_checks_loss(pipecheck_world: Any) -> None:
    spec = {"model.layers.1": pc.SplitPoint.BEGINNING}
    for runner, world in (("reference", None), ("distributed", pipecheck_world(2))):
        report = pc.assert_equivalent(llama, (IDS,), {"labels": IDS}, loss_fn=pc.losses.model_loss, split_spec=spec,
                                      n_microbatches=2, runner=runner, world=world)
        rows = {row.name: row for row in report.rows}
        assert report.ok and rows["output['loss']"].shape == (2,) and rows["loss"].shape == (), report
    # the check's loss is the mean of the micro-batches' own, as the reference computes it
    model = llama()
    pipe = pc.split(model, (IDS,), {"labels": IDS}, split_spec=spec)
    result = pc.DetachExecutor(pipe).step((IDS,), {"labels": IDS}, loss_fn=pc.losses.model_loss, n_microbatches=2)
    halves = [model(IDS[i:i + 2], labels=IDS[i:i + 2]).loss for i in (0, 2)]
    torch.testing.assert_close(result.loss, torch.stack(halves).mean())


@pytest.mark.parametrize("outputs, found", [
    ({"loss": torch.tensor(2.0), "logits": torch.zeros(2)}, 2.0),
    ((torch.tensor(3.0), torch.zeros(2)), 3.0),
])
def test_model_loss_reads_the_loss_where_models_put_it(outputs: Any, found: float) -> None:
    assert float(pc.losses.model_loss(outputs, None)) == found


def test_model_loss_without_labels_names_the_fix() -> None:
    with pytest.raises(pc.LossError, match=r"no loss in the model's outputs \(CausalLMOutputWithPast with "
                                           r"\['logits'\]\)\. Fix: pass the labels .* kwargs=\{'labels': ids\}"):
        pc.assert_equivalent(llama, (IDS,), loss_fn=pc.losses.model_loss,
                             split_spec={"model.layers.1": pc.SplitPoint.BEGINNING}, runner="reference")


def test_torch_runner_names_its_contiguity_bug(pipecheck_world: Any) -> None:
    """torch.distributed.pipelining sends a non-contiguous rotary embedding (an expand) at Llama's cut."""
    with pytest.raises(pc.EngineError) as caught:
        pc.assert_equivalent(functools.partial(llama), (IDS,), split_spec={"model.layers.1": pc.SplitPoint.BEGINNING},
                             n_microbatches=2, runner="torch", world=pipecheck_world(2))
    lines = str(caught.value).splitlines()
    if lines[0] == "RuntimeError: only Tensors of floating point dtype can require gradients":
        return  # torch 2.10 fails earlier, making an integer value at the cut require grad (measured)
    assert lines[0] == "RuntimeError: input tensor has to be contiguous", lines
    assert lines[1].startswith("This is torch.distributed.pipelining's bug, not your model's"), lines
