"""Real size: the factory built where the check runs, the float64 truth's gradients summed in place,
finished results off a tight accelerator, and nothing of a check kept in its report (issue 34)."""

from __future__ import annotations

import contextlib
import gc
import inspect
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import pipecheck as pc

# private: the eager step's internals (its micro-batch sums), the check's placement, the input binding and the
# reference runner's function are under test or reused by a planted-bug runner
import pipecheck._check.placement as placement
from pipecheck._check.eager import _differentiable, _each_microbatch, eager_step
from pipecheck._check.placement import Placement, on_host
from pipecheck._split.inputs import prepare_inputs
from pipecheck._split.microbatch import split_microbatches
from pipecheck.losses import MicrobatchLoss


class Tied(nn.Module):
    """Tied embedding and head, a checkpointed block (reentrant or not) and a cut."""

    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.reentrant = reentrant

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) * scale
        if self.reentrant is None:
            x = self.block(x)
        else:
            x = checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        pc.pipe_split()
        return self.head(x)


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (8, 5), generator=g)
    scale = torch.rand(8, 5, 1, generator=g, dtype=dtype).requires_grad_()
    return (ids, scale), torch.randint(0, 16, (8, 5), generator=g)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_gradients_summed_into_grad_are_the_micro_batch_sums_bit_for_bit(reentrant: bool | None) -> None:
    """The truth's step adds each micro-batch's gradients into ``.grad`` as the backward reaches them: the same
    additions in the same order as summing whole micro-batch gradients, so the very same values, for a tied
    parameter, a checkpointed block and an input that requires grad; the tensors' own ``.grad`` put back."""
    torch.manual_seed(0)
    model = Tied(reentrant).double()
    (ids, scale), target = _inputs(torch.float64)
    marker = torch.full_like(model.emb.weight, 7.0)
    model.emb.weight.grad = marker
    inputs = prepare_inputs(model, (ids, scale), None, target)
    got, _ = eager_step(model, inputs, _loss, 4, True, backward_each=True)

    bound = inputs.signature.bind(*inputs.args, **inputs.kwargs)
    calls = [inspect.BoundArguments(bound.signature, chunk) for chunk in split_microbatches(dict(bound.arguments), 4)]
    params, named_inputs = _differentiable(model, bound)
    sums: list[Any] = [None] * (len(params) + len(named_inputs))
    for _, _, grads in _each_microbatch(model, bound, calls, MicrobatchLoss(_loss, target, 4)):
        sums = [g if s is None else s + g for s, g in zip(sums, grads)]
    expected = dict(zip([n for n, _ in params], sums))
    assert set(got.grads) == set(expected)
    for name, grad in got.grads.items():
        assert torch.equal(grad, expected[name]), name
    assert torch.equal(got.input_grads["scale"], sums[-1])
    assert model.emb.weight.grad is marker and inputs.args[1].grad is None


def test_a_factory_runs_under_the_checks_device_and_falls_back_to_the_host() -> None:
    """On a device other than the CPU the factory's parameters are made there (its default-device context; meta
    stands for a GPU here); a factory that fails there (host-only code) is built on the host and moved; a module
    given is copied, never called under the context."""
    seen: list[torch.device] = []

    def plain() -> nn.Module:
        seen.append(torch.get_default_device())
        return nn.Linear(4, 4)

    def host_only() -> nn.Module:
        layer = nn.Linear(4, 4)
        layer.weight.data.tolist()  # fails on meta
        seen.append(torch.get_default_device())
        return layer

    built = pc.ModelFactory(plain, device="meta")()
    assert seen == [torch.device("meta")] and built.weight.device.type == "meta"
    seen.clear()
    built = pc.ModelFactory(host_only, device="meta")()
    assert seen == [torch.device("cpu")] and built.weight.device.type == "meta"
    seen.clear()
    pc.ModelFactory(plain, device="cpu")()
    assert seen == [torch.device("cpu")]
    module = nn.Linear(4, 4)
    assert pc.ModelFactory(module, device="meta")().weight.device.type == "meta" and module.weight.device.type == "cpu"


def _tensors_reachable(root: Any, limit: int = 200_000) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through gc referents (modules, dicts, dataclasses, closures)."""
    seen, pending, found = {id(root)}, [root], []
    while pending and len(seen) < limit:
        obj = pending.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, type) or obj is torch or type(obj).__name__ == "module":
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen:
                seen.add(id(ref))
                pending.append(ref)
    return found


@pytest.mark.parametrize("fails", [False, True])
def test_a_report_holds_no_tensor(fails: bool) -> None:
    """A report (and a failing check's err.report) holds numbers and words, never the check's tensors: nothing of
    a check stays alive after it, on the host or on a device."""
    (ids, scale), target = _inputs()

    def wrong(job: pc.Job) -> pc.StepResult:
        from pipecheck._runners.base import run_reference
        result = run_reference(job)
        result.grads = {name: grad * 1.5 for name, grad in result.grads.items()}
        return result

    if fails:
        with pytest.raises(pc.EquivalenceError) as err:
            pc.assert_equivalent(Tied, (ids, scale), loss_fn=_loss, target=target, n_microbatches=2, runner=wrong)
        report = err.value.report
        del err
    else:
        report = pc.assert_equivalent(Tied, (ids, scale), loss_fn=_loss, target=target, n_microbatches=2,
                                      runner="reference")
    assert _tensors_reachable(report) == []


def test_results_on_the_host_are_compared_on_the_checks_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device is tight, eager's, the truth's and the runner's results wait on the host and each row is
    compared on the check's device: the same verdict and numbers as kept in place (here the CPU stands for it)."""
    (ids, scale), target = _inputs()
    kept = pc.assert_equivalent(Tied, (ids, scale), loss_fn=_loss, target=target, n_microbatches=2,
                                runner="reference")
    moved: list[str] = []
    monkeypatch.setattr(Placement, "_cuda", property(lambda self: True))
    monkeypatch.setattr(Placement, "measuring", lambda self: _nothing())
    monkeypatch.setattr(Placement, "_tight", lambda self, results, model_bytes: moved.append("tight") or True)
    real = placement.on_host
    monkeypatch.setattr(placement, "on_host", lambda value: moved.append(type(value).__name__) or real(value))
    report = pc.assert_equivalent(Tied, (ids, scale), loss_fn=_loss, target=target, n_microbatches=2,
                                  runner="reference")
    results = [name for name in moved if name in ("StepResult", "Truth", "tight")]
    assert results == ["tight", "StepResult", "Truth", "StepResult"], moved  # decided once; eager, truth, runner
    assert [(r.name, r.ok, r.max_abs, r.tolerance) for r in report.rows] == \
        [(r.name, r.ok, r.max_abs, r.tolerance) for r in kept.rows]


def _nothing() -> Any:
    return contextlib.nullcontext()


def test_on_host_gives_a_new_result_with_every_tensor_on_the_host() -> None:
    """Every field's tensors (a reference runner's stage shares and replicas too) in a new result: the runner's
    own object is not changed."""
    result = pc.StepResult(outputs={"y": [torch.ones(2)]}, loss=torch.tensor(1.0), grads={"w": torch.ones(3)},
                           input_grads={}, buffers={"b": torch.zeros(1)}, stage_grads=[{"w": torch.ones(3)}],
                           replica_grads={"w": {0: torch.ones(3)}})
    moved = on_host(result)
    assert moved is not result and moved.stage_grads is not result.stage_grads
    assert len(_tensors_reachable(moved)) == len(_tensors_reachable(result)) == 6
    assert all(t.device.type == "cpu" for t in _tensors_reachable(moved))


@pytest.mark.gpu(n=1)
def test_a_real_size_check_on_a_gpu_builds_there_keeps_nothing_and_peaks_no_higher_the_second_time() -> None:
    """On CUDA: the factory's parameters are made on the GPU; with the device tight (forced), results wait on the
    host and rows are compared on the GPU; the report holds no tensor; a second identical check peaks no higher
    than the first."""
    seen: list[torch.device] = []
    (ids, scale), target = _inputs()

    def factory() -> nn.Module:
        seen.append(torch.get_default_device())
        return Tied(False)

    peaks = []
    for tight in (False, True, True):
        placement.STEPS_TO_COME = 1e9 if tight else 2.5
        try:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            report = pc.assert_equivalent(factory, (ids, scale), loss_fn=_loss, target=target, n_microbatches=2,
                                          runner="reference", device="cuda")
            peaks.append(torch.cuda.max_memory_allocated())
        finally:
            placement.STEPS_TO_COME = 2.5
        assert report.ok and _tensors_reachable(report) == []
        del report
    assert seen and all(device.type == "cuda" for device in seen)
    assert peaks[2] <= peaks[1], peaks


def test_a_check_on_an_accelerator_collects_its_reference_cycles_before_it_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fx's graph modules and their graphs hold each other: without a collection a check's model outlives it
    until Python's collector runs (measured: the whole model still alive after a check on the CPU), and a second
    check on a GPU would build beside it. On the CPU the collector's own pace is left alone."""
    import pipecheck._check.equivalence as equivalence
    collected: list[str] = []
    monkeypatch.setattr(equivalence.gc, "collect", lambda *args: collected.append("gc") or 0)
    for device in ("cuda", "cuda:1", "meta", "cpu", None, "bogus"):
        equivalence._release(device)
    assert collected == ["gc"] * 3


def test_the_float64_step_spills_the_parameters_own_data_and_puts_it_back_bit_for_bit() -> None:
    """On a tight accelerator the parameters' own data waits on the host while their float64 copies run: each
    storage a parameter alone holds is emptied (a tied parameter's once), one something else also holds (a view
    kept elsewhere) is left whole, and after the block every parameter is the very object it was, on its own
    storage, with the same bits."""
    from pipecheck._check.eager import in_dtype
    torch.manual_seed(0)
    model = Tied()
    kept_view = model.block[0].weight.data[0]  # something else holds this storage: never emptied
    before = {name: (p, p.detach().clone(), p.untyped_storage()) for name, p in model.named_parameters()}
    with in_dtype(model, torch.float64, spill=True) as cast:
        assert all(p.dtype == torch.float64 for p in cast.parameters())
        sizes = {name: storage.nbytes() for name, (_, _, storage) in before.items()}
        cast(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, 1, dtype=torch.float64)).sum().backward()
    assert sizes["emb.weight"] == 0 and sizes["block.2.weight"] == 0 and sizes["block.0.bias"] == 0
    assert sizes["block.0.weight"] == 8 * 8 * 4  # the view kept it whole
    for name, p in model.named_parameters():
        same, value, storage = before[name]
        assert p is same and p.dtype == torch.float32 and torch.equal(p, value), name
        assert p.untyped_storage()._cdata == storage._cdata and p.grad is None, name
    assert torch.equal(kept_view, before["block.0.weight"][1][0])
