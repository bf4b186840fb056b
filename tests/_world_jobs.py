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
