"""runner="megatron": Megatron Core's pipeline schedules (1F1B, interleaved) on CPU and gloo, with
what Megatron cannot run refused before any rank starts. Needs ``pip install "torch-pipecheck[megatron]"``
for the checks that run it; the refusals run without it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import pipecheck as pc
from pipecheck.engines import megatron as pcm
from pipecheck.engines.megatron import MegatronRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ranks unpickle _megatron_models by name
import _megatron_models as mm  # noqa: E402

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason='needs megatron-core: pip install "torch-pipecheck[megatron]"')
TOKENS = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0))
X = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))


def _mlp_check(runner: object, schedule: str = "1f1b", stages_per_rank: int = 1) -> pc.Report:
    return pc.assert_equivalent(mm.mlp, (X,), runner=runner, n_microbatches=4, schedule=schedule,
                                stages_per_rank=stages_per_rank, policy=pc.policies.balanced_nodes(2 * stages_per_rank))


@needs_megatron
def test_a_tied_embedding_matches_through_megatron_s_1f1b_and_finalize_model_grads() -> None:
    report = pc.assert_equivalent(mm.TiedLM, (TOKENS,), runner="megatron", n_microbatches=4)
    replicas = [row.name for row in report.rows if "replica" in row.name]
    assert report.ok and replicas == ["grad emb.weight (replica in stage 0)", "grad emb.weight (replica in stage 1)"]
    assert any(note.startswith("Megatron Core 0.16") and "forward_backward_pipelining_without_interleaving" in note
               and "batch_p2p_comm=True (Megatron's default)" in note for note in report.notes), report.notes


@needs_megatron
def test_the_interleaved_schedule_on_two_pipeline_ranks_with_megatron_s_defaults_is_a_mismatch() -> None:
    """Megatron Core's default batch_p2p_comm=True mixes up the previous and the next peer when they are
    one rank (NVIDIA/Megatron-LM#750, #1450): wrong values, no error. pipecheck keeps Megatron's default
    and reports the mismatch, the configuration and where it starts."""
    with pytest.raises(pc.EquivalenceError) as caught:
        _mlp_check("megatron", "interleaved", 2)
    report = caught.value.report
    failing = {row.name for row in report.failures}
    assert {"loss", "grad 0.weight", "grad 2.weight"} <= failing
    assert any("with_interleaving" in note and "batch_p2p_comm=True (Megatron's default)" in note
               for note in report.notes)
    assert re.match(r"first divergence: stage 1 received .* in the forward: micro-batches 2, 3 differ", report.located)
    assert _mlp_check(MegatronRunner(batch_p2p_comm=False), "interleaved", 2).ok  # the setting that avoids it
    assert _mlp_check(MegatronRunner(batch_p2p_comm=False), "Interleaved1F1B", 2).ok  # any name of the schedule


@needs_megatron
@pytest.mark.parametrize("rank_step,row", [
    (mm.rank_step_without_tied_sync, "grad emb.weight (replica in stage 0)"),
    (mm.rank_step_scaling_loss_twice, "grad l0.weight"),
], ids=["tied-replicas-not-summed", "loss-scaled-twice"])
def test_a_planted_adapter_bug_is_caught_on_the_tensor_it_breaks(rank_step: object, row: str) -> None:
    class Planted(MegatronRunner):
        pass

    Planted.rank_step = staticmethod(rank_step)  # type: ignore[assignment]
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(mm.TiedLM, (TOKENS,), runner=Planted(), n_microbatches=4)
    assert row in {failure.name for failure in caught.value.report.failures}


@pytest.mark.parametrize("model,options,error,message", [
    pytest.param(mm.Skip, {}, pc.EngineError, "stage 2 reads stage 0.a (a skip across stages)", id="skip"),
    pytest.param(mm.mlp, {"schedule": "gpipe"}, pc.InputError, "schedule='gpipe': Megatron Core runs '1f1b'",
                 id="schedule"),
    pytest.param(mm.mlp, {"schedule": "interleaved"}, pc.InputError,
                 "with stages_per_rank=1: Megatron runs 1F1B with one", id="interleaved-one-stage-per-rank"),
])
def test_what_megatron_cannot_run_is_refused_before_any_rank_starts(model: object, options: dict,
                                                                   error: type[Exception], message: str) -> None:
    options = {"policy": pc.policies.balanced_nodes(2), **options} if model is mm.mlp else options
    with pytest.raises(error, match=re.escape(message)):
        pc.assert_equivalent(model, (X,), runner=MegatronRunner(), n_microbatches=4, **options)


def test_the_cpu_shims_hold_only_inside_the_block_and_change_nothing_on_a_gpu() -> None:
    from pipecheck._runners.megatron.rank import cpu_shims

    before = torch.cuda.current_device, torch.cuda.synchronize
    with pytest.raises(RuntimeError, match="inside"), cpu_shims(torch.device("cpu")):
        made = torch.zeros(3, device="cuda"), torch.empty(2, device=torch.device("cuda", 0)), torch.ones(1, device=0)
        assert [t.device.type for t in made] == ["cpu"] * 3
        assert torch.cuda.current_device() == "cpu" and torch.cuda.synchronize() is None
        raise RuntimeError("inside")  # a failing schedule: the shims come off all the same
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    assert torch.zeros(1, device="cpu").device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")  # outside the block, CUDA is CUDA again
    with cpu_shims(torch.device("cuda")):  # on a GPU rank Megatron runs as it is
        assert (torch.cuda.current_device, torch.cuda.synchronize) == before


@needs_megatron
def test_a_rank_that_fails_after_megatron_s_set_up_leaves_the_world_clean_for_the_next_check() -> None:
    with pytest.raises(pc.EngineError, match="planted failure building the model on a rank") as caught:
        pc.assert_equivalent(mm.fails_on_ranks, (X,), runner="megatron", n_microbatches=4,
                             policy=pc.policies.balanced_nodes(2))
    assert caught.value.engine == "Megatron Core" and caught.value.rank in (0, 1)
    assert _mlp_check("megatron").ok  # Megatron's groups were torn down: it initialises again


@needs_megatron
@pytest.mark.parametrize("knobs", [{"deallocate_pipeline_outputs": True}, {"batch_p2p_comm": False}],
                         ids=["deallocate-outputs", "no-batched-p2p"])
def test_megatron_s_knobs_reach_its_schedule_and_a_correct_setting_matches(knobs: dict) -> None:
    report = _mlp_check(MegatronRunner(**knobs))
    assert report.ok
    name, value = next(iter(knobs.items()))
    assert any(f"{name}={value!r}" in note and f"{name}={value!r} (Megatron's default)" not in note
               for note in report.notes), report.notes


# --- a user's own chunks: pc.engines.megatron.check_chunks -----------------------------------------

LABELS = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(2))


def _chunks_check(provider: object = mm.gpt_chunk, num_stages: int = 2, **options: Any) -> pc.Report:
    return pcm.check_chunks(provider, TOKENS, num_stages=num_stages, loss_fn=mm.lm_loss, target=LABELS,
                            n_microbatches=4, **options)


@needs_megatron
def test_a_user_s_own_chunks_match_through_megatron_s_ddp_and_finalize_model_grads() -> None:
    report = _chunks_check()
    names = {row.name for row in report.rows}
    assert report.ok and {"grad 0.word_embeddings.weight (replica in stage 0)",
                          "grad 0.word_embeddings.weight (replica in stage 1)", "grad 1.final_norm.weight"} <= names
    assert not any("output_layer" in name for name in names)  # the last chunk's tied weight is the embedding's
    assert any("on the provider's own chunks, wrapped in its DistributedDataParallel" in note for note in report.notes)


@needs_megatron
def test_a_user_s_chunks_under_the_interleaved_schedule_on_two_ranks_show_megatron_s_default_as_a_mismatch() -> None:
    with pytest.raises(pc.EquivalenceError) as caught:
        _chunks_check(num_stages=4, schedule="interleaved", stages_per_rank=2)
    report = caught.value.report
    assert {"loss", "grad 3.final_norm.weight"} <= {row.name for row in report.failures}
    assert re.match(r"first divergence: stage 1 received 'input' \(from stage 0\) in the forward: micro-batches 2, 3 "
                    "differ", report.located), report.located
    assert _chunks_check(num_stages=4, schedule="interleaved", stages_per_rank=2, batch_p2p_comm=False).ok


@needs_megatron
def test_a_planted_chunks_adapter_bug_is_caught_on_the_tied_embedding() -> None:
    # private: a planted runner of a user's chunks needs the runner and the factory check_chunks builds
    from pipecheck._runners.megatron.chunks import MegatronChunksRunner, chunk_list_factory

    class Planted(MegatronChunksRunner):
        rank_step = staticmethod(mm.chunks_step_without_finalize)

    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(chunk_list_factory(mm.gpt_chunk, 2, 1), (TOKENS,), runner=Planted(mm.gpt_chunk, 2),
                             loss_fn=mm.lm_loss, target=LABELS, n_microbatches=4, tracer="fx")
    failing = {row.name for row in caught.value.report.failures}
    assert {"grad 0.word_embeddings.weight (replica in stage 0)",
            "grad 0.word_embeddings.weight (replica in stage 1)"} <= failing
    assert "grad 0.position_embeddings.weight" not in failing


@needs_megatron
def test_chunks_take_several_inputs_and_their_own_transformer_config() -> None:
    scale = torch.rand(8, generator=torch.Generator().manual_seed(3)) + 0.5
    assert pcm.check_chunks(mm.scaled_chunk, (TOKENS, scale), num_stages=2, loss_fn=mm.lm_loss, target=LABELS,
                            n_microbatches=4).ok
    report = _chunks_check(mm.configured_chunk, num_stages=4, schedule="interleaved", stages_per_rank=2)
    assert report.ok  # the chunk's own batch_p2p_comm=False reached Megatron's schedule: no false alarm
    assert any("batch_p2p_comm=False (the chunk's TransformerConfig)" in note for note in report.notes), report.notes


MEGATRON_ONLY = ("not-3d", "not-contiguous", "needs-parallel-state")  # refused by running the chunks or Megatron


@pytest.mark.parametrize("provider,options,error,message", [
    pytest.param(mm.flat_chunk, {}, pc.EngineError, "chunk 0 returns a tensor of shape [2, 8]", id="not-3d"),
    pytest.param(mm.strided_chunk, {}, pc.EngineError, "chunk 0 returns a tensor that is not contiguous",
                 id="not-contiguous"),
    pytest.param(mm.needs_parallel_state, {}, pc.InputError, "where Megatron's process groups do not exist",
                 id="needs-parallel-state"),
    pytest.param(mm.plain_module, {}, pc.InputError, "need an nn.Module with set_input_tensor", id="not-a-chunk"),
    pytest.param(mm.one_sided_tie, {}, pc.InputError,
                 "share_embeddings_and_output_weights is True on the first chunk and False on the last",
                 id="one-sided-tie"),
    pytest.param(mm.flat_chunk, {"num_stages": 4, "schedule": "interleaved", "stages_per_rank": 2}, pc.InputError,
                 "cannot be called as Megatron calls it, with pre_process, post_process, vp_stage", id="no-vp-stage"),
    pytest.param(mm.gpt_chunk, {"num_stages": 1}, pc.InputError, "num_stages=1 must be an int of at least 2",
                 id="one-stage"),
    pytest.param(mm.gpt_chunk, {"stages_per_rank": 0}, pc.InputError, "stages_per_rank=0 must be an int",
                 id="no-stages-per-rank"),
    pytest.param(mm.gpt_chunk, {"schedule": "interleaved", "stages_per_rank": 2}, pc.InputError,
                 "over 2 or more pipeline ranks", id="one-pipeline-rank"),
])
def test_chunks_megatron_cannot_run_are_refused_before_any_rank_starts(provider: object, options: dict,
                                                                       error: type[Exception], message: str,
                                                                       request: pytest.FixtureRequest) -> None:
    if importlib.util.find_spec("megatron") is None and request.node.callspec.id in MEGATRON_ONLY:
        pytest.skip('needs megatron-core: pip install "torch-pipecheck[megatron]"')
    with pytest.raises(error, match=re.escape(message)):
        _chunks_check(provider, **options)


@needs_megatron
@pytest.mark.gpu(n=2)
def test_megatron_on_one_gpu_per_rank_with_nccl_matches_eager() -> None:
    """Never run by this project's CI or its one-GPU device machine (NCCL needs a GPU per rank)."""
    report = pc.assert_equivalent(mm.TiedLM, (TOKENS,), runner="megatron", n_microbatches=4, device="cuda")
    assert report.ok and "grad emb.weight (replica in stage 1)" in {row.name for row in report.rows}
    assert _chunks_check(device="cuda").ok
