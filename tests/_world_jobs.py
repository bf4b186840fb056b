"""Jobs for tests/world/test_world.py, top-level so spawned ranks can unpickle them."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

# private: the type of what a World task receives (its rank, device, group)
from pipecheck._world.world import RankContext


def describe_rank(ctx: RankContext) -> dict[str, Any]:
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "comm_device": str(ctx.comm_device),
        "backend": ctx.backend,
        "initialized": dist.is_initialized(),
    }


def echo(
    ctx: RankContext, *args: Any, **kwargs: Any
) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
    return ctx.rank, args, kwargs


def pid(ctx: RankContext) -> int:
    return os.getpid()


def all_reduce_rank(ctx: RankContext) -> list[float]:
    """Each rank contributes rank + 1; every rank ends with the sum."""
    tensor = torch.full((3,), float(ctx.rank + 1), device=ctx.comm_device)
    dist.all_reduce(tensor, group=ctx.group)
    return tensor.tolist()


def all_reduce_on_device(ctx: RankContext) -> tuple[str, str, list[float]]:
    """Compute on ctx.device, communicate on ctx.comm_device (CPU when ranks share a GPU)."""
    computed = torch.full((3,), float(ctx.rank + 1), device=ctx.device) * 2
    message = computed.to(ctx.comm_device)
    dist.all_reduce(message, group=ctx.group)
    return str(computed.device), str(message.device), message.cpu().tolist()


def raise_on_rank(ctx: RankContext, bad_rank: int) -> int:
    ctx.stage = 3
    ctx.action = "1B0"
    if ctx.rank == bad_rank:
        raise ValueError(f"boom on rank {ctx.rank}")
    dist.barrier()  # the healthy ranks block, waiting for the failed one
    return ctx.rank


def hang_on_rank(ctx: RankContext, bad_rank: int) -> int:
    ctx.stage = 2
    ctx.action = "2F0"
    if ctx.rank == bad_rank:
        sleep_forever()
    return ctx.rank


def sleep(ctx: RankContext, seconds: float) -> int:
    time.sleep(seconds)
    return ctx.rank


def sleep_forever() -> None:
    while True:
        time.sleep(0.05)


def die_on_rank(ctx: RankContext, bad_rank: int, how: str) -> int:
    ctx.stage = 1
    if ctx.rank == bad_rank:
        if how == "exit":
            os._exit(3)
        elif how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)
    dist.barrier()
    return ctx.rank


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("Unpicklable refuses to be pickled")


def return_unpicklable(ctx: RankContext) -> Unpicklable:
    return Unpicklable()


def raise_without_collective(ctx: RankContext, bad_rank: int) -> int:
    ctx.stage = 4
    if ctx.rank == bad_rank:
        raise RuntimeError(f"rank {ctx.rank} gives up")
    return ctx.rank


def exploding_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss_fn that raises, for tests/test_errors.py: on a rank it must become a LossError."""
    raise ValueError("loss exploded")


def split_without_tracing(ctx: RankContext, spec: Any) -> tuple[str, list[str]]:
    """The rank's split of ``spec`` (a StepSpec) where tracing raises: the recipe must do without it."""
    import pipecheck._split.pipe as pipe_module

    def no_trace(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rank traced the model")

    traced, pipe_module.trace = pipe_module.trace, no_trace
    try:
        pipe = spec.split_on(ctx.device)
    finally:
        pipe_module.trace = traced
    return str(pipe), [stage.module.code for stage in pipe.stages]


def prove_peers_with(ctx: RankContext, wrong_key_on: int, silent: int | None = None) -> tuple[str, ...]:
    """The start's handshake run again, as if rank ``wrong_key_on`` were a process without the World's
    key (and rank ``silent`` one that never answers): what each rank then reports."""
    from pipecheck._world.handshake import prove_peers

    if ctx.rank == silent:
        return ()
    key = b"not the World's key" if ctx.rank == wrong_key_on else ctx.secret
    return prove_peers(ctx.rank, ctx.world_size, key, timeout_s=2 if silent is not None else 30)


def receive_forged_layout_size(ctx: RankContext, size: int, keyed: bool, key: bytes | None = None) -> str:
    """Rank 0 sends a layout's size header by hand (signed with the World's key or not, or with ``key``);
    rank 1 receives it as a layout: what rank 1 says."""
    import torch.nn as nn

    import pipecheck as pc
    from pipecheck._runtime.comm import Links

    pipe = pc.split(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), (torch.randn(2, 4),),
                    split_spec={"1": pc.SplitPoint.BEGINNING})
    cpu = torch.device("cpu")
    links = Links(pipe, (0, 1), cpu, cpu, ctx.secret if key is None else key)
    channel = next(iter(links.channel_ids))
    tag = links._tag(channel, 0, False, 0)
    if ctx.rank == 0:
        body = size.to_bytes(8, "little", signed=True)
        header = links.signed(body, tag) if keyed else bytes(32) + body
        dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), 1, tag=tag)
        return "sent"
    try:
        links.post_value(*channel, 0)
    except pc.EngineError as error:
        return str(error)
    return "accepted"


def hang_without_writable_stacks(ctx: RankContext) -> None:
    """Hang with faulthandler's stack dumps going to /dev/full, as onto a full disk (ENOSPC)."""
    import faulthandler

    full = open("/dev/full", "w")  # noqa: SIM115 - faulthandler writes to it until the rank is killed
    faulthandler.register(signal.SIGUSR1, file=full, all_threads=True)
    sleep_forever()


_LOSS_CALLS = [0]


def loss_that_dies(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss_fn whose rank (the last stage's) exits on its third micro-batch: a rank dying mid-step,
    with its peers waiting for gradients. Only on a rank: the driver's own calls are left alone."""
    if dist.is_initialized():
        _LOSS_CALLS[0] += 1
        if _LOSS_CALLS[0] == 3:
            os._exit(3)
    return torch.nn.functional.mse_loss(output, target)


def loss_that_hangs(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss_fn whose rank never finishes: its peers' receives never come."""
    if dist.is_initialized():
        sleep_forever()
    return torch.nn.functional.mse_loss(output, target)


def cuda_memory(ctx: RankContext) -> int:
    """Bytes the rank's caching allocator holds for tensors (torch's CUDA IPC limbo included)."""
    torch.cuda.synchronize(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def placement(ctx: RankContext) -> tuple[str, ...]:
    """Every rank's compute device, as this rank knows it (whom it may pass tensors to on a GPU)."""
    return ctx.devices


class Planted:
    """Unpickling this sets a flag: what a forged message could do to a rank if it were unpickled."""

    ran = False

    def __reduce__(self) -> tuple[object, ...]:
        return (_plant, ())


def _plant() -> None:
    Planted.ran = True
