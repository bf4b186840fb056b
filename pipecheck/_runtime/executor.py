"""pipecheck's stage executor: one rank's share of a pipelined training step.

    results = world.run(rank_step, StepSpec(...))     # every rank: split, run its actions
    results[r].stage_grads[stage][fqn], results[r].outputs[mb], results[r].events

Each rank builds the stages the schedule gives it: the model's structure on
the meta device, cut along the driver's traced graph (the spec's recipe; no
trace on the rank), its own stages made real with the driver's values (the
spec's state file: pipecheck._split.stage_build); where that cannot be done
safely, it builds the whole model from the spec's seeded factory, as before.
It then runs its list of actions: a forward receives the stage's inputs from
whichever ranks produce them (a skip connection comes straight from its producer), runs the stage and
sends each output to every consumer; a backward receives its outputs'
gradients from every consumer, sums them in descending consumer order (as the
reference does), and sends its inputs' gradients straight back to their
producers. A zero-bubble schedule splits a backward: its ``I`` does all of
that but keeps the weight gradients for the matching ``W``, which computes them
later from the same graph. After the last action, gradients of tied parameters are
all-reduced among the ranks holding replicas, so every replica ends with the
full gradient. The driver side (planning, merging) is the "distributed" runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.precision import PLAIN, Precision
from pipecheck._core.result import RankReport
from pipecheck._runtime.boundaries import Boundaries, instrument
from pipecheck._runtime.comm import Channel, Links, Posted
from pipecheck._runtime.ipc import sharing_for
from pipecheck._runtime.randomness import microbatch
from pipecheck._runtime.reference import sum_stage_grads
from pipecheck._runtime.stage_step import (
    InputGradKey,
    LeafGrads,
    PendingWeights,
    StageForward,
    add_leaf_grads,
    add_param_grads,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
    stage_forward,
)
from pipecheck._runtime.timeline import Event
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import shard_batch, split_microbatches
from pipecheck._split.pipe import Pipe, Stage, split_on
from pipecheck._split.stage_build import split_own_stages
from pipecheck._world.worker import RankContext
from pipecheck.losses import MicrobatchLoss, Reduction
from pipecheck.policies import Policy
from pipecheck.schedules import Action, Schedule


@dataclass(frozen=True)
class StepSpec:
    """What every rank receives for one step: how to split the model, its inputs, the schedule."""

    model: Callable[[], nn.Module]  # seeded and picklable (a ModelFactory is built on the rank's device)
    split_spec: Mapping[str, Any] | None
    policy: Policy | None
    tracer: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    target: Any
    schedule: Schedule
    record: bool = False  # record boundary values (a failing check's second run, to find where it diverges)
    reduction: Reduction | None = None  # how micro-batch losses add up (None: their mean)
    recipe: bytes | None = None  # the driver's split (pipe.recipe.dumps()): ranks cut along it, no trace
    precision: Precision = PLAIN  # forwards under its autocast, gradients summed in its grad_accumulation
    # The driver's file of its split's tensors (pipecheck._split.stage_build), in the World's folder: a rank
    # builds only its own stages, with these values. None: every rank builds the whole model.
    state: str | None = None

    def split_on(self, device: torch.device, stages: frozenset[int] | None = None) -> Pipe:
        """This rank's split of the model, built on ``device``: the driver's graph, traced again only
        where there is no recipe or it names another device. Given the rank's ``stages`` and the
        driver's ``state``, only those stages are built (the others stay on meta), where that is safe."""
        if stages is not None and self.state is not None and self.recipe is not None:
            pipe = split_own_stages(device, self.model, self.recipe, self.args, self.kwargs, stages, self.state)
            if pipe is not None:
                return pipe
        return split_on(device, self.model, self.args, self.kwargs, split_spec=self.split_spec,
                        policy=self.policy, tracer=self.tracer, recipe=self.recipe)


@dataclass
class RankResult(RankReport):
    """What one rank sends back to the driver (CPU tensors only)."""

    outputs: dict[int, list[Any]] = field(default_factory=dict)  # mb -> output leaves (last stage)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[InputGradKey, LeafGrads] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class Replica:
    """One pipeline among ``count`` data-parallel ones: its ``index``, its first global rank, and the
    process group of its ranks (None: the whole World is this one pipeline)."""

    index: int = 0
    count: int = 1
    first_rank: int = 0
    group: Any = None


def dependencies(pipe: Pipe) -> dict[int, set[int]]:
    """Producer stages of each stage, from the split's edges (skips included)."""
    return {s.index: {src.stage for src in s.inputs if src.stage is not None} for s in pipe.stages}


def _detached(value: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def to_host(value: Any) -> Any:
    """Every tensor in ``value`` on the host, in one go: from a GPU each is copied into pinned memory
    without blocking, and the copies are waited for once at the end (no sync per tensor)."""
    leaves, spec = pytree.tree_flatten(value)
    on_gpu = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_cuda]
    copies: dict[int, torch.Tensor] = {}
    for leaf in on_gpu:
        host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=True)
        copies[id(leaf)] = host.copy_(leaf.detach(), non_blocking=True)
    if on_gpu:
        torch.cuda.synchronize(on_gpu[0].device)
    moved = [copies.get(id(leaf), leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf) for leaf in leaves]
    return pytree.tree_unflatten(moved, spec)


class StageExecutor:
    """Executes one rank's actions of one step."""

    def __init__(self, ctx: RankContext, spec: StepSpec, *, replica: Replica | None = None) -> None:
        """``replica``: this rank's pipeline among several data-parallel ones (its ranks, its group)."""
        self.ctx = ctx
        self.rank = ctx.rank
        self.replica = replica or Replica()
        self.schedule = spec.schedule
        self.stage_to_rank = tuple(rank + self.replica.first_rank for rank in spec.schedule.stage_to_rank)
        # Only this rank's stages are built where the driver sent its tensors; the others stay on meta.
        self.pipe = spec.split_on(ctx.device, frozenset(s for s, r in enumerate(self.stage_to_rank) if r == self.rank))
        self.recorder = Boundaries() if spec.record else None
        if self.recorder is not None:
            instrument(self.pipe, self.recorder)
        self.links = Links(self.pipe, self.stage_to_rank, ctx.device, ctx.comm_device, ctx.secret,
                           sharing_for(ctx))
        self.n_microbatches = spec.schedule.n_microbatches
        self.loss_fn = spec.loss_fn
        self.precision = spec.precision
        self.use_batch(spec.args, spec.kwargs, spec.target, spec.reduction)
        self.consumers: dict[tuple[int, str], list[int]] = {}
        for edge in self.pipe.edges:
            if edge.src is not None:
                self.consumers.setdefault((edge.src, edge.name), []).append(edge.dst)
        for key in self.consumers:
            self.consumers[key].sort(reverse=True)  # gradient sum order: last consumer first
        self._reset()

    def use_batch(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any,
                  reduction: Reduction | None) -> None:
        """The inputs and loss of the next steps (a training loop's next batch). Every rank runs the same
        batches, so all of them forget the channels' layouts together when a shape changes."""
        n = self.n_microbatches
        inputs = cast_inputs(self.pipe.bind_inputs(args, kwargs), None, self.ctx.device)
        uneven = reduction is not None and reduction.uneven
        replica = self.replica
        if replica.count > 1:  # this replica's shard of the batch (the data-parallel split comes first)
            inputs = shard_batch(inputs, replica.count, uneven)[replica.index]
            target = shard_batch(target, replica.count, uneven, "target")[replica.index]
        shapes = [tuple(leaf.shape) for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]
        if getattr(self, "_shapes", shapes) != shapes:
            self.links.layouts.clear()
            self.links.sent_layouts.clear()
        self._shapes = shapes
        self.inputs = split_microbatches(inputs, n, uneven=uneven)
        sizes = {tuple(tuple(leaf.shape) for leaf in pytree.tree_leaves(mb) if isinstance(leaf, torch.Tensor))
                 for mb in self.inputs}
        self.links.every_microbatch = len(sizes) > 1  # unequal micro-batches: no layout can be reused
        self.loss_of = MicrobatchLoss(self.loss_fn, cast_inputs(target, None, self.ctx.device), n, reduction)
        self.loss_scale = 1.0 / n if reduction is None else reduction.weight

    def _reset(self) -> None:
        """Fresh per-step state; the split, inputs and links' layouts are kept across steps."""
        self.forwards: dict[tuple[int, int], StageForward] = {}
        self.local_values: dict[tuple[int, str, int], Any] = {}
        self.local_grads: dict[tuple[int, str, int, int], LeafGrads] = {}
        self.result = RankResult(self.rank)
        self.loss_values: dict[int, torch.Tensor] = {}
        self.owned: dict[int, set[str]] = {}  # per stage: gradients summed in place (see add_param_grads)
        self.weights_pending: dict[tuple[int, int], PendingWeights] = {}  # (stage, mb): I ran, W has not
        if self.recorder is not None:
            self.recorder.values.clear()
            self.recorder.forwards.clear()

    def _mine(self, stage: int) -> bool:
        return self.stage_to_rank[stage] == self.rank

    def _record(self, category: str, name: str, start: int) -> None:
        self.result.events.append(Event(self.rank, category, name, start, time.monotonic_ns()))

    def _channel_order(self, channels: list[Channel]) -> list[Channel]:
        """Remote channels in one canonical order on both ends, so that backends which match
        messages by order (NCCL ignores tags) pair every send with its receive."""
        return sorted(channels, key=self.links.channel_ids.__getitem__)

    def _outgoing(self, s: int) -> list[Channel]:
        stage = self.pipe.stages[s]
        return self._channel_order([(s, name, c) for name in stage.outputs
                                    for c in self.consumers.get((s, name), ()) if not self._mine(c)])

    def _incoming(self, s: int) -> list[Channel]:
        stage = self.pipe.stages[s]
        return self._channel_order([(src.stage, src.name, s) for src in stage.inputs
                                    if src.stage is not None and not self._mine(src.stage)])

    def _post(self, action: Action) -> dict[Channel, Posted]:
        """Post every receive ``action`` needs, in canonical channel order."""
        s, mb = action.stage, action.microbatch
        if action.kind == "W":
            return {}  # a weight gradient needs nothing from another rank
        if action.kind == "F":
            return {channel: self.links.post_value(*channel, mb) for channel in self._incoming(s)}
        outputs = dict(zip(self.pipe.stages[s].outputs, self.forwards[(s, mb)].outputs))
        return {channel: self.links.post_grads(*channel, mb, outputs[channel[1]]) for channel in self._outgoing(s)}

    def _can_prefetch(self, action: Action) -> bool:
        """A backward's gradient shapes are its forward's outputs; a forward needs known layouts."""
        if action.kind == "W":
            return True
        if action.kind in ("B", "I"):
            return (action.stage, action.microbatch) in self.forwards
        return all(self.links.can_post_value(*channel) for channel in self._incoming(action.stage))

    def forward(self, s: int, mb: int, posted: dict[Channel, Posted]) -> None:
        stage = self.pipe.stages[s]
        received: dict[tuple[int, str], Any] = {}
        for channel in self._incoming(s):
            start = time.monotonic_ns()
            received[(channel[0], channel[1])] = self.links.finish_value(posted[channel])
            self._record("recv", f"{s}F{mb}<-{channel[0]}", start)
        values = [self.inputs[mb][src.name] if src.stage is None
                  else self.local_values[(src.stage, src.name, mb)] if self._mine(src.stage)
                  else received[(src.stage, src.name)] for src in stage.inputs]
        start = time.monotonic_ns()
        # dropout masks by pipecheck's contract, where a training check asks; the loss under autocast too
        with microbatch(mb), self.precision.forward(self.ctx.device):
            fwd = stage_forward(stage, values)
            if s == self.pipe.num_stages - 1:
                self._loss(fwd, mb)
        self.forwards[(s, mb)] = fwd
        self._record("forward", f"{s}F{mb}", start)
        by_name = dict(zip(stage.outputs, fwd.outputs))
        for name in stage.outputs:
            if any(self._mine(c) for c in self.consumers.get((s, name), ())):
                self.local_values[(s, name, mb)] = by_name[name]
        for _, name, consumer in self._outgoing(s):
            start = time.monotonic_ns()
            self.links.send_value(s, name, consumer, mb, by_name[name])
            self._record("send", f"{s}F{mb}->{consumer}", start)

    def _loss(self, fwd: StageForward, mb: int) -> None:
        self.loss_values[mb] = self.loss_of(mb, pytree.tree_unflatten(list(fwd.outputs), self.pipe.out_spec))
        self.result.outputs[mb] = _detached(list(fwd.outputs))  # to the host once, after the step
        self.result.losses[mb] = self.loss_values[mb].detach()

    def backward(self, s: int, mb: int, posted: dict[Channel, Posted], weights_later: bool = False) -> None:
        """The backward of micro-batch ``mb`` through stage ``s`` (an ``I`` with ``weights_later``)."""
        kind = "I" if weights_later else "B"
        stage = self.pipe.stages[s]
        fwd = self.forwards.pop((s, mb))
        received: dict[tuple[str, int], LeafGrads] = {}
        for channel in self._outgoing(s):
            start = time.monotonic_ns()
            received[(channel[1], channel[2])] = self.links.finish_grads(posted[channel])
            self._record("recv", f"{s}{kind}{mb}<-{channel[2]}", start)
        out_grads: list[LeafGrads | None] = []
        for name in stage.outputs:
            total: LeafGrads | None = None
            for consumer in self.consumers.get((s, name), ()):  # descending, as the reference sums
                grads = self.local_grads.pop((s, name, mb, consumer)) if self._mine(consumer) \
                    else received[(name, consumer)]
                total = add_leaf_grads(total, grads)
            out_grads.append(total)
        start = time.monotonic_ns()
        last = s == self.pipe.num_stages - 1
        loss = self.loss_values.pop(mb) if last else None
        if weights_later:  # the weight gradients wait for this micro-batch's W
            with microbatch(mb, backward=True):  # a checkpointed region recomputes under the RNG state it saved
                in_grads, self.weights_pending[(s, mb)] = stage_backward_input(stage, fwd, out_grads, loss,
                                                                               self.loss_scale)
        else:
            with microbatch(mb, backward=True):
                in_grads, p_grads = stage_backward(stage, fwd, out_grads, loss, self.loss_scale)
            add_param_grads(self.result.stage_grads.setdefault(s, {}), self._accumulated(p_grads),
                            self.owned.setdefault(s, set()))
        self._record("backward", f"{s}{kind}{mb}", start)
        sent: dict[tuple[int, str], tuple[Any, LeafGrads]] = {}
        for src, value, grads in zip(stage.inputs, fwd.inputs, in_grads):
            if src.stage is None:
                self.result.input_grads[(s, src.name, mb)] = _detached(grads)
            elif self._mine(src.stage):
                self.local_grads[(src.stage, src.name, mb, s)] = grads
            else:
                sent[(src.stage, src.name)] = (value, grads)
        for producer, name, _ in self._incoming(s):
            start = time.monotonic_ns()
            self.links.send_grads(producer, name, s, mb, *sent[(producer, name)])
            self._record("send", f"{s}{kind}{mb}->{producer}", start)

    def backward_weight(self, s: int, mb: int) -> None:
        """The weight gradients of micro-batch ``mb`` through stage ``s`` (its ``W``), from the graph its
        ``I`` kept; accumulated in the order the W run (micro-batch order in pipecheck's schedules)."""
        start = time.monotonic_ns()
        p_grads = stage_backward_weight(self.pipe.stages[s], self.weights_pending.pop((s, mb)))
        add_param_grads(self.result.stage_grads.setdefault(s, {}), self._accumulated(p_grads),
                        self.owned.setdefault(s, set()))
        self._record("backward", f"{s}W{mb}", start)

    def _accumulated(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gradients in the dtype they are summed in (pc.Precision's grad_accumulation; else their own)."""
        dtype = self.precision.grad_accumulation
        return grads if dtype is None else {fqn: grad.to(dtype) for fqn, grad in grads.items()}

    def run_action(self, action: Action, posted: dict[Channel, Posted]) -> None:
        if action.kind == "F":
            self.forward(action.stage, action.microbatch, posted)
        elif action.kind == "W":
            self.backward_weight(action.stage, action.microbatch)
        else:
            self.backward(action.stage, action.microbatch, posted, weights_later=action.kind == "I")

    def sync_tied(self) -> None:
        """All-reduce (sum) tied parameters' gradients so every replica holds the full gradient."""
        for group in self.pipe.tied_groups:
            param = _parameter(self.pipe.stages[group.stages[0]], group.fqn)
            if not param.requires_grad:
                continue  # frozen: no replica has a gradient (the same on every rank)
            holders = [s for s in group.stages if self._mine(s)]
            local = sum_stage_grads([{group.fqn: self.result.stage_grads[s][group.fqn]} for s in holders
                                     if group.fqn in self.result.stage_grads.get(s, {})]).get(group.fqn)
            if len({self.stage_to_rank[s] for s in group.stages}) > 1:
                # A copy the collective may write into: autograd's gradient can be shared with another
                # parameter's (p + b) or a stride-0 broadcast view (x * p.sum()).
                dtype = local.dtype if local is not None else self.precision.grad_accumulation or param.dtype
                buffer = torch.zeros(param.shape, dtype=dtype, device=self.ctx.comm_device)
                if local is not None:
                    buffer.copy_(local)
                dist.all_reduce(buffer, group=self.replica.group)  # among this pipeline's ranks
                local = buffer.to(self.ctx.device)
            for s in holders:
                if local is not None:
                    self.result.stage_grads.setdefault(s, {})[group.fqn] = local

    def run(self) -> RankResult:
        """One step, its results on the host."""
        self.step()
        return self.collect()

    def step(self) -> None:
        """One step: this rank's actions, then the tied-gradient all-reduce; results stay on the device."""
        self._reset()
        actions = self.schedule.actions[self.rank - self.replica.first_rank]
        posted: dict[int, dict[Channel, Posted]] = {}
        for i, action in enumerate(actions):
            self.ctx.stage, self.ctx.action = action.stage, str(action)
            if i not in posted:
                posted[i] = self._post(action)
            # Post the next action's receives before computing this one: the data can land
            # while this rank computes, instead of after it reaches the next receive.
            # Not on NCCL: there sends and receives between two ranks share one ordered stream, and
            # a receive posted before this action's sends can deadlock (gloo matches by tag).
            if self.ctx.backend != "nccl" and i + 1 < len(actions) and self._can_prefetch(actions[i + 1]):
                posted[i + 1] = self._post(actions[i + 1])
            self.run_action(action, posted.pop(i))
        self.ctx.action = "wait sends"
        self.links.wait_sends()
        self.ctx.action = "tied all-reduce"
        self.sync_tied()
        self.result.buffers = {s: {fqn: b.detach().clone() for fqn, b in self.pipe.stages[s].named_buffers().items()}
                               for s in range(self.pipe.num_stages) if self._mine(s)}

    def collect(self) -> RankResult:
        """The step's results, moved to the host in one transfer."""
        self.ctx.action = "results to host"
        result = self.result
        result.outputs, result.losses, result.stage_grads, result.input_grads, result.buffers = to_host(
            (result.outputs, result.losses, result.stage_grads, result.input_grads, result.buffers))
        if self.recorder is not None:
            result.boundaries = self.recorder.exported()  # copied to the host as recorded
        self.ctx.stage, self.ctx.action = None, None
        return result


def _parameter(stage: Stage, fqn: str) -> torch.nn.Parameter:
    """The stage's own parameter object for canonical ``fqn``."""
    return next(p for local, p in stage.module.named_parameters(remove_duplicate=False)
                if stage.local_to_fqn.get(local) == fqn)


def rank_step(ctx: RankContext, spec: StepSpec) -> RankResult:
    """The function every rank runs for one step (top-level, so it pickles)."""
    return StageExecutor(ctx, spec).run()
