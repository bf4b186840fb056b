"""Activation checkpointing kept through the split: the stages recompute what the model checkpoints,
reentrant or not, under both tracers, and the check matches eager."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import pipecheck as pc

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


class Checkpointed(nn.Module):
    """A block under torch.utils.checkpoint, between two plain layers."""

    def __init__(self, reentrant: bool, first_input: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.block = Block()
        self.head = nn.Linear(8, 8)
        self.reentrant = reentrant
        self.first_input = first_input  # checkpoint the model's input itself: it does not require grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.first_input else self.embed(x)
        x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(torch.tanh(x))


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():  # torch: "None of the inputs have requires_grad=True" (the point of a case)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _recomputes(pipe: pc.Pipe, n_microbatches: int) -> list[int]:
    """How often each stage's regions ran in one reference step: forward, then again in backward."""
    calls = []
    for stage in range(pipe.num_stages):
        module = pipe.stage_module(stage)
        regions = [value for name, value in vars(module).items() if name.startswith("checkpointed_")]
        count = [0]
        for region in regions:
            region.module.register_forward_pre_hook(lambda *_, count=count: count.__setitem__(0, count[0] + 1))
        calls.append(count)
    pc.DetachExecutor(pipe).step((X,), n_microbatches=n_microbatches)
    return [count[0] for count in calls]


CUTS = {"after": {"head": pc.SplitPoint.BEGINNING}, "inside": {"block.second": pc.SplitPoint.BEGINNING}}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("cut", list(CUTS))
def test_checkpointed_regions_are_recomputed_by_the_stages_and_match(reentrant: bool, tracer: str, cut: str) -> None:
    make = functools.partial(Checkpointed, reentrant)
    pipe = pc.split(make, (X,), split_spec=CUTS[cut], tracer=tracer)
    # forward and the recompute in backward, for each of 2 micro-batches; a cut inside the block
    # checkpoints each side of it
    assert _recomputes(pipe, 2) == ([4, 0] if cut == "after" else [4, 4])
    report = pc.assert_equivalent(make, (X,), split_spec=CUTS[cut], tracer=tracer, n_microbatches=2,
                                  runner="reference")
    assert report.ok and {row.name for row in report.rows} >= {"grad block.first.weight", "grad block.second.bias"}


def test_a_reentrant_checkpoint_of_inputs_without_grad_gives_no_gradient_as_eager() -> None:
    """torch's reentrant checkpoint of tensors none of which requires grad leaves the parameters inside
    without gradient; the stages do as eager does instead of recomputing."""
    model = Checkpointed(True, first_input=True)
    model(X).sum().backward()
    assert model.block.first.weight.grad is None  # eager, as torch does it
    make = functools.partial(Checkpointed, True, first_input=True)
    pipe = pc.split(make, (X,), split_spec=CUTS["after"])
    result = pc.DetachExecutor(pipe).step((X,), n_microbatches=2)
    assert result.grads.get("block.first.weight") is None
    assert pc.assert_equivalent(make, (X,), split_spec=CUTS["after"], n_microbatches=2, runner="reference").ok


def test_a_checkpoint_of_an_input_that_requires_grad_passes_its_gradient_back() -> None:
    """Once refused (eager computed gradients with torch.autograd.grad, which a reentrant checkpoint
    refuses): the input's gradient is compared too."""
    x = X.clone().requires_grad_(True)
    for reentrant in (False, True):
        for tracer in ("fx", "export"):
            report = pc.assert_equivalent(functools.partial(Checkpointed, reentrant, first_input=True), (x,),
                                          split_spec=CUTS["after"], runner="reference", n_microbatches=2, tracer=tracer)
            assert report.ok and report.row("grad input x").numel == X.numel(), report


def test_checkpointed_stages_match_on_the_runtime(pipecheck_world: Any) -> None:
    for reentrant in (False, True):
        report = pc.assert_equivalent(functools.partial(Checkpointed, reentrant), (X,), split_spec=CUTS["inside"],
                                      n_microbatches=2, world=pipecheck_world(2))
        assert report.ok, report


def test_torch_runner_refuses_a_reentrant_checkpoint_before_any_rank_starts(pipecheck_world: Any) -> None:
    with pytest.raises(pc.EngineError, match=r"(?s)use_reentrant=True\) cannot be traced by torch.export.*"
                                             r"Fix: use_reentrant=False.*refused before any rank started"):
        pc.assert_equivalent(functools.partial(Checkpointed, True), (X,), split_spec=CUTS["after"], runner="torch", n_microbatches=2,
                             world=pipecheck_world(2))


transformers = pytest.importorskip("transformers")


def llama(reentrant: bool) -> torch.nn.Module:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))  # use_cache at its default: HF turns it off under checkpointing in train mode
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_is_recomputed_by_the_stages(pipecheck_world: Any, reentrant: bool) -> None:
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    spec = {"model.layers.1": pc.SplitPoint.BEGINNING}
    pipe = pc.split(functools.partial(llama, reentrant), (ids,), split_spec=spec)
    assert [len([n for n in vars(pipe.stage_module(s)) if n.startswith("checkpointed_")]) for s in (0, 1)] == [1, 1]
    for runner, world in (("reference", None), ("distributed", pipecheck_world(2))):
        report = pc.assert_equivalent(functools.partial(llama, reentrant), (ids,), split_spec=spec, n_microbatches=2,
                                      runner=runner, world=world)
        assert report.ok and report.tracer == "export", report


@pytest.mark.gpu(n=1)
def test_checkpointed_hf_model_with_its_cache_on_a_gpu() -> None:
    """Llama as users configure it (its cache, gradient checkpointing) on CUDA: the reference, and pipecheck's
    runtime with 2 ranks sharing the GPU (gloo between them, so the World's start proves its peers there too)."""
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    spec = {"model.layers.1": pc.SplitPoint.BEGINNING}

    with pc.World(2, device="cuda") as world:
        for reentrant in (False, True):
            for runner in ("reference", "distributed"):
                report = pc.assert_equivalent(functools.partial(llama, reentrant), (ids,), {"labels": ids},
                                              loss_fn=pc.losses.model_loss, split_spec=spec, n_microbatches=2,
                                              device="cuda", runner=runner, world=world)
                assert report.ok, report
