"""runner="torch" under pipecheck's randomness contract: models with dropout checked through torch's pipelining.

Every torch schedule runs each micro-batch's stage forward in ``forward_one_chunk``, drawn there by the
contract; one step and a training loop match eager on a dropout model, HF models too. Masks drawn for
another micro-batch fail, naming it; a torch split that draws otherwise than pipecheck's split is refused
before any rank starts (a false alarm otherwise).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _torch_findings import HF_TIED_CRASH, HF_TIED_RUNS
from _training_models import make_dropout_net
from mutants.random_draws import shifted_torch_runner

import pipecheck as pc

# private: torch's pipeline() of the check, traced otherwise to plant a split that draws otherwise
from pipecheck._runners.torch_pipelining import driver as torch_driver

X = torch.randn(8, 8)
IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _quiet_torch_export() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class FourStageDropout(nn.Module):
    """Dropout in every stage: a module, F.dropout, a channel dropout, and a checkpointed region's."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(8, 8) for _ in range(4))
        self.d0, self.d3 = nn.Dropout(0.3), nn.Dropout1d(0.2)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.d0(torch.tanh(self.l0(x)))
        h = F.dropout(torch.tanh(self.l1(h)), 0.25, self.training)
        h = self.l2(torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False))
        return self.l3(self.d3(h.unsqueeze(-1)).sum(-1))  # stage 2 returns no view: torch's ZB would fail on one


def four_stage_dropout() -> FourStageDropout:
    torch.manual_seed(0)
    return FourStageDropout()


FOUR_CUTS = {name: pc.SplitPoint.BEGINNING for name in ("l1", "block", "l3")}

# (schedule, model, split_spec, stages_per_rank): every torch schedule, each forward of a micro-batch drawn
SCHEDULES = [
    pytest.param("gpipe", make_dropout_net, None, 1, id="gpipe"),
    pytest.param("1f1b", make_dropout_net, None, 1, id="1f1b"),
    pytest.param("zb", make_dropout_net, None, 1, id="zb-h1"),
    pytest.param("interleaved", four_stage_dropout, FOUR_CUTS, 2, id="interleaved-1f1b"),
    pytest.param("interleaved_zb", four_stage_dropout, FOUR_CUTS, 2, id="interleaved-zb"),
    pytest.param("zbv", four_stage_dropout, FOUR_CUTS, 2, id="zbv"),
    pytest.param("dualpipev", four_stage_dropout, FOUR_CUTS, 2, id="dualpipev"),
]


@pytest.mark.parametrize("schedule, model, split_spec, stages_per_rank", SCHEDULES)
def test_every_torch_schedule_draws_dropout_by_the_contract_over_training_steps(
        pipecheck_world: Any, schedule: str, model: Any, split_spec: Any, stages_per_rank: int) -> None:
    report = pc.assert_equivalent(model, (X,), split_spec=split_spec, n_microbatches=4, runner="torch",
                                  schedule=schedule, stages_per_rank=stages_per_rank, world=pipecheck_world(2),
                                  steps=2, accumulation_steps=2, optimizer=sgd)
    assert report.ok and "2 steps of sgd, 2 accumulation steps each" in report.headline()
    assert "random ops drawn by pipecheck's randomness contract" in report.headline()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_one_step_check_of_a_dropout_model_runs_through_torch(pipecheck_world: Any, schedule: str) -> None:
    report = pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=2, runner="torch", schedule=schedule,
                                  world=pipecheck_world(2))
    assert report.ok and "1 step" in report.headline() and "3 random ops" in report.headline()


def test_masks_torch_draws_for_another_microbatch_fail_naming_the_microbatches(pipecheck_world: Any) -> None:
    """The planted bug: each forward_one_chunk(m) draws micro-batch m + 1's numbers."""
    with pytest.raises(pc.EquivalenceError) as caught:
        pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=4, runner=shifted_torch_runner(),
                             world=pipecheck_world(2))
    report = caught.value.report
    assert not report.row("output").ok
    assert ("micro-batch 0 drew micro-batch 1's, micro-batch 1 drew micro-batch 2's, micro-batch 2 drew "
            "micro-batch 3's, micro-batch 3 drew micro-batch 0's random numbers") in " ".join(report.hints.values())


def _traced_otherwise(**changes: Any) -> Any:
    """torch_pipe as the driver calls it, on a spec with ``changes``: torch's split made to differ."""
    original = torch_driver.torch_pipe

    def traced(spec: Any, device: torch.device) -> Any:
        return original(dataclasses.replace(spec, **changes), device)

    return traced


def more_dropout() -> nn.Module:
    """DropoutNet with another dropout probability in its first stage: the same ops, other numbers."""
    model = make_dropout_net()
    model.d0.p = 0.6
    return model


@pytest.mark.parametrize("changes, differs", [
    pytest.param({"module_cuts": {"block": pc.SplitPoint.BEGINNING}, "keep_markers": False},
                 "micro-batch 0: random op #2: pipecheck's split draws aten::bernoulli_ (4, 16) in stage 0, torch's "
                 "aten::bernoulli_ (4, 16) in stage 1", id="cut-elsewhere"),
    pytest.param({"model": more_dropout},
                 "micro-batch 0: random op #1 (aten::bernoulli_ (4, 16), stage 0) draws other numbers in torch's "
                 "split than in pipecheck's", id="other-numbers"),
])
def test_a_torch_split_that_draws_otherwise_is_refused_before_any_rank_starts(monkeypatch: Any, changes: Any,
                                                                               differs: str) -> None:
    monkeypatch.setattr(torch_driver, "torch_pipe", _traced_otherwise(**changes))
    with pytest.raises(pc.InputError) as refused:
        pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=2, runner="torch", world_size=2)
    text = str(refused.value)
    assert text.startswith("runner='torch' cannot check DropoutNet's random numbers: torch's pipeline() splits the "
                           "model itself, and its stages do not draw what pipecheck's split draws"), text
    assert differs in text, text
    assert "Fix: runner='distributed'" in text and "model.eval() checks the deterministic model only" in text


def llama_with_attention_dropout() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        vocab_size=64, attention_dropout=0.1, use_cache=False))


def gpt2_default() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))


def _hf_check(model: Any, cut: str, world: pc.World) -> pc.Report | None:
    """The check through torch; None where torch before 2.13 fails stage 1 before any step (_torch_findings)."""
    def run() -> pc.Report:
        return pc.assert_equivalent(model, (IDS,), n_microbatches=2, runner="torch", world=world,
                                    split_spec={cut: pc.SplitPoint.BEGINNING})

    if HF_TIED_RUNS:
        return run()
    with pytest.raises(pc.EngineError) as refused:
        run()
    assert str(refused.value).splitlines()[0] == HF_TIED_CRASH
    return None


def test_llama_with_attention_dropout_matches_through_torch(pipecheck_world: Any) -> None:
    report = _hf_check(llama_with_attention_dropout, "model.layers.1", pipecheck_world(2))
    assert report is None or (report.ok and report.tracer == "export" and "2 random ops" in report.headline())


def test_gpt2_in_its_default_train_config_fails_through_torch_only_in_its_tied_embedding(pipecheck_world: Any) -> None:
    """Dropout everywhere (0.1), SDPA's dropout_p: every output, loss and gradient matches but the tied
    word embedding's, which torch never sums across its replicas (tests/test_hf_zoo.py, in eval mode)."""
    try:
        if _hf_check(gpt2_default, "transformer.ln_f", pipecheck_world(2)) is None:
            return  # torch before 2.13
    except pc.EquivalenceError as caught:
        report = caught.report
    else:
        raise AssertionError("torch's unsummed tied embedding went unseen")
    assert "drawn by pipecheck's randomness contract" in report.headline()
    tied = "transformer.wte.weight"
    assert {row.name for row in report.failures} == {
        f"grad {tied}{replica}" for replica in ("", " (replica in stage 0)", " (replica in stage 1)")}
    assert report.hints[f"grad {tied}"].startswith("tied parameter not synchronised: gradient equals stage 0's "
                                                   "share only"), report.hints  # not a recompute's fresh numbers


def test_torch_failing_to_trace_a_dropout_model_here_is_an_engine_error_in_its_words(monkeypatch: Any) -> None:
    def fails(spec: Any, device: torch.device) -> Any:
        raise RuntimeError("pipeline() could not trace it\nmore")

    monkeypatch.setattr(torch_driver, "torch_pipe", fails)
    with pytest.raises(pc.EngineError) as failed:
        pc.assert_equivalent(make_dropout_net, (X,), n_microbatches=2, runner="torch", world_size=2)
    first, second = str(failed.value).splitlines()[:2]
    assert first == "RuntimeError: pipeline() could not trace it"
    assert second.startswith("torch.distributed.pipelining failed in this process, before any rank started: "
                             "pipecheck traced the model with torch's pipeline() and ran its split forward"), second
