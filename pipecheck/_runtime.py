"""pipecheck's distributed stage runtime: run a Pipe's stages on a World's ranks.

    with pc.World(world_size=4) as world:
        res = pc.run_pipeline(world, make_model, (x,), schedule="1f1b", n_microbatches=4)

Each rank splits the model (deterministically, from the job's seeded factory),
keeps the stages the schedule gives it, and runs its list of actions: a
forward receives the stage's inputs from whichever ranks produce them (a skip
connection comes straight from its producer), runs the stage and sends each
output to every consumer; a backward receives its outputs' gradients from
every consumer, sums them in descending consumer order (as the reference
does), and sends its inputs' gradients straight back to their producers.
After the last action, gradients of tied parameters are all-reduced among the
ranks holding replicas, so every replica ends with the full gradient.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from pipecheck._comm import Edge, Links, Posted
from pipecheck._errors import InputError
from pipecheck._job import Job, ModelFactory, cast_inputs
from pipecheck._microbatch import merge_microbatches, split_microbatches
from pipecheck._pipe import Pipe, Stage
from pipecheck._reference import sum_stage_grads
from pipecheck._result import StepResult
from pipecheck._stage_step import (
    LeafGrads,
    StageForward,
    add_leaf_grads,
    add_param_grads,
    stage_backward,
    stage_forward,
)
from pipecheck._timeline import Event, write_chrome_trace
from pipecheck._world import World
from pipecheck.losses import check_scalar_loss, default_microbatch_target, projection_loss
from pipecheck.schedules import Action, Schedule, make_schedule


@dataclass
class RankPlan:
    """What every rank receives: the job and the schedule (the same on all ranks)."""

    job: Job
    schedule: Schedule


@dataclass
class RankResult:
    """What one rank sends back to the driver (CPU tensors only)."""

    rank: int
    outputs: dict[int, list[Any]] = field(default_factory=dict)  # mb -> output leaves (last stage)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> fqn -> grad
    input_grads: dict[tuple[int, str, int], LeafGrads] = field(default_factory=dict)  # (stage, name, mb)
    events: list[Event] = field(default_factory=list)


def dependencies(pipe: Pipe) -> dict[int, set[int]]:
    """Producer stages of each stage, from the split's edges (skips included)."""
    return {s.index: {src.stage for src in s.inputs if src.stage is not None} for s in pipe.stages}


def _cpu(value: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


class _RankRunner:
    """Executes one rank's actions of one step."""

    def __init__(self, ctx: Any, plan: RankPlan) -> None:
        job = plan.job
        self.ctx = ctx
        self.job = job
        self.schedule = plan.schedule
        factory = job.model
        if isinstance(factory, ModelFactory):
            factory = dataclasses.replace(factory, device=ctx.device)
        self.pipe = dataclasses.replace(job, model=factory).split()
        self.rank = ctx.rank
        self.stage_to_rank = plan.schedule.stage_to_rank
        self.links = Links(self.pipe, self.stage_to_rank, ctx.device, ctx.comm_device)
        n = job.n_microbatches
        inputs = cast_inputs(self.pipe.bind_inputs(job.args, job.kwargs), None, ctx.device)
        self.inputs = split_microbatches(inputs, n)
        target = cast_inputs(job.target, None, ctx.device)
        self.targets = split_microbatches(target, n, "target") if target is not None else [None] * n
        self.consumers: dict[tuple[int, str], list[int]] = {}
        for edge in self.pipe.edges:
            if edge.src is not None:
                self.consumers.setdefault((edge.src, edge.name), []).append(edge.dst)
        for key in self.consumers:
            self.consumers[key].sort(reverse=True)  # gradient sum order: last consumer first
        self._reset()

    def _reset(self) -> None:
        """Fresh per-step state; the split, inputs and links' layouts are kept across steps."""
        self.forwards: dict[tuple[int, int], StageForward] = {}
        self.local_values: dict[tuple[int, str, int], Any] = {}
        self.local_grads: dict[tuple[int, str, int, int], LeafGrads] = {}
        self.result = RankResult(self.rank)
        self.loss_values: dict[int, torch.Tensor] = {}
        self.owned: dict[int, set[str]] = {}  # per stage: gradients summed in place (see add_param_grads)

    def _mine(self, stage: int) -> bool:
        return self.stage_to_rank[stage] == self.rank

    def _record(self, category: str, name: str, start: int) -> None:
        self.result.events.append(Event(self.rank, category, name, start, time.monotonic_ns()))

    def _edge_order(self, edges: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
        """Remote edges in one canonical order on both ends, so that backends which match
        messages by order (NCCL ignores tags) pair every send with its receive."""
        return sorted(edges, key=self.links.edge_ids.__getitem__)

    def _outgoing(self, s: int) -> list[tuple[int, str, int]]:
        stage = self.pipe.stages[s]
        return self._edge_order([(s, name, c) for name in stage.outputs
                                 for c in self.consumers.get((s, name), ()) if not self._mine(c)])

    def _incoming(self, s: int) -> list[tuple[int, str, int]]:
        stage = self.pipe.stages[s]
        return self._edge_order([(src.stage, src.name, s) for src in stage.inputs
                                 if src.stage is not None and not self._mine(src.stage)])

    def _post(self, action: Action) -> dict[Edge, Posted]:
        """Post every receive ``action`` needs, in canonical edge order."""
        s, mb = action.stage, action.microbatch
        if action.kind == "F":
            return {edge: self.links.post_value(*edge, mb) for edge in self._incoming(s)}
        outputs = dict(zip(self.pipe.stages[s].outputs, self.forwards[(s, mb)].outputs))
        return {edge: self.links.post_grads(*edge, mb, outputs[edge[1]]) for edge in self._outgoing(s)}

    def _can_prefetch(self, action: Action) -> bool:
        """A backward's gradient shapes are its forward's outputs; a forward needs known layouts."""
        if action.kind == "B":
            return (action.stage, action.microbatch) in self.forwards
        return all(self.links.can_post_value(*edge) for edge in self._incoming(action.stage))

    def forward(self, s: int, mb: int, posted: dict[Edge, Posted]) -> None:
        stage = self.pipe.stages[s]
        received: dict[tuple[int, str], Any] = {}
        for edge in self._incoming(s):
            start = time.monotonic_ns()
            received[(edge[0], edge[1])] = self.links.finish_value(posted[edge])
            self._record("recv", f"{s}F{mb}<-{edge[0]}", start)
        values = [self.inputs[mb][src.name] if src.stage is None
                  else self.local_values[(src.stage, src.name, mb)] if self._mine(src.stage)
                  else received[(src.stage, src.name)] for src in stage.inputs]
        start = time.monotonic_ns()
        fwd = stage_forward(stage, values)
        self.forwards[(s, mb)] = fwd
        if s == self.pipe.num_stages - 1:
            self._loss(fwd, mb)
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
        outputs = pytree.tree_unflatten(list(fwd.outputs), self.pipe.out_spec)
        loss_fn = self.job.loss_fn or projection_loss
        target = self.targets[mb] if self.job.loss_fn is not None else default_microbatch_target(outputs, mb)
        self.loss_values[mb] = check_scalar_loss(loss_fn(outputs, target), loss_fn)
        self.result.outputs[mb] = _cpu(list(fwd.outputs))
        self.result.losses[mb] = self.loss_values[mb].detach().cpu()

    def backward(self, s: int, mb: int, posted: dict[Edge, Posted]) -> None:
        stage = self.pipe.stages[s]
        fwd = self.forwards.pop((s, mb))
        received: dict[tuple[str, int], LeafGrads] = {}
        for edge in self._outgoing(s):
            start = time.monotonic_ns()
            received[(edge[1], edge[2])] = self.links.finish_grads(posted[edge])
            self._record("recv", f"{s}B{mb}<-{edge[2]}", start)
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
        in_grads, p_grads = stage_backward(stage, fwd, out_grads, self.loss_values.pop(mb) if last else None,
                                           1.0 / self.job.n_microbatches)
        add_param_grads(self.result.grads.setdefault(s, {}), p_grads, self.owned.setdefault(s, set()))
        self._record("backward", f"{s}B{mb}", start)
        sent: dict[tuple[int, str], tuple[Any, LeafGrads]] = {}
        for src, value, grads in zip(stage.inputs, fwd.inputs, in_grads):
            if src.stage is None:
                self.result.input_grads[(s, src.name, mb)] = _cpu(grads)
            elif self._mine(src.stage):
                self.local_grads[(src.stage, src.name, mb, s)] = grads
            else:
                sent[(src.stage, src.name)] = (value, grads)
        for producer, name, _ in self._incoming(s):
            start = time.monotonic_ns()
            self.links.send_grads(producer, name, s, mb, *sent[(producer, name)])
            self._record("send", f"{s}B{mb}->{producer}", start)

    def sync_tied(self) -> None:
        """All-reduce (sum) tied parameters' gradients so every replica holds the full gradient."""
        for group in self.pipe.tied_groups:
            param = _parameter(self.pipe.stages[group.stages[0]], group.fqn)
            if not param.requires_grad:
                continue  # frozen: no replica has a gradient (the same on every rank)
            holders = [s for s in group.stages if self._mine(s)]
            local = sum_stage_grads([{group.fqn: self.result.grads[s][group.fqn]} for s in holders
                                     if group.fqn in self.result.grads.get(s, {})]).get(group.fqn)
            if len({self.stage_to_rank[s] for s in group.stages}) > 1:
                # A copy the collective may write into: autograd's gradient can be shared with another
                # parameter's (p + b) or a stride-0 broadcast view (x * p.sum()).
                buffer = torch.zeros(param.shape, dtype=param.dtype, device=self.ctx.comm_device)
                if local is not None:
                    buffer.copy_(local)
                dist.all_reduce(buffer)
                local = buffer.to(self.ctx.device)
            for s in holders:
                if local is not None:
                    self.result.grads.setdefault(s, {})[group.fqn] = local

    def run(self) -> RankResult:
        """One step: this rank's actions, then the tied-gradient all-reduce."""
        self._reset()
        actions = self.schedule.actions[self.rank]
        posted: dict[int, dict[Edge, Posted]] = {}
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
            (self.forward if action.kind == "F" else self.backward)(action.stage, action.microbatch, posted.pop(i))
        self.ctx.action = "wait sends"
        self.links.wait_sends()
        self.ctx.action = "tied all-reduce"
        self.sync_tied()
        self.ctx.stage, self.ctx.action = None, None
        self.result.grads = {s: _cpu(g) for s, g in self.result.grads.items()}
        return self.result


def _parameter(stage: Stage, fqn: str) -> torch.nn.Parameter:
    """The stage's own parameter object for canonical ``fqn``."""
    return next(p for local, p in stage.module.named_parameters(remove_duplicate=False)
                if stage.local_to_fqn.get(local) == fqn)


def rank_step(ctx: Any, plan: RankPlan) -> RankResult:
    """The function every rank runs for one step (top-level, so it pickles)."""
    # Ranks share the machine's cores: intra-op threads per rank would oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    return _RankRunner(ctx, plan).run()


def make_plan(job: Job, pipe: Pipe) -> RankPlan:
    schedule = job.schedule if isinstance(job.schedule, Schedule) else \
        make_schedule(str(job.schedule), pipe.num_stages, job.n_microbatches, job.stages_per_rank)
    if schedule.n_stages != pipe.num_stages or schedule.n_microbatches != job.n_microbatches:
        raise InputError(f"schedule {schedule.name!r} is for {schedule.n_stages} stages and "
                         f"{schedule.n_microbatches} micro-batches, but the split has {pipe.num_stages} stages "
                         f"and n_microbatches={job.n_microbatches}. Fix: build the schedule for this split.")
    schedule.validate(dependencies(pipe))
    return RankPlan(dataclasses.replace(job, options={}), schedule)  # options hold driver-only objects


def merge_rank_results(pipe: Pipe, results: Sequence[RankResult], n_microbatches: int) -> StepResult:
    outputs: dict[int, list[Any]] = {}
    losses: dict[int, torch.Tensor] = {}
    stage_grads: dict[int, dict[str, torch.Tensor]] = {}
    input_grads: dict[tuple[int, str, int], LeafGrads] = {}
    for result in results:
        outputs.update(result.outputs)
        losses.update(result.losses)
        stage_grads.update(result.grads)
        input_grads.update(result.input_grads)
    merged = merge_microbatches([pytree.tree_unflatten(outputs[m], pipe.out_spec) for m in range(n_microbatches)])
    grads: dict[str, torch.Tensor] = {}
    for s in range(pipe.num_stages):  # a tied parameter's replicas all hold the full gradient: take the first
        for fqn, grad in stage_grads.get(s, {}).items():
            grads.setdefault(fqn, grad)
    replicas = {group.fqn: {s: stage_grads[s][group.fqn] for s in group.stages if group.fqn in stage_grads.get(s, {})}
                for group in pipe.tied_groups}
    return StepResult(merged, torch.stack([losses[m] for m in range(n_microbatches)]).mean(), grads,
                      _merge_input_grads(input_grads, n_microbatches),
                      stage_grads=[stage_grads.get(s, {}) for s in range(pipe.num_stages)],
                      replica_grads={fqn: by_stage for fqn, by_stage in replicas.items() if by_stage})


def _merge_input_grads(per_key: Mapping[tuple[int, str, int], LeafGrads], n: int) -> dict[str, torch.Tensor]:
    names = sorted({name for _, name, _ in per_key})
    merged: dict[str, torch.Tensor] = {}
    for name in names:
        stages = sorted({s for s, nm, _ in per_key if nm == name}, reverse=True)
        chunks = []
        for mb in range(n):
            total: LeafGrads | None = None
            for s in stages:
                total = add_leaf_grads(total, per_key[(s, name, mb)])
            chunks.append(total[0] if total and len(total) == 1 else None)
        if all(c is not None for c in chunks):
            merged[name] = merge_microbatches(chunks)
    return merged


def execute(world: World, job: Job, pipe: Pipe | None = None) -> StepResult:
    """Run ``job`` on ``world`` and gather one StepResult (``pipe``: the job's split, if made already)."""
    pipe = pipe or job.split()
    plan = make_plan(job, pipe)
    if plan.schedule.n_ranks != world.world_size:
        raise InputError(f"schedule {plan.schedule.name!r} needs {plan.schedule.n_ranks} ranks but the World has "
                         f"{world.world_size}. Fix: use World(world_size={plan.schedule.n_ranks}) or change "
                         "stages_per_rank.")
    started = time.perf_counter()
    results = world.run(rank_step, plan, timeout=job.timeout)
    result = merge_rank_results(pipe, results, job.n_microbatches)
    result.timings["step_s"] = time.perf_counter() - started
    trace_path = job.options.get("trace_path")
    if trace_path:
        write_chrome_trace(trace_path, [e for r in results for e in r.events], plan.schedule)
    result.events = [e for r in results for e in r.events]
    return result


_SHARED_WORLDS: dict[tuple[int, str], World] = {}


def shared_world(world_size: int, device: str = "cpu", timeout: float = 120.0) -> World:
    """A World kept for the whole process (one per xdist worker), created on first use."""
    key = (world_size, str(device))
    world = _SHARED_WORLDS.get(key)
    if world is None or getattr(world, "_closed", False):
        world = World(world_size, device=str(device), timeout=timeout)
        _SHARED_WORLDS[key] = world
    return world


def close_shared_worlds() -> None:
    for world in _SHARED_WORLDS.values():
        world.close()
    _SHARED_WORLDS.clear()


def run_distributed(job: Job) -> StepResult:
    """The "distributed" runner: pipecheck's runtime on a shared (or the job's own) World."""
    pipe = job.split()
    world = job.options.get("world")
    if world is None:
        world_size = job.world_size or -(-pipe.num_stages // job.stages_per_rank)
        world = shared_world(world_size, job.device)
    elif job.world_size is not None and job.world_size != world.world_size:
        raise InputError(f"world_size={job.world_size} but the given World has {world.world_size} ranks.")
    return execute(world, job, pipe)


def run_pipeline(world: World, model: Any, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
                 split_spec: Mapping[str, Any] | None = None, policy: Any = None, tracer: str = "fx",
                 schedule: str | Schedule = "1f1b", n_microbatches: int = 4, loss_fn: Any = None,
                 target: Any = None, stages_per_rank: int = 1, seed: int = 0, timeout: float | None = None,
                 trace_path: str | None = None) -> StepResult:
    """One training step of ``model`` through pipecheck's runtime on ``world``.

        with pc.World(world_size=4) as world:
            res = pc.run_pipeline(world, make_model, (x,), n_microbatches=4, trace_path="t.json")

    ``model`` is an nn.Module or a zero-argument factory; either travels to the ranks pickled.
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    job = Job(model=ModelFactory(model, seed=seed), args=args, kwargs=dict(kwargs or {}), split_spec=split_spec,
              policy=policy, tracer=tracer, loss_fn=loss_fn, target=target, n_microbatches=n_microbatches,
              schedule=schedule, world_size=world.world_size, stages_per_rank=stages_per_rank,
              device=world.device, timeout=timeout, options={"world": world, "trace_path": trace_path})
    if loss_fn is None and target is not None:
        raise InputError("target was given without loss_fn. Fix: pass loss_fn=..., or drop target.")
    return execute(world, job)
