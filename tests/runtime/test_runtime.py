"""pipecheck's distributed runtime on real gloo ranks: the zoo on every schedule, bitwise parity
with the reference runner, tied-weight sync, the timeline, and run_pipeline's arguments."""

from __future__ import annotations

import json

import pytest
import torch
from pipecheck.fixtures import ZOO, get

import pipecheck as pc

# private: the runtime's runner plans the schedule it executes
from pipecheck._runners.runtime.driver import plan_schedule

# (schedule, stages_per_rank) that fit a model of n stages on world_size ranks
LAYOUTS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("gpipe", 2), ("interleaved", 2)]


def _matrix() -> list[object]:
    cases = []
    for entry in ZOO:
        style = entry.cut_styles[0]
        for schedule, per_rank in LAYOUTS:
            if entry.num_stages % per_rank:
                continue
            world_size = entry.num_stages // per_rank
            for n_mb in (1, 2, 4, 8):
                if schedule == "interleaved" and per_rank > 1 and n_mb % world_size:
                    continue  # interleaved 1F1B needs micro-batches in multiples of the ranks
                cases.append(pytest.param(entry, style, schedule, per_rank, world_size, n_mb,
                                          id=f"{entry.name}-{schedule}-x{per_rank}-ws{world_size}-mb{n_mb}"))
    return cases


@pytest.mark.parametrize("entry,style,schedule,per_rank,world_size,n_mb", _matrix())
def test_zoo_passes_on_every_schedule(pipecheck_world, entry, style, schedule, per_rank, world_size, n_mb):
    args, kwargs = entry.inputs()
    report = pc.assert_equivalent(
        entry.factory(style), args, kwargs, runner="distributed", schedule=schedule, stages_per_rank=per_rank,
        n_microbatches=n_mb, loss_fn=entry.loss_fn, target=entry.target(),
        world=pipecheck_world(world_size), **entry.cut(style))
    assert report.ok and report.num_stages == entry.num_stages


def _reference(entry, style, n_mb, threads):
    """The reference step with the ranks' intra-op thread count (it changes the reduction order of
    CPU kernels, so it must match for bitwise parity: the World's ``threads_per_rank``)."""
    args, kwargs = entry.inputs()
    pipe = pc.split(pc.ModelFactory(entry.factory(style))(), args, kwargs, **entry.cut(style))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return pc.DetachExecutor(pipe).step(args, kwargs, loss_fn=entry.loss_fn, target=entry.target(),
                                            n_microbatches=n_mb)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", ["long_skip", "tiny_gpt", "encoder_decoder", "dict_outputs", "kwarg_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_distributed_equals_reference_bitwise_in_fp32(pipecheck_world, name, schedule):
    """Same stage code, same summation order (tied sums have two replicas: a + b == b + a)."""
    entry = get(name)
    args, kwargs = entry.inputs()
    world = pipecheck_world(entry.num_stages)
    got = pc.run_pipeline(world, entry.factory(), args, kwargs, schedule=schedule,
                          n_microbatches=4, loss_fn=entry.loss_fn, target=entry.target(), **entry.cut())
    want = _reference(entry, "markers", 4, world.threads_per_rank)
    assert torch.equal(got.loss, want.loss)
    for got_leaf, want_leaf in zip(torch.utils._pytree.tree_leaves(got.outputs),
                                   torch.utils._pytree.tree_leaves(want.outputs)):
        assert torch.equal(got_leaf, want_leaf)
    assert got.grads.keys() == want.grads.keys()
    for fqn, grad in want.grads.items():
        assert torch.equal(got.grads[fqn], grad), fqn


def test_every_tied_replica_ends_with_the_full_gradient(pipecheck_world):
    entry = get("tiny_gpt")
    args, _ = entry.inputs()
    world = pipecheck_world(4)
    res = pc.run_pipeline(world, entry.factory(), args, n_microbatches=2, loss_fn=entry.loss_fn,
                          target=entry.target())
    replicas = [res.stage_grads[s]["tok_emb.weight"] for s in (0, 3)]
    assert torch.equal(replicas[0], replicas[1])
    want = _reference(entry, "markers", 2, world.threads_per_rank)
    assert torch.equal(replicas[0], want.grads["tok_emb.weight"])
    share0 = want.stage_grads[0]["tok_emb.weight"]
    assert not torch.allclose(replicas[0], share0)  # the sum, not one stage's share


def test_input_gradients_come_back_from_every_consuming_stage(pipecheck_world):
    entry = get("kwarg_last")
    (x,), kwargs = entry.inputs()
    x = x.clone().requires_grad_(True)
    bias = kwargs["bias"].clone().requires_grad_(True)
    report = pc.assert_equivalent(entry.factory(), (x,), {"bias": bias}, runner="distributed", n_microbatches=4,
                                  world=pipecheck_world(3))
    names = {row.name for row in report.rows}
    assert {"grad input x", "grad input bias"} <= names
    assert x.grad is None and bias.grad is None  # the user's inputs are never touched


def test_trace_file_shows_every_action_of_every_rank(pipecheck_world, tmp_path):
    entry = get("mlp")
    args, _ = entry.inputs()
    path = tmp_path / "step.json"
    res = pc.run_pipeline(pipecheck_world(4), entry.factory(), args, n_microbatches=4, trace_path=str(path))
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = {(e["tid"], e["name"]) for e in slices if e["cat"] in ("forward", "backward")}
    assert compute == {(s, f"{s}{k}{m}") for s in range(4) for k in "FB" for m in range(4)}
    assert {e["cat"] for e in slices} >= {"forward", "backward", "send", "recv", "idle"}
    assert 0.0 < trace["otherData"]["bubble_fraction"] < 1.0
    assert len(res.events) >= 32


def test_a_user_supplied_schedule_runs(pipecheck_world):
    entry = get("skip_one")
    args, _ = entry.inputs()
    schedule = pc.schedules.Schedule.from_lists(3, 2, None, [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1F1", "1B0", "1B1"],
        ["2F0", "2B0", "2F1", "2B1"],
    ])
    report = pc.assert_equivalent(entry.factory(), args, runner="distributed", schedule=schedule,
                                  n_microbatches=2, world=pipecheck_world(3))
    assert report.ok


def test_a_schedule_that_deadlocks_is_refused_before_anything_runs():
    entry = get("skip_one")
    args, _ = entry.inputs()
    job = pc.Job(model=pc.ModelFactory(entry.factory()), args=args, n_microbatches=2,
                 schedule=pc.schedules.Schedule.from_lists(3, 2, None, [
                     ["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"], ["2F0", "2B0", "2F1", "2B1"]]))
    with pytest.raises(pc.ScheduleError, match="ERROR HERE"):
        plan_schedule(job, job.split())


def test_world_size_that_does_not_fit_the_schedule_is_a_clear_error(pipecheck_world):
    entry = get("mlp")
    args, _ = entry.inputs()
    with pytest.raises(pc.InputError, match="needs 4 ranks but the World has 2"):
        pc.run_pipeline(pipecheck_world(2), entry.factory(), args, n_microbatches=4)


@pytest.mark.gpu(n=1)
def test_ranks_sharing_one_gpu_match_eager():
    """Fewer GPUs than ranks: the ranks share the GPU, talk through gloo, and pass stage tensors on the
    device (CUDA IPC; tests/runtime/test_ipc.py counts them)."""
    entry = get("skip_one")
    args, kwargs = entry.inputs()
    with pc.World(entry.num_stages, device="cuda") as world:
        report = pc.assert_equivalent(entry.factory(), args, kwargs, runner="distributed", device="cuda",
                                      n_microbatches=4, world=world)
    assert report.ok


@pytest.mark.gpu(n=2)
def test_one_gpu_per_rank_over_nccl_matches_eager():
    entry = get("tiny_gpt")
    args, _ = entry.inputs()
    with pc.World(2, device="cuda") as world:
        assert world.properties.backend == "nccl"
        report = pc.assert_equivalent(entry.factory("spec"), args, runner="distributed", device="cuda",
                                      policy=pc.policies.balanced_params(2), loss_fn=entry.loss_fn,
                                      target=entry.target(), n_microbatches=4, world=world)
    assert report.ok


# --- models that once broke the runtime (each a regression test) ---------------------------------

class SharedGradTied(torch.nn.Module):
    """``p + b``: autograd hands back ONE tensor as the gradient of p and of b; p is tied."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.p, self.b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.l0(x) + (self.p + self.b)
        pc.pipe_split()
        return self.l1(h) * self.p


class BroadcastGradTied(torch.nn.Module):
    """``x * p.sum()``: the gradient of p is a stride-0 broadcast view; p is tied."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.p = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = self.a(x) * self.p.sum()
        pc.pipe_split()
        return self.b(h) @ self.p


class FrozenTied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.head.weight = self.emb.weight
        self.emb.weight.requires_grad_(False)

    def forward(self, x):
        h = self.emb(x)
        pc.pipe_split()
        return self.head(self.mid(h))


class InplaceAfterCut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.a(x)
        pc.pipe_split()
        return self.b(self.act(h))


class DataDependentShape(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h = h[h[:, 0] > 0]
        pc.pipe_split()
        return self.b(h).sum(0, keepdim=True)


@pytest.mark.parametrize("model", [SharedGradTied, BroadcastGradTied, FrozenTied, InplaceAfterCut])
@pytest.mark.parametrize("n_mb", [1, 2])
def test_tricky_gradients_match_eager_on_both_runners(pipecheck_world, model, n_mb):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for runner, world in (("reference", None), ("distributed", pipecheck_world(2))):
        assert pc.assert_equivalent(model, (x,), runner=runner, n_microbatches=n_mb, world=world).ok


def test_a_value_whose_shape_changes_between_microbatches_is_a_clear_error(pipecheck_world):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(pc.WorldError, match="changed its layout at micro-batch"):
        pc.run_pipeline(pipecheck_world(2), DataDependentShape, (x,), n_microbatches=4)


def test_parity_holds_at_an_explicit_thread_count() -> None:
    """Bitwise parity is promised at equal intra-op thread counts, whatever the machine's cores."""
    entry = get("skip_one")
    args, kwargs = entry.inputs()
    with pc.World(entry.num_stages, threads_per_rank=2) as world:
        assert world.threads_per_rank == 2
        got = pc.run_pipeline(world, entry.factory(), args, kwargs, n_microbatches=4)
    want = _reference(entry, "markers", 4, 2)
    assert got.grads.keys() == want.grads.keys()
    assert all(torch.equal(got.grads[fqn], grad) for fqn, grad in want.grads.items())


def test_every_stage_on_one_rank_runs_interleaved(pipecheck_world):
    """How the GPU benchmark runs: one rank, all four stages, interleaved 1F1B."""
    entry = get("mlp")
    args, kwargs = entry.inputs()
    report = pc.assert_equivalent(entry.factory(), args, kwargs, runner="distributed", schedule="interleaved",
                                  stages_per_rank=4, n_microbatches=4, world=pipecheck_world(1))
    assert report.ok and report.num_stages == 4
