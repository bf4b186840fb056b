"""A correct zero-bubble runner, and mutants of it that each plant ONE bug of a split backward.

    runner = MUTANTS["weight_run_twice"]
    pc.assert_equivalent(entry.factory(), args, kwargs, runner=runner, n_microbatches=4, ...)
    # EquivalenceError naming "grad layers.0.fc.weight"

:class:`ZeroBubbleRunner` is :class:`BaseRunner` with its backward split as
pipecheck's ZB-H1 schedule ("zb") splits it: every stage's backward of a
micro-batch is an I (``stage_backward_input``: the input gradients, passed
upstream at once) and a later W (``stage_backward_weight``: the weight
gradients from the graph I kept), run in the order of the schedule's
simulated timeline. Each decision about W is one method (which W run, what
an I keeps for its W, how a W computes); a mutant overrides one of them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pipecheck import Stage

# private: planted zero-bubble bugs change the runtime's own stage steps
from pipecheck._runtime.stage_step import (
    PendingWeights,
    StageForward,
    add_leaf_grads,
    stage_backward_input,
    stage_backward_weight,
    trainable_params,
)
from pipecheck._schedule.sim import simulate
from pipecheck.schedules import Action, make_schedule

from .runners import FIRST_GRAD, STAGE_1_PARAM, BaseRunner, _merge_input_grads

Key = tuple[int, str, int]  # (producer stage, value name, micro-batch)


class ZeroBubbleRunner(BaseRunner):
    """The correct runner with ZB-H1's split backward (no bug)."""

    name = "zero_bubble_base"
    bug = "none: the correct zero-bubble runner"

    # --- the decisions about W; a mutant overrides one -------------------------------------------

    def order(self, n_stages: int, n: int) -> list[Action]:
        """Every I and W action, in the order the "zb" schedule's timeline runs them."""
        schedule = make_schedule("zb", n_stages, n)
        timeline = simulate(schedule)
        timed = [(start, rank, action) for rank, row in enumerate(schedule.actions)
                 for action, start in zip(row, timeline.starts[rank], strict=True)]
        return [action for _, _, action in sorted(timed, key=lambda t: (t[0], t[1])) if action.kind in "IW"]

    def keep(self, saved: dict[tuple[int, int], PendingWeights], stage: int, mb: int,
             pending: PendingWeights) -> None:
        """What an I leaves for its W: this micro-batch's graph and output gradients, by (stage, mb)."""
        saved[(stage, mb)] = pending

    def weights_of(self, saved: dict[tuple[int, int], PendingWeights], stage: int, mb: int) -> PendingWeights:
        """What the W of (stage, mb) computes from."""
        return saved.pop((stage, mb))

    def weight_gradients(self, stage: Stage, pending: PendingWeights) -> dict[str, torch.Tensor]:
        """The W itself: weight gradients from the kept graph (which it frees)."""
        return stage_backward_weight(stage, pending)

    # --- the backward -------------------------------------------------------------------------------

    def _backward(self, stages: list[Stage], forwards: dict[tuple[int, int], StageForward],
                  losses: dict[int, torch.Tensor], mbs: list[int], n: int
                  ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        pending_grads: dict[Key, list[tuple[int, Any]]] = {}
        per_stage: list[dict[str, torch.Tensor]] = [{} for _ in stages]
        model_input_grads: dict[tuple[str, int], Any] = {}
        saved: dict[tuple[int, int], PendingWeights] = {}
        last = len(stages) - 1
        for action in self.order(len(stages), n):
            stage, mb = stages[action.stage], action.microbatch
            if mb not in mbs:
                continue
            if action.kind == "W":
                self.accumulate(per_stage[stage.index], self.weight_gradients(stage, self.weights_of(
                    saved, stage.index, mb)))
                continue
            out_grads = [self.combine_output_grads(pending_grads.pop((stage.index, name, mb), []))
                         for name in stage.outputs]
            in_grads, pending = stage_backward_input(stage, forwards[(stage.index, mb)], out_grads,
                                                     losses[mb] if stage.index == last else None, self.loss_scale(n))
            self.keep(saved, stage.index, mb, pending)
            for src, grads in zip(stage.inputs, in_grads, strict=True):
                if src.stage is None:
                    key = (src.name, mb)
                    model_input_grads[key] = add_leaf_grads(model_input_grads.get(key), grads)
                else:
                    pending_grads.setdefault((src.stage, src.name, mb), []).append((stage.index, grads))
        return per_stage, _merge_input_grads(model_input_grads, mbs)


# --- the mutants ------------------------------------------------------------------------------------


class WeightRunTwice(ZeroBubbleRunner):
    """Every rank runs its first W again at the end (its list of pending W still holds it). The
    engine keeps every graph (``retain_graph=True``), so autograd does not object: micro-batch 0's
    weight gradients are simply counted twice."""

    name = "weight_run_twice"
    located = 'how the engine handles gradients after computing them'
    hint = "micro-batch 0 counted twice"
    bug = "a W action run twice (graphs retained, so nothing raises): micro-batch 0's weight gradients added again"

    def expect(self, model: str) -> tuple[str, ...]:
        return (FIRST_GRAD[model],)

    def order(self, n_stages: int, n: int) -> list[Action]:
        return super().order(n_stages, n) + [Action("W", s, 0) for s in range(n_stages)]

    def weights_of(self, saved: dict[tuple[int, int], PendingWeights], stage: int, mb: int) -> PendingWeights:
        return saved[(stage, mb)]  # kept for a second run

    def weight_gradients(self, stage: Stage, pending: PendingWeights) -> dict[str, torch.Tensor]:
        params = trainable_params(stage)
        if not pending.roots or not params:
            return {}
        grads = torch.autograd.grad(pending.roots, [p for _, p in params], pending.seeds, retain_graph=True,
                                    allow_unused=True)
        return {fqn: g for (fqn, _), g in zip(params, grads, strict=True) if g is not None}


class WeightDropped(ZeroBubbleRunner):
    """Each rank's action loop stops one action early; in ZB-H1 every rank ends with a W, so each
    stage's last W never runs. Outputs and loss are right; only weight gradients are short."""

    name = "weight_dropped"
    located = 'micro-batch 3 never reached it'
    bug = "a W action dropped (the action loop stops one early): the last micro-batch's weight gradients missing"

    def expect(self, model: str) -> tuple[str, ...]:
        return (FIRST_GRAD[model],)

    def order(self, n_stages: int, n: int) -> list[Action]:
        return [a for a in super().order(n_stages, n) if not (a.kind == "W" and a.microbatch == n - 1)]


class WeightCrossesMicrobatches(ZeroBubbleRunner):
    """One output-gradient slot per stage, overwritten by every I: a W runs its own micro-batch's graph
    with the output gradient of the latest I. Rank 0 runs each W right after its I (correct there);
    rank r defers W by r micro-batches, so stage 1's W pairs with a later micro-batch's gradient."""

    name = "weight_crosses_microbatches"
    located = 'how the engine handles gradients after computing them'
    bug = "an I/W pair crossing micro-batches: W seeded with the latest I's output gradient, not its own"
    EXPECT: ClassVar[dict[str, str]] = STAGE_1_PARAM  # stage 1: the first whose W are deferred

    def __init__(self) -> None:
        self.slot: dict[int, list[torch.Tensor]] = {}

    def expect(self, model: str) -> tuple[str, ...]:
        return (self.EXPECT[model],)

    def keep(self, saved: dict[tuple[int, int], PendingWeights], stage: int, mb: int,
             pending: PendingWeights) -> None:
        saved[(stage, mb)] = pending
        self.slot[stage] = pending.seeds  # the stage's one slot, overwritten

    def weights_of(self, saved: dict[tuple[int, int], PendingWeights], stage: int, mb: int) -> PendingWeights:
        return PendingWeights(saved.pop((stage, mb)).roots, self.slot[stage])


ZERO_BUBBLE_MUTANT_TYPES: tuple[type[ZeroBubbleRunner], ...] = (WeightRunTwice, WeightDropped,
                                                                 WeightCrossesMicrobatches)
