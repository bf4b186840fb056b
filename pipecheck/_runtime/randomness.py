"""pipecheck's randomness contract, as pipecheck's own runners and eager follow it.

    with schedule_step(seed=0, step=1, schedule_step=0, offset=0):   # a check with random ops sets a position
        with microbatch(2):
            fwd = stage_forward(stage, values)      # inside: with stage_draws(stage.index): ... torch's RNG seeded

Every stage's forward of a micro-batch draws its random numbers (dropout in any form, SDPA's
``dropout_p``, stochastic depth, ``torch.rand``) from torch's own generators, seeded on entry with
:func:`seed_of` (``seed``, optimizer step, schedule step, stage, micro-batch; micro-batches numbered
across data-parallel replicas: replica r's j-th is r * n + j) and put back as found on exit. A
recompute of that forward (activation checkpointing) must draw the same numbers again: torch's
checkpoint does when it preserves the RNG state, an engine that recomputes a whole stage re-enters
:func:`drawing` with the same position. The public face is :mod:`pipecheck.randomness`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def seed_of(seed: int, *, step: int, schedule_step: int, stage: int, microbatch: int) -> int:
    """The seed of one stage's forward of one micro-batch (a 63-bit integer; the same in every process)."""
    key = f"pipecheck-rng/{int(seed)}/{int(step)}/{int(schedule_step)}/{int(stage)}/{int(microbatch)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)


NATIVE_DROPOUT = "aten::native_dropout"  # (input * mask / (1 - p), mask): its first output is not a draw

_PLAIN: set[Any] = set()  # ops seen not to draw: every op of a replayed run passes here, most of them often


def draws_random(func: Any, args: Any = (), kwargs: Any = None) -> bool:
    """Whether a dispatched op draws random numbers: tagged so by torch, and not an attention kernel
    called with ``dropout_p=0`` (tagged, drawing nothing)."""
    if func in _PLAIN:
        return False
    if not (isinstance(func, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in func.tags):
        _PLAIN.add(func)
        return False
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = (kwargs or {}).get("dropout_p", args[index] if index < len(args) else argument.default_value)
            return value not in (0, 0.0, None)
    return True


def _accelerator() -> str | None:
    """The accelerator whose current device's generator a stage may draw from (None: CPU only)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "cuda"
    return None


@contextmanager
def drawing(seed: int, *, stage: int, microbatch: int, step: int = 0, schedule_step: int = 0) -> Iterator[int]:
    """The block is stage ``stage``'s forward of micro-batch ``microbatch``: torch's CPU generator and the
    current CUDA device's (where CUDA is in use) are seeded with :func:`seed_of` on entry and put back as
    they were on exit. Yields the seed."""
    value = seed_of(seed, step=step, schedule_step=schedule_step, stage=stage, microbatch=microbatch)
    device = _accelerator()
    cpu_state = torch.random.get_rng_state()
    device_state = torch.cuda.get_rng_state() if device == "cuda" else None
    torch.random.default_generator.manual_seed(value)
    if device == "cuda":
        torch.cuda.manual_seed(value)
    try:
        yield value
    finally:
        torch.random.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state)


@dataclass
class _Position:
    seed: int
    step: int
    schedule_step: int
    offset: int
    microbatch: int | None = None


_CURRENT: list[_Position] = []  # the innermost schedule step of this process (a check runs one at a time)
_LISTENERS: list[Callable[[int | None], None]] = []  # told each micro-batch's forward start (eager's replay)


def active() -> bool:
    """Whether a schedule step of a check with random ops is running here."""
    return bool(_CURRENT)


@contextmanager
def schedule_step(seed: int, step: int, schedule_step: int, offset: int = 0) -> Iterator[None]:
    """The block runs schedule step ``schedule_step`` of optimizer step ``step``; ``offset``: the number of
    this replica's first micro-batch among all replicas'."""
    _CURRENT.append(_Position(seed, step, schedule_step, offset))
    try:
        yield
    finally:
        _CURRENT.pop()


@contextmanager
def microbatch(index: int, backward: bool = False) -> Iterator[None]:
    """The block is micro-batch ``index``'s forward (or, ``backward``, its backward) of the current schedule
    step. Nothing outside a schedule step."""
    if not _CURRENT:
        yield
        return
    position = _CURRENT[-1]
    saved = position.microbatch
    position.microbatch = position.offset + index
    for listener in _LISTENERS if not backward else ():
        listener(position.microbatch)
    try:
        yield
    finally:
        position.microbatch = saved


def position() -> tuple[int, int, int] | None:
    """(optimizer step, schedule step, micro-batch) of the running micro-batch, None outside one."""
    here = _CURRENT[-1] if _CURRENT else None
    if here is None or here.microbatch is None:
        return None
    return here.step, here.schedule_step, here.microbatch


@contextmanager
def listening(listener: Callable[[int | None], None]) -> Iterator[None]:
    """``listener(micro-batch)`` is called as each micro-batch's forward starts while the block runs."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


@contextmanager
def stage_draws(stage: int) -> Iterator[None]:
    """Stage ``stage``'s forward of the running micro-batch draws by the contract (nothing outside a
    micro-batch of a check with random ops)."""
    if not _CURRENT or _CURRENT[-1].microbatch is None:
        yield
        return
    here = _CURRENT[-1]
    assert here.microbatch is not None
    with drawing(here.seed, stage=stage, microbatch=here.microbatch, step=here.step,
                 schedule_step=here.schedule_step):
        yield
