"""Ranks on one GPU pass boundary tensors on the device (pipecheck._runtime.ipc). Without a GPU, the
protocol runs on CPU ranks through the test transport (files in shared memory, forced by an internal
switch): frames, authentication, the receiver's copy, lifetimes, schedules, a rank dying or hanging.
With one, real CUDA IPC between ranks sharing it."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _world_jobs as jobs
import pytest
import torch
import torch.nn as nn
from _training_models import adamw, make_tied_lm, token_ce, tokens
from _world_jobs import Planted
from pipecheck.fixtures import get

import pipecheck as pc
from pipecheck._runtime import ipc
from pipecheck._runtime.comm import SHARE_BYTES, Links, SharedSlot

# private: the rank context whose placement decides which peers share a GPU
from pipecheck._world.worker import RankContext

CPU = torch.device("cpu")
TWO_LAYERS = {"1": pc.SplitPoint.BEGINNING}


@pytest.fixture
def file_ipc(pipecheck_world: Callable[[int], Any]) -> Iterator[Callable[[int], Any]]:
    """``file_ipc(n)``: the session's World of n ranks, every pair passing tensors through the test transport
    for this test only."""
    worlds: list[Any] = []

    def switched_on(world_size: int) -> Any:
        world = pipecheck_world(world_size)
        world.run(ipc.use_file_transport, True)
        worlds.append(world)
        return world

    yield switched_on
    for world in worlds:
        world.run(ipc.use_file_transport, False)


def _totals(counts: list[dict[str, int]]) -> tuple[int, int]:
    return sum(c["shared"] for c in counts), sum(c["opened"] for c in counts)


# --- the test transport alone: lifetimes at least as strict as CUDA IPC's reference counts ----------

@pytest.mark.parametrize("tensor", [torch.randn(3, 5), torch.randn(4, 6).t(), torch.tensor(2.5),
                                    torch.zeros(0, 7), torch.arange(6) > 2, torch.randn(3).to(torch.bfloat16),
                                    torch.arange(10, dtype=torch.int64)],
                         ids=["matrix", "transposed", "scalar", "empty", "bool", "bfloat16", "int64"])
def test_a_shared_tensor_is_copied_whole_and_freed_only_once_copied(tmp_path: Path, tensor: torch.Tensor) -> None:
    sender, receiver = ipc.FileTransport(str(tmp_path)), ipc.FileTransport(str(tmp_path))
    description = sender.share(tensor)
    sender.collect()  # not copied yet: kept
    assert list(sender.outstanding) == [description.path] and Path(description.path).exists()
    copy = receiver.open(pickle.loads(pickle.dumps(description)), CPU)
    assert copy.dtype == tensor.dtype and torch.equal(copy, tensor) and copy.is_contiguous()
    sender.collect()
    assert not sender.outstanding and not list(tmp_path.iterdir())
    assert torch.equal(copy, tensor)  # the receiver's own memory: freeing the shared file left it alone


def test_the_sender_changing_its_tensor_after_sharing_changes_nothing_received(tmp_path: Path) -> None:
    sender = ipc.FileTransport(str(tmp_path))
    tensor = torch.ones(4)
    description = sender.share(tensor)
    tensor.mul_(7)  # a stage writing over its output after the send
    assert torch.equal(ipc.FileTransport(str(tmp_path)).open(description, CPU), torch.ones(4))


def test_a_shared_tensor_opened_twice_or_after_it_was_freed_is_an_error(tmp_path: Path) -> None:
    sender, receiver = ipc.FileTransport(str(tmp_path)), ipc.FileTransport(str(tmp_path))
    description = sender.share(torch.ones(3))
    receiver.open(description, CPU)
    with pytest.raises(pc.EngineError, match="opened twice or reused"):
        receiver.open(description, CPU)
    sender.collect()
    with pytest.raises(pc.EngineError, match="is gone before its receiver copied it"):
        receiver.open(description, CPU)


# --- which peers share: from the World's placement -------------------------------------------------

def _ctx(rank: int, device: str, comm: str, devices: tuple[str, ...]) -> RankContext:
    return RankContext(rank=rank, world_size=len(devices), device=torch.device(device), backend="gloo",
                       comm_device=torch.device(comm), devices=devices)


@pytest.mark.parametrize("ctx,peers", [
    pytest.param(_ctx(0, "cuda:0", "cpu", ("cuda:0",) * 4), {1, 2, 3}, id="four-ranks-on-one-gpu"),
    pytest.param(_ctx(1, "cuda:1", "cpu", ("cuda:0", "cuda:1", "cuda:0", "cuda:1")), {3}, id="two-gpus-four-ranks"),
    pytest.param(_ctx(0, "cuda:0", "cpu", ("cuda:0", "", "cuda:0")), {2}, id="a-peer-on-another-host"),
    pytest.param(_ctx(0, "cuda:0", "cuda:0", ("cuda:0", "cuda:1")), None, id="nccl-one-gpu-per-rank"),
    pytest.param(_ctx(0, "cpu", "cpu", ("cpu",) * 2), None, id="cpu-ranks-talk-through-gloo"),
    pytest.param(_ctx(0, "cuda:0", "cpu", ("cuda:0", "cuda:1")), None, id="no-peer-on-this-gpu"),
])
def test_ranks_pass_tensors_by_ipc_exactly_to_the_ranks_on_their_gpu(ctx: RankContext, peers: set[int] | None
                                                                      ) -> None:
    sharing = ipc.sharing_for(ctx)
    assert (None if sharing is None else set(sharing.peers)) == peers
    assert sharing is None or isinstance(sharing.transport, ipc.CudaTransport)


# --- the frame: authenticated before it is unpickled or opened -------------------------------------

def _links(key: bytes, folder: Path) -> Links:
    pipe = pc.split(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), (torch.randn(2, 4),), split_spec=TWO_LAYERS)
    return Links(pipe, (0, 1), CPU, CPU, key, ipc.Sharing(ipc.FileTransport(str(folder)), frozenset({0, 1})))


def _slot(frame: torch.Tensor, links: Links, tag: int, shape: tuple[int, ...] = (2, 4)) -> SharedSlot:
    return SharedSlot(frame, next(iter(links.channel_ids)), 0, tag, shape, torch.float32)


def test_a_shared_tensor_s_frame_is_authenticated_before_it_is_unpickled(tmp_path: Path) -> None:
    key, tag = b"k" * 32, 66
    sender, receiver = _links(key, tmp_path), _links(key, tmp_path)
    value = torch.randn(2, 4)
    frame = sender._shared_frame(value, tag)
    assert frame.numel() == SHARE_BYTES
    assert torch.equal(receiver._opened(_slot(frame, receiver, tag)), value)
    blob = pickle.dumps(Planted())
    planted = bytes(32) + len(blob).to_bytes(8, "little") + blob
    forged = [torch.frombuffer(bytearray(planted.ljust(SHARE_BYTES, b"\0")), dtype=torch.uint8),
              _links(b"another key", tmp_path)._shared_frame(value, tag),
              sender._shared_frame(value, tag + 64)]  # another message's tag
    for frame in forged:
        with pytest.raises(pc.EngineError, match="shared tensor .* failed authentication"):
            receiver._opened(_slot(frame, receiver, tag))
    assert not Planted.ran


def test_a_shared_tensor_unlike_its_layout_is_an_error_not_a_wrong_value(tmp_path: Path) -> None:
    sender, receiver = _links(b"k", tmp_path), _links(b"k", tmp_path)
    frame = sender._shared_frame(torch.randn(3, 4), 66)
    with pytest.raises(pc.EngineError, match=r"shape \(3, 4\) and dtype torch.float32, where its layout says"):
        receiver._opened(_slot(frame, receiver, 66))


# --- whole steps on CPU ranks through the test transport --------------------------------------------

CASES = [  # (zoo entry, schedule, stages per rank, micro-batches)
    pytest.param("skip_one", "1f1b", 1, 8, id="skip-connection-1f1b-8-microbatches"),
    pytest.param("long_skip", "interleaved", 2, 4, id="long-skip-interleaved"),
    pytest.param("long_skip", "zbv", 2, 4, id="long-skip-zero-bubble-v"),
    pytest.param("dict_outputs", "gpipe", 1, 2, id="dict-outputs-gpipe"),
]


@pytest.mark.parametrize("name,schedule,per_rank,n_mb", CASES)
def test_a_step_through_shared_tensors_equals_the_step_through_gloo_bit_for_bit(
        pipecheck_world: Callable[[int], Any], file_ipc: Callable[[int], Any], name: str, schedule: str,
        per_rank: int, n_mb: int) -> None:
    entry = get(name)
    args, kwargs = entry.inputs()
    world_size = entry.num_stages // per_rank

    def step() -> pc.StepResult:
        return pc.run_pipeline(pipecheck_world(world_size), entry.factory(), args, kwargs, schedule=schedule,
                               stages_per_rank=per_rank, n_microbatches=n_mb, loss_fn=entry.loss_fn,
                               target=entry.target())

    through_gloo = step()
    world = file_ipc(world_size)
    through_ipc = step()
    shared, opened = _totals(world.run(ipc.counts))
    assert shared == opened > 0
    assert through_ipc.grads.keys() == through_gloo.grads.keys()
    for fqn, grad in through_gloo.grads.items():
        assert torch.equal(through_ipc.grads[fqn], grad), fqn
    assert torch.equal(through_ipc.loss, through_gloo.loss)
    for ipc_out, gloo_out in zip(torch.utils._pytree.tree_leaves(through_ipc.outputs),
                                 torch.utils._pytree.tree_leaves(through_gloo.outputs)):
        assert torch.equal(ipc_out, gloo_out)


def test_a_check_through_shared_tensors_passes(file_ipc: Callable[[int], Any]) -> None:
    entry = get("tiny_gpt")
    args, kwargs = entry.inputs()
    world = file_ipc(2)
    report = pc.assert_equivalent(entry.factory("spec"), args, kwargs, runner="distributed", world=world,
                                  policy=pc.policies.balanced_params(2), loss_fn=entry.loss_fn,
                                  target=entry.target(), n_microbatches=4)
    assert report.ok
    assert _totals(world.run(ipc.counts))[0] > 0


def test_a_training_check_of_two_replicas_through_shared_tensors_passes(file_ipc: Callable[[int], Any]) -> None:
    """Optimizer steps on one executor (its links kept across steps), two pipelines of two ranks each."""
    x, y = tokens(pad=3)
    world = file_ipc(4)
    report = pc.assert_equivalent(make_tied_lm, (x,), runner="distributed", world=world, data_parallel=2, steps=2,
                                  n_microbatches=4, accumulation_steps=2, optimizer=adamw, loss_fn=token_ce,
                                  target=y, loss_reduction="token_mean")
    assert report.ok
    assert all(c["shared"] > 0 and c["opened"] > 0 for c in world.run(ipc.counts))


def test_twenty_steps_leave_no_more_shared_memory_than_one(file_ipc: Callable[[int], Any]) -> None:
    world = file_ipc(2)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(8, 4)
    after: list[list[dict[str, int]]] = []
    for _ in range(20):
        pc.run_pipeline(world, model, (x,), split_spec=TWO_LAYERS, n_microbatches=4)
        after.append(world.run(ipc.counts))
    per_step = after[0][0]["shared"] + after[0][1]["shared"]  # 4 activations one way, 4 gradients back
    assert per_step == 8 and _totals(after[-1]) == (20 * per_step, 20 * per_step)
    for counts in after:
        for rank in counts:
            assert rank["files"] == rank["outstanding"] <= per_step  # what is left: at most one step's


def test_a_rank_dying_mid_step_is_named_and_the_world_recovers() -> None:
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(8, 4)
    with pc.World(2, timeout=60) as world:
        world.run(ipc.use_file_transport, True)
        with pytest.raises(pc.RankDiedError, match="rank 1 of 2 died"):
            pc.run_pipeline(world, model, (x,), split_spec=TWO_LAYERS, n_microbatches=4,
                            loss_fn=jobs.loss_that_dies, target=torch.randn(8, 4))
        world.run(ipc.use_file_transport, True)  # fresh ranks: the switch again
        pc.run_pipeline(world, model, (x,), split_spec=TWO_LAYERS, n_microbatches=4)
        assert _totals(world.run(ipc.counts)) == (8, 8)


def test_a_receive_that_never_comes_times_out_naming_the_rank() -> None:
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(8, 4)
    with pc.World(2, timeout=60) as world:
        world.run(ipc.use_file_transport, True)
        with pytest.raises(pc.RankTimeoutError, match=r"rank 1 of 2 hung(?s:.*)rank\(s\) 0 waiting for it"):
            pc.run_pipeline(world, model, (x,), split_spec=TWO_LAYERS, n_microbatches=4,
                            loss_fn=jobs.loss_that_hangs, target=torch.randn(8, 4), timeout=10)


# --- on a GPU: real CUDA IPC between ranks sharing it ------------------------------------------------

def _fewer_gpus_than(world_size: int) -> None:
    if torch.cuda.device_count() >= world_size:
        pytest.skip(f"{torch.cuda.device_count()} GPUs give each of {world_size} ranks its own (NCCL): "
                    "run with CUDA_VISIBLE_DEVICES=0")


@pytest.mark.gpu(n=1)
@pytest.mark.parametrize("world_size,schedule,per_rank", [(2, "interleaved", 2), (4, "1f1b", 1)],
                         ids=["2-ranks-interleaved", "4-ranks-1f1b"])
def test_ranks_on_one_gpu_pass_boundary_tensors_on_it(world_size: int, schedule: str, per_rank: int) -> None:
    _fewer_gpus_than(world_size)
    entry = get("long_skip")
    args, kwargs = entry.inputs()
    with pc.World(world_size, device="cuda") as world:
        assert world.properties.gpus_shared
        report = pc.assert_equivalent(entry.factory(), args, kwargs, runner="distributed", device="cuda",
                                      schedule=schedule, stages_per_rank=per_rank, n_microbatches=4,
                                      world=world)
        counts = world.run(ipc.counts)
    assert report.ok
    assert all(c["shared"] > 0 and c["opened"] > 0 for c in counts), counts  # every rank, both ways
    assert _totals(counts)[0] == _totals(counts)[1]


@pytest.mark.gpu(n=1)
def test_twenty_steps_on_one_gpu_do_not_grow_its_memory() -> None:
    _fewer_gpus_than(2)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), torch.randn(32, 64)
    with pc.World(2, device="cuda") as world:
        held = []
        for _ in range(20):
            pc.run_pipeline(world, model, (x,), split_spec=TWO_LAYERS, n_microbatches=4)
            held.append(world.run(jobs.cuda_memory))
        shared, opened = _totals(world.run(ipc.counts))
    assert shared == opened >= 20 * 8
    one_step = 8 * 8 * 64 * 4  # every boundary tensor of a step, in bytes
    for rank in range(2):
        assert held[-1][rank] <= held[2][rank] + one_step, [h[rank] for h in held]
