"""The rank side every engine shares: prepare together, step, report by original FQN.

    def my_rank_step(ctx, plan):                              # what the driver's EngineRunner sends
        report = MyRankResult(ctx.rank)
        prepared = prepare_together(ctx, report, lambda: build_my_engine(ctx, plan))
        if prepared is None:
            return report                                     # every rank stopped; the failing ones say why
        ...step the engine...
        report.stage_grads[stage], unmapped = grads_by_fqn(stage_module, original_fqn)

A rank that fails while preparing (tracing, building its stages) has not communicated yet: every
rank agrees on that before the engine's first message, so none waits for a peer that gave up and the
World's processes stay up. A failure inside the engine's step raises, and the World reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn as nn

from pipecheck._core.result import RankReport
from pipecheck._world.worker import RankContext, any_rank
from pipecheck.errors import RankError

Prepared = TypeVar("Prepared")

# An engine's name for a stage's parameter or buffer (and the tensor) -> the model's FQN, or None.
OriginalName = Callable[[str, torch.Tensor], "str | None"]


def prepare_together(ctx: RankContext, report: RankReport, prepare: Callable[[], Prepared | None]
                     ) -> Prepared | None:
    """``prepare()`` on this rank, then an agreement of all ranks: what it returned when every rank
    prepared, else None on every rank (a rank that raised has its RankError in ``report.failure``;
    ``prepare`` returns None for a refusal it recorded in ``report`` itself)."""
    prepared: Prepared | None = None
    try:
        prepared = prepare()
    except Exception as err:
        report.failure = RankError.from_exception(err, ctx.rank, ctx.stage, ctx.action)
    if any_rank(ctx, prepared is None):
        return None
    return prepared


def grads_by_fqn(module: nn.Module, original: OriginalName, gradient: str = "grad"
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A stage module's parameter gradients (on the CPU) by the model's FQNs, and the engine's names
    that map to none. Parameters an engine copied per call of one module (one FQN) are summed.
    ``gradient``: the attribute the engine keeps them in (Megatron's DDP: ``"main_grad"``)."""
    grads: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    unmapped = []
    for local, param in module.named_parameters(remove_duplicate=False):
        held = getattr(param, gradient, None)
        if id(param) in seen or held is None:
            continue
        seen.add(id(param))
        fqn = original(local, param)
        if fqn is None:
            unmapped.append(local)
            continue
        grad = held.detach().cpu()
        grads[fqn] = grads[fqn] + grad if fqn in grads else grad
    return grads, unmapped


def buffers_by_fqn(module: nn.Module, original: OriginalName) -> dict[str, torch.Tensor]:
    """A stage module's buffers after the step (CPU copies) by the model's FQNs; those no FQN names
    are left out."""
    found: dict[str, torch.Tensor] = {}
    for local, buffer in module.named_buffers(remove_duplicate=False):
        fqn = original(local, buffer)
        if fqn is not None:
            found[fqn] = buffer.detach().cpu().clone()
    return found
