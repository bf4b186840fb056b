"""pipecheck's randomness contract: dropout masks that eager, the truth and every runner draw alike.

    follow(model_copy, ["blocks.0.drop", "blocks.1.drop"])    # on a private copy: never the user's
    with schedule_step(seed=0, step=1, schedule_step=0, offset=0):
        with microbatch(2):
            out = model_copy(x)                                 # masks keyed by (0, 1, 0, 2, fqn, call)

A dropout module (``nn.Dropout``, ``nn.Dropout1d/2d/3d``) in train mode with ``p > 0`` draws no
mask from torch's RNG. Its k-th call in micro-batch m (numbered across data-parallel replicas: replica
r's j-th is r * n + j) of schedule step a of optimizer step t draws, from a CPU generator seeded by a
hash of ``(seed, t, a, m, its FQN, k)``, float64 uniforms of the mask's shape (the input's; a
channel dropout's without its spatial dims) and keeps where they are ``>= p``, scaling by
``1 / (1 - p)``. The mask does not depend on the dtype, the device, the process or the order in
which stages run, so the eager model, its float64 copy, a recompute and every stage of every
runner draw the same one. Call counts restart with each micro-batch's forward and with its backward
(a recompute of activation checkpointing draws what the forward drew).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pipecheck.errors import EngineError

SUPPORTED: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_CHANNEL_DIMS: dict[type[nn.Module], int] = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}


def active_dropout(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the FQNs of dropout modules the contract covers that draw in this mode, those of other random
    modules it does not cover: ``nn.AlphaDropout``, ``nn.FeatureAlphaDropout``)."""
    covered: list[str] = []
    other: list[str] = []
    for name, module in model.named_modules():
        if not module.training or not isinstance(module, nn.modules.dropout._DropoutNd) or module.p == 0:
            continue
        (covered if type(module) in SUPPORTED else other).append(name)
    return covered, other


@dataclass
class _Position:
    seed: int
    step: int
    schedule_step: int
    offset: int
    microbatch: int | None = None
    calls: dict[str, int] = field(default_factory=dict)


_CURRENT: list[_Position] = []  # the innermost schedule step of this process (a check runs one at a time)


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
def microbatch(index: int) -> Iterator[None]:
    """The block is micro-batch ``index``'s forward (or backward) of the current schedule step; the call
    counts restart. Nothing outside a schedule step."""
    if not _CURRENT:
        yield
        return
    position = _CURRENT[-1]
    saved = position.microbatch, position.calls
    position.microbatch, position.calls = position.offset + index, {}
    try:
        yield
    finally:
        position.microbatch, position.calls = saved


def restart_calls(*_: object) -> None:
    """Restart the call counts of the current micro-batch (a forward pre-hook: every call of a model is
    then one micro-batch's forward, as when pipecheck probes the model's own randomness)."""
    if _CURRENT:
        _CURRENT[-1].calls = {}


def follow(root: nn.Module, fqns: Iterable[str]) -> None:
    """Make ``root``'s dropout modules named ``fqns`` (names inside ``root``, the model's FQNs) draw by the
    contract. Only ever on a private copy: the module's ``forward`` is replaced on the instance."""
    wanted = set(fqns)
    for name, module in root.named_modules():
        if name in wanted and isinstance(module, SUPPORTED):
            module.forward = functools.partial(_keyed_dropout, module, name)  # type: ignore[method-assign]


def _keyed_dropout(module: nn.Module, fqn: str, input: torch.Tensor) -> torch.Tensor:
    p = float(module.p)  # type: ignore[arg-type]
    if not module.training or p == 0:
        return input
    position = _CURRENT[-1] if _CURRENT else None
    if position is None or position.microbatch is None:
        raise EngineError(f"dropout module {fqn!r} drew a mask outside any micro-batch's forward or backward that "
                          "pipecheck's randomness contract knows (inside activation checkpointing's recompute in "
                          "the eager step, or an engine that does not follow the contract). Fix: check the model "
                          "in eval mode (model.eval()), or without checkpointing around its dropout.",
                          engine="pipecheck")
    call = position.calls.get(fqn, 0)
    position.calls[fqn] = call + 1
    if p >= 1:
        return input * 0
    key = f"{position.seed}/{position.step}/{position.schedule_step}/{position.microbatch}/{fqn}/{call}"
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
                                              & (2**63 - 1))
    channel = _CHANNEL_DIMS.get(type(module), 0)
    shape = tuple(input.shape[:input.dim() - channel]) + (1,) * min(channel, input.dim())
    keep = torch.rand(shape, generator=generator, dtype=torch.float64) >= p
    return input * keep.to(device=input.device, dtype=input.dtype) / (1 - p)
