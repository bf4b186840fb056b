"""runner="torch" under pipecheck's randomness contract: torch's stage forwards drawn by it, torch's split checked.

    refuse_other_draws(job, pipe, torch_pipeline, stage_modules)   # the driver: InputError unless torch's split
                                                                    #   draws what pipecheck's split draws
    at = draw_by_contract(stage, seed)            # a rank: torch's forward_one_chunk(m) inside pc.randomness.drawing
    at.step, at.schedule_step = t, a              # before each schedule.step of a training loop

torch runs stage s's forward of micro-batch m as ``forward_one_chunk(m, ...)`` on every schedule pipecheck
drives (GPipe and looped BFS, 1F1B, interleaved 1F1B, the zero-bubble ones, DualPipeV's overlapped F+B)
and every torch version it supports; that call is drawn inside ``pc.randomness.drawing(seed, stage=s,
microbatch=m, step=t, schedule_step=a)``. torch's backward (a full B, or zero-bubble's I and W)
differentiates the graph that forward recorded and runs no forward again, so nothing is drawn twice; a
``torch.utils.checkpoint`` region in the model recomputes with the RNG state it saved inside ``drawing``.

Eager replays the draws of pipecheck's split, and torch cuts the model itself (``pipeline()`` exports it):
its stage s must draw the same random ops, in the same order and with the same numbers, as pipecheck's
stage s, or a correct pipeline would be compared with masks it never drew. Both splits run forward on the
first batch's micro-batches here, under the contract, before any rank starts; any difference refuses the
check, naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipecheck._runners.job import Job
from pipecheck._runtime.randomness import (
    NATIVE_DROPOUT,
    drawing,
    draws_random,
    microbatch,
    schedule_step,
)
from pipecheck._runtime.reference import DetachExecutor
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import split_microbatches, unwrap_replicated
from pipecheck._split.pipe import Pipe
from pipecheck.errors import InputError


@dataclass
class ContractPosition:
    """Where a rank's training loop is: the optimizer step and schedule step torch's next ``step`` runs."""

    step: int = 0
    schedule_step: int = 0


def draw_by_contract(stage: Any, seed: int) -> ContractPosition:
    """Run every ``forward_one_chunk(m, ...)`` of torch's ``stage`` inside ``pc.randomness.drawing`` at the
    returned position (on torch's stage object of this run, never the user's model)."""
    at = ContractPosition()
    forward = stage.forward_one_chunk
    index = stage.stage_index

    def drawn(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with drawing(seed, stage=index, microbatch=fwd_chunk_id, step=at.step, schedule_step=at.schedule_step):
            return forward(fwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = drawn
    return at


@dataclass
class _Drawn:
    stage: int | None
    op: str
    values: list[torch.Tensor]  # the draw itself (native_dropout: its mask)

    def text(self) -> str:
        shapes = ", ".join(str(tuple(v.shape)) for v in self.values)
        return f"{self.op} {shapes}"


class _DrawLog(TorchDispatchMode):
    """Every random op of the block, with the stage that ran it (``stage[0]``, set by the caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: list[int | None] = [None]
        self.drawn: list[_Drawn] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if draws_random(func, args, kwargs):
            name = func._schema.name
            leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
            kept = leaves[1:] if name == NATIVE_DROPOUT else leaves
            self.drawn.append(_Drawn(self.stage[0], name, [leaf.detach().clone() for leaf in kept]))
        return out


@contextmanager
def _noting(modules: Mapping[int, torch.nn.Module], log: _DrawLog, enter: Callable[[int], Any]) -> Iterator[None]:
    """While the block runs, each module's forward notes its stage on ``log`` inside ``enter(stage)``."""
    stack = ExitStack()
    handles = []

    def before(index: int) -> None:
        log.stage[0] = index
        stack.enter_context(enter(index))

    for index, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda *_, i=index: before(i)))
        handles.append(module.register_forward_hook(lambda *_, **__: stack.close(), always_call=True))
    try:
        with stack:
            yield
    finally:
        for handle in handles:
            handle.remove()


def _pipecheck_draws(pipe: Pipe, job: Job, seed: int) -> list[list[_Drawn]]:
    """Per micro-batch of the job's batch, the random ops pipecheck's split draws under the contract."""
    found = []
    with torch.no_grad(), pipe.buffers_restored(), schedule_step(seed, 0, 0):
        bound = pipe.bind_inputs(*cast_inputs((tuple(job.args), dict(job.kwargs)), None, torch.device(job.device)))
        for j, values in enumerate(split_microbatches(bound, job.n_microbatches)):
            log = _DrawLog()
            modules = {stage.index: stage.module for stage in pipe.stages}
            with microbatch(j), _noting(modules, log, lambda _: ExitStack()), log:
                DetachExecutor(pipe).forward_microbatch(values)
            found.append(log.drawn)
    return found


def _drawing_of(seed: int, microbatch: int, stage: int) -> Any:
    return drawing(seed, stage=stage, microbatch=microbatch)


def _torch_draws(torch_pipeline: Any, modules: Mapping[int, torch.nn.Module], job: Job, seed: int
                 ) -> list[list[_Drawn]]:
    """Per micro-batch, the random ops torch's own split draws with each stage module's forward inside
    ``pc.randomness.drawing``."""
    device = torch.device(job.device)
    args, kwargs = cast_inputs((tuple(job.args), dict(job.kwargs)), None, device)
    found = []
    with torch.no_grad():
        for j, (mb_args, mb_kwargs) in enumerate(split_microbatches((args, kwargs), job.n_microbatches)):
            mb_args, mb_kwargs = unwrap_replicated((mb_args, mb_kwargs))
            log = _DrawLog()
            with _noting(modules, log, functools.partial(_drawing_of, seed, j)), log:
                torch_pipeline(*mb_args, **mb_kwargs)
            found.append(log.drawn)
    return found


def _difference(ours: list[_Drawn], theirs: list[_Drawn]) -> str | None:
    """How torch's draws of a micro-batch differ from pipecheck's, in words (None: the same)."""
    for k, (mine, torch_s) in enumerate(zip(ours, theirs)):
        if (mine.stage, mine.op) != (torch_s.stage, torch_s.op) or \
                [v.shape for v in mine.values] != [v.shape for v in torch_s.values]:
            return (f"random op #{k + 1}: pipecheck's split draws {mine.text()} in stage {mine.stage}, torch's "
                    f"{torch_s.text()} in stage {torch_s.stage}")
        if not all(torch.equal(a, b.to(a.dtype)) for a, b in zip(mine.values, torch_s.values)):
            return (f"random op #{k + 1} ({mine.text()}, stage {mine.stage}) draws other numbers in torch's split "
                    "than in pipecheck's")
    if len(ours) != len(theirs):
        extra, who = (ours, "pipecheck's") if len(ours) > len(theirs) else (theirs, "torch's")
        rest = extra[min(len(ours), len(theirs))]
        return (f"pipecheck's split draws {len(ours)} random ops, torch's {len(theirs)}: random op "
                f"#{min(len(ours), len(theirs)) + 1} ({rest.text()} in stage {rest.stage}) is {who} only")
    return None


def refuse_other_draws(job: Job, pipe: Pipe, torch_pipeline: Any, stage_modules: list[torch.nn.Module]) -> None:
    """An InputError unless ``torch_pipeline`` (torch's ``pipeline()`` of the job's model, traced as the ranks
    trace it; ``stage_modules``: its stages' modules) draws exactly what pipecheck's split draws under the
    contract: the same random ops on the same stages, in the same order, with the same numbers (each
    micro-batch of the job's batch, run forward here before any rank starts)."""
    seed = job.random_seed
    if seed is None:
        return
    theirs_by_microbatch = _torch_draws(torch_pipeline, dict(enumerate(stage_modules)), job, seed)
    for j, (ours, theirs) in enumerate(zip(_pipecheck_draws(pipe, job, seed), theirs_by_microbatch)):
        differs = _difference(ours, theirs)
        if differs is not None:
            raise InputError(
                f"runner='torch' cannot check {pipe.model_name}'s random numbers: torch's pipeline() splits the "
                f"model itself, and its stages do not draw what pipecheck's split draws under pipecheck's "
                f"randomness contract (micro-batch {j}: {differs}), so eager would replay masks torch never drew "
                "and a correct pipeline would fail. Fix: runner='distributed' (pipecheck's runtime runs pipecheck's "
                "own split and follows the contract); model.eval() checks the deterministic model only: it leaves "
                "the engine's handling of randomness unchecked.")
