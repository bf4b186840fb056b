"""The "torch" runner: torch.distributed.pipelining, driven on pipecheck's World.

    pc.assert_equivalent(model, (x,), runner="torch", n_microbatches=4)
    res = run_torch(job)            # a pc.StepResult, like every runner's

Every rank traces the job's model with torch's own ``pipeline()``, builds its
stage(s) with ``Pipe.build_stage`` and runs one ``step`` of torch's schedule
("gpipe" -> ``ScheduleGPipe`` (``ScheduleLoopedBFS`` with several stages per
rank), "1f1b" -> ``Schedule1F1B``, "interleaved" -> ``ScheduleInterleaved1F1B``).
The job's cut is translated so torch cuts where pipecheck cuts:

- ``pipecheck.pipe_split()`` markers (the op ``pipecheck::pipe_split`` in the
  exported graph) become torch's ``pippy::_pipe_split`` through a
  ``split_policy`` that rewrites the graph torch exported;
- a ``split_spec`` becomes forward (pre-)hooks calling torch's ``pipe_split()``
  on the rank's own fresh copy of the model (torch's ``annotate_split_points``
  would rewrite ``forward`` instead; the user's module is never touched);
- a policy's cuts are read off pipecheck's split: a cut right before or after
  a module call becomes that module's split point; any other cut is reported
  as not expressible for torch.

Semantics match pipecheck's: torch computes ``loss_fn(out_mb, target_mb)`` per
micro-batch, backpropagates each unscaled and divides the gradients by
n_microbatches at the end (``scale_grads=True``), so gradients are those of the
mean loss. A tensor target is given to torch whole and torch chunks it (dim 0,
``tensor_split``); every chunk is checked against pipecheck's own chunking. A
target that torch cannot chunk (a pytree, 0-dim leaves) travels as
micro-batch indices and pipecheck's chunks are looked up by index.

Gradients come back keyed by the ORIGINAL FQNs: torch's stage modules rename
parameters (``shared@1.fc@1.weight`` for a second call, aliases by their own
name), so names are mapped back through the model's alias table. torch
replicates a parameter used by several stages and never sums the replicas'
gradients; each FQN's gradient is reported from the lowest stage holding it,
so that torch bug shows as one stage's share in the check.

Input gradients are read from the full-batch inputs given to ``step`` (torch
accumulates into them through its chunks). What torch cannot run comes back
as :class:`pipecheck.EngineError`: torch's message, then the rank and stage.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._errors import EngineError, InputError, RankFailedError, RankTimeoutError, WorldError
from pipecheck._job import Job, ModelFactory, cast_inputs
from pipecheck._markers import PIPE_SPLIT_OP, SplitPoint
from pipecheck._microbatch import split_microbatches
from pipecheck._pipe import COMPUTE_OPS, Pipe
from pipecheck._result import StepResult
from pipecheck._trace import normalize_split_spec
from pipecheck.losses import check_scalar_loss, default_microbatch_target, projection_loss
from pipecheck.schedules import make_schedule

ENGINE = "torch.distributed.pipelining"


class TorchStepError(RuntimeError):
    """A rank's failure as one line, plus where inside torch it arose (parsed back by the driver)."""

    def __init__(self, message: str, context: str | None = None) -> None:
        super().__init__(message + (f"\n{_CONTEXT}{context}" if context else ""))
        self.message, self.context = message, context


_CONTEXT = "inside torch: "


@dataclass
class TorchPlan:
    """What every rank receives: the job (no driver-only options) and how torch must cut it."""

    job: Job
    n_stages: int
    module_cuts: dict[str, SplitPoint]  # module FQN -> cut before/after its call
    keep_markers: bool  # False for a policy: pipecheck drops the model's markers then
    out_spec_json: str  # the model's output structure (torch's stages return flat leaves); a TreeSpec
    # itself pickles only with a deprecation warning, so it travels as treespec_dumps text

    @property
    def out_spec(self) -> pytree.TreeSpec:
        return pytree.treespec_loads(self.out_spec_json)


@dataclass
class TorchRankResult:
    """One rank's share of the step (CPU tensors only)."""

    rank: int
    outputs: Any = None  # merged by torch, on the rank holding the last stage
    losses: list[torch.Tensor] = field(default_factory=list)
    stage_grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # first stage's rank: model inputs
    unmapped: list[str] = field(default_factory=list)  # stage parameter names with no original FQN
    failure: str | None = None  # torch's message, when this rank failed before communicating
    failure_stage: int | None = None
    failure_traceback: str = ""


# --- driver side ---------------------------------------------------------------------------


def schedule_key(schedule: str) -> str:
    """torch's name for a pipecheck schedule name (already validated by pipecheck's make_schedule)."""
    key = schedule.strip().lower().replace("-", "_")
    return "interleaved" if key == "interleaved_1f1b" else key


def policy_module_cuts(pipe: Pipe) -> dict[str, SplitPoint]:
    """Module split points reproducing a policy's cuts; EngineError where torch cannot express one."""
    calls: dict[str, int] = {}
    firsts: list[fx.Node | None] = []
    lasts: list[fx.Node | None] = []
    for stage in pipe.stages:
        nodes = [n for n in stage.module.graph.nodes if n.op in COMPUTE_OPS]
        for node in nodes:
            if node.op == "call_module":
                calls[str(node.target)] = calls.get(str(node.target), 0) + 1
        firsts.append(nodes[0] if nodes else None)
        lasts.append(nodes[-1] if nodes else None)
    cuts: dict[str, SplitPoint] = {}
    problems = []
    for s in range(1, pipe.num_stages):
        before, after = firsts[s], lasts[s - 1]

        def usable(node: fx.Node | None) -> bool:  # a module called once, not already cut at
            return node is not None and node.op == "call_module" and calls[str(node.target)] == 1 \
                and str(node.target) not in cuts

        if usable(before):
            cuts[str(before.target)] = SplitPoint.BEGINNING  # type: ignore[union-attr]
        elif usable(after):
            cuts[str(after.target)] = SplitPoint.END  # type: ignore[union-attr]
        else:
            problems.append(f"  cut {s - 1}|{s}: between {after.name if after else '-'} and "
                            f"{before.name if before else '-'}")
    if problems:
        raise EngineError(
            f"{ENGINE} cannot cut where the policy cuts (not supported by torch): torch cuts only at "
            "pipe_split() markers or before/after a module called once, and these cuts are neither:\n"
            + "\n".join(problems)
            + "\nFix: give runner='torch' a split_spec or pipe_split() markers, or use tracer='fx'."
        )
    return cuts


def make_plan(job: Job, pipe: Pipe) -> TorchPlan:
    if not isinstance(job.schedule, str):
        raise InputError("runner='torch' takes a schedule name ('gpipe', '1f1b', 'interleaved'), not "
                         f"{type(job.schedule).__name__}: torch builds its own schedule.")
    make_schedule(job.schedule, pipe.num_stages, job.n_microbatches, job.stages_per_rank)  # pipecheck's rules
    if job.policy is not None:
        cuts, keep_markers = policy_module_cuts(pipe), False
    else:
        cuts = normalize_split_spec(job.build_model(), job.split_spec or {})
        keep_markers = True
    return TorchPlan(dataclasses.replace(job, options={}), pipe.num_stages, cuts, keep_markers, pytree.treespec_dumps(pipe.out_spec))


def run_torch(job: Job) -> StepResult:
    """The "torch" runner: one training step of ``job`` through torch.distributed.pipelining."""
    from pipecheck._runtime import shared_world

    pipe = job.split()
    plan = make_plan(job, pipe)
    world_size = -(-pipe.num_stages // job.stages_per_rank)
    if pipe.num_stages != world_size * job.stages_per_rank:
        raise InputError(f"runner='torch' places stages_per_rank={job.stages_per_rank} stages on every rank, "
                         f"but the split has {pipe.num_stages} stages. Fix: a stage count divisible by "
                         "stages_per_rank.")
    world = job.options.get("world")
    if world is None:
        world = shared_world(job.world_size or world_size, job.device)
    if world.world_size != world_size or (job.world_size is not None and job.world_size != world_size):
        raise InputError(f"runner='torch' needs {world_size} ranks ({pipe.num_stages} stages, "
                         f"stages_per_rank={job.stages_per_rank}) but got world_size="
                         f"{job.world_size or world.world_size}. Fix: World(world_size={world_size}).")
    try:
        results = world.run(torch_rank_step, plan, timeout=job.timeout)
    except WorldError as err:
        raise engine_error(err, job) from err
    failed = [r for r in results if r.failure is not None]
    if failed:
        raise prepare_error(failed[0], job)
    unmapped = sorted({name for r in results for name in r.unmapped})
    if unmapped:
        raise EngineError(f"pipecheck could not map torch's stage parameters {unmapped} back to the model's "
                          "parameter FQNs, so their gradients cannot be checked. This is a pipecheck "
                          "limitation; please report it with the model.")
    return merge_results(pipe, results, job.n_microbatches)


def merge_results(pipe: Pipe, results: list[TorchRankResult], n_microbatches: int) -> StepResult:
    outputs = next(r.outputs for r in results if r.losses)
    losses = next(r.losses for r in results if r.losses)
    stage_grads: dict[int, dict[str, torch.Tensor]] = {}
    for result in results:
        stage_grads.update(result.stage_grads)
    grads: dict[str, torch.Tensor] = {}
    for s in sorted(stage_grads):  # torch never sums replicas: report the lowest stage's copy
        for fqn, grad in stage_grads[s].items():
            grads.setdefault(fqn, grad)
    return StepResult(
        outputs=outputs,
        loss=torch.stack(losses).mean(),
        grads=grads,
        input_grads={name: g for r in results for name, g in r.input_grads.items()},
        stage_grads=[stage_grads.get(s, {}) for s in range(pipe.num_stages)],
    )


_TORCH_LINES = re.compile(rf"{TorchStepError.__name__}: (.*)(?:\n{_CONTEXT}(.*))?")


def engine_error(err: WorldError, job: Job) -> EngineError:
    """A World failure of a torch step as an EngineError carrying torch's message, rank and stage."""
    if isinstance(err, RankFailedError):
        found = _TORCH_LINES.findall(err.traceback)
        message, context = found[-1] if found else (str(err).strip().splitlines()[0], "")
        return _engine_error(message, context or None, err.rank, err.stage, "in schedule.step", err.traceback, job)
    if isinstance(err, RankTimeoutError):
        rank = err.ranks[0] if err.ranks else None
        error = EngineError(f"{ENGINE} did not finish within {err.timeout} s (rank(s) "
                            f"{', '.join(map(str, err.ranks))} stuck; {_setting(job)}).\n{err}")
        error.rank, error.stage, error.engine = rank, None, ENGINE  # type: ignore[attr-defined]
        return error
    error = EngineError(f"{ENGINE} could not run: {str(err).strip().splitlines()[0]} ({_setting(job)})\n{err}")
    error.rank, error.stage, error.engine = (  # type: ignore[attr-defined]
        getattr(err, "rank", None), getattr(err, "stage", None), ENGINE)
    return error


def prepare_error(result: TorchRankResult, job: Job) -> EngineError:
    """A failure every rank agreed on before communicating (a trace, a stage, a schedule torch refused)."""
    message, _, context = (result.failure or "").partition(f"\n{_CONTEXT}")
    return _engine_error(message, context or None, result.rank, result.failure_stage,
                         "before running the schedule", result.failure_traceback, job)


def _engine_error(message: str, context: str | None, rank: int, stage: int | None, when: str,
                  traceback_text: str, job: Job) -> EngineError:
    """First line: the message alone (what a table cell shows); then where, the settings, the traceback."""
    stage = _stage_in(context or message, stage)
    inside = f" ({_CONTEXT}{context})" if context else ""
    error = EngineError(
        f"{message}\n"
        f"{ENGINE} failed on rank {rank}, stage {stage}, {when}{inside}; {_setting(job)}.\n"
        f"Traceback on rank {rank}:\n{traceback_text.rstrip()}"
    )
    error.rank, error.stage, error.engine = rank, stage, ENGINE  # type: ignore[attr-defined]
    return error


def _setting(job: Job) -> str:
    return (f"schedule {job.schedule!r}, n_microbatches={job.n_microbatches}, "
            f"stages_per_rank={job.stages_per_rank}")


def _stage_in(message: str, default: int | None) -> int | None:
    found = re.search(r"\bStage (\d+)\b", message)  # torch's "[Stage 0] failed to run forward"
    return int(found.group(1)) if found else default


# --- rank side -----------------------------------------------------------------------------


def _translate_markers(keep: bool) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """A torch ``split_policy``: pipecheck's marker op -> torch's (or dropped, for a policy)."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is PIPE_SPLIT_OP:
                if keep:
                    with gm.graph.inserting_before(node):
                        gm.graph.call_function(aten_pipe_split_alias, (), {})
                gm.graph.erase_node(node)
        gm.recompile()
        return gm

    return policy


def _hook_cuts(model: nn.Module, cuts: Mapping[str, SplitPoint]) -> None:
    """Cut at module calls with hooks on this rank's own copy of the model."""
    from torch.distributed.pipelining import pipe_split

    for fqn, point in cuts.items():
        module = model.get_submodule(fqn)
        if point is SplitPoint.BEGINNING:
            module.register_forward_pre_hook(lambda _m, _a: pipe_split())
        else:
            module.register_forward_hook(lambda _m, _a, _o: pipe_split())


def _alias_table(model: nn.Module) -> tuple[dict[str, str], dict[int, str]]:
    """Every parameter name (aliases included) -> canonical FQN; and id -> canonical FQN."""
    by_id: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = by_id.setdefault(id(param), name)
    return names, by_id


_CALL_SUFFIX = re.compile(r"@\d+")


def stage_grads(stage_module: nn.Module, names: Mapping[str, str], by_id: Mapping[int, str]
                ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A torch stage's parameter gradients by original FQN; also the names that map to none."""
    grads: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    unmapped = []
    for local, param in stage_module.named_parameters(remove_duplicate=False):
        if id(param) in seen or param.grad is None:
            continue
        seen.add(id(param))
        fqn = names.get(_CALL_SUFFIX.sub("", local)) or by_id.get(id(param))
        if fqn is None:
            unmapped.append(local)
            continue
        grad = param.grad.detach().cpu()
        grads[fqn] = grads[fqn] + grad if fqn in grads else grad  # one module called twice in a stage
    return grads, unmapped


def _non_last_outputs(split_gm: fx.GraphModule, n_stages: int) -> list[tuple[int, int]]:
    """(output leaf, stage) for model outputs torch's pipeline would take from a non-last stage."""
    output = next(n for n in split_gm.graph.nodes if n.op == "output")
    found = []
    for i, leaf in enumerate(pytree.tree_leaves(output.args[0])):
        node = leaf
        while isinstance(node, fx.Node) and node.op == "call_function":  # getitem of a stage's tuple
            node = node.args[0]
        if isinstance(node, fx.Node) and node.op == "call_module":
            stage = int(str(node.target).rsplit("_", 1)[-1])
            if stage != n_stages - 1:
                found.append((i, stage))
    return found


def restructure(output: Any, out_spec: pytree.TreeSpec) -> Any:
    """torch's flat stage output (a tensor or a tuple of leaves) in the model's output structure."""
    leaves = pytree.tree_leaves(output)
    if len(leaves) != out_spec.num_leaves:
        raise TorchStepError(f"torch's last stage returned {len(leaves)} output leaves where the model "
                             f"returns {out_spec.num_leaves}")
    return pytree.tree_unflatten(leaves, out_spec)


def as_step_error(err: BaseException) -> TorchStepError:
    """torch's message in one line; where torch wrapped a cause ("[Stage 0] failed to run forward:"),
    the cause's message, with the wrapper's first line as context."""
    if isinstance(err, TorchStepError):
        return err
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if err.__cause__ is not None:
        return TorchStepError(as_step_error(err.__cause__).message, first.rstrip(":") or type(err).__name__)
    if not first or type(err).__module__ == "builtins":
        return TorchStepError(f"{type(err).__name__}: {first}".rstrip(": "))
    return TorchStepError(first)


class _LossOfMicrobatch:
    """The job's loss on torch's chunks, checking torch chunked the target as pipecheck does."""

    def __init__(self, job: Job, targets: list[Any], by_index: bool, out_spec: pytree.TreeSpec) -> None:
        self.loss_fn = job.loss_fn or projection_loss
        self.out_spec = out_spec
        self.default_target = job.loss_fn is None
        self.targets = targets
        self.by_index = by_index
        self.calls = 0

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        mb = int(target.reshape(-1)[0]) if self.by_index else self.calls
        self.calls += 1
        output = restructure(output, self.out_spec)
        expected = self.targets[mb]
        if self.default_target:
            expected = default_microbatch_target(output, mb)
        elif not self.by_index and not torch.equal(target, expected):
            raise TorchStepError(f"torch chunked the target differently from pipecheck at micro-batch {mb} "
                                 f"(torch: shape {tuple(target.shape)}, pipecheck: shape {tuple(expected.shape)})")
        return check_scalar_loss(self.loss_fn(output, expected), self.loss_fn)


def _torch_target(target: Any, n: int, device: torch.device) -> tuple[Any, bool]:
    """(what to give torch's step as target, whether it is micro-batch indices)."""
    if isinstance(target, torch.Tensor) and target.dim() > 0 and target.shape[0] % n == 0:
        return target, False
    return torch.arange(n, device=device), True


def _schedule(key: str, stages: list[Any], n: int, loss: Callable[..., torch.Tensor]) -> Any:
    from torch.distributed import pipelining as tp
    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS

    if len(stages) == 1 and key != "interleaved":
        single = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B}[key]
        return single(stages[0], n_microbatches=n, loss_fn=loss, scale_grads=True)
    multi = {"gpipe": ScheduleLoopedBFS, "interleaved": tp.ScheduleInterleaved1F1B}[key]  # 1f1b: 1 stage/rank
    return multi(stages, n_microbatches=n, loss_fn=loss, scale_grads=True)


@dataclass
class _Prepared:
    """One rank's torch objects, built before any communication."""

    stages: list[Any]
    schedule: Any
    loss: _LossOfMicrobatch
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    names: dict[str, str]
    by_id: dict[int, str]
    n_stages: int
    named_inputs: dict[str, Any]  # the model's inputs by parameter name, as given to torch's step


def _prepare(ctx: Any, plan: TorchPlan) -> _Prepared:
    """Trace with torch's ``pipeline()``, build this rank's stages and the schedule (no communication)."""
    from torch.distributed.pipelining import pipeline

    job = plan.job
    n = job.n_microbatches
    factory = job.model
    if isinstance(factory, ModelFactory):
        factory = dataclasses.replace(factory, device=ctx.device)
    model = factory()
    names, by_id = _alias_table(model)
    _hook_cuts(model, plan.module_cuts)
    args, kwargs = cast_inputs((tuple(job.args), dict(job.kwargs)), None, ctx.device)
    mb_args, mb_kwargs = split_microbatches((args, kwargs), n)[0]
    ctx.action = "pipeline() trace"
    with warnings.catch_warnings():  # torch's own pipeline() deep-copies a TreeSpec: its deprecation, not ours
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        pipe = pipeline(model, tuple(mb_args), dict(mb_kwargs), split_policy=_translate_markers(plan.keep_markers))
    if pipe.num_stages != plan.n_stages:
        raise TorchStepError(f"torch's pipeline() cut the model into {pipe.num_stages} stages where pipecheck "
                             f"cut {plan.n_stages}")
    mine = list(range(ctx.rank, pipe.num_stages, ctx.world_size))
    ctx.stage = mine[0]
    stray = _non_last_outputs(pipe.split_gm, pipe.num_stages)
    if stray:
        paths = _leaf_paths(plan.out_spec)
        where = ", ".join(f"{paths[i] if i < len(paths) else f'leaf {i}'} is stage {s}'s" for i, s in stray)
        raise TorchStepError(f"torch returns only last-stage outputs; {where}",
                             "the split graph's output node reads a value of an earlier stage")
    ctx.action = "build_stage"
    stages = [pipe.build_stage(s, ctx.device, ctx.group) for s in mine]
    target = cast_inputs(job.target, None, ctx.device)
    torch_target, by_index = _torch_target(target, n, ctx.device)
    targets = split_microbatches(target, n, "target") if target is not None else [None] * n
    loss = _LossOfMicrobatch(job, targets, by_index, plan.out_spec)
    ctx.action = "schedule"
    schedule = _schedule(schedule_key(job.schedule), stages, n, loss)
    named_inputs = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    return _Prepared(stages, schedule, loss, torch_target, tuple(args), dict(kwargs), names, by_id,
                     pipe.num_stages, named_inputs)


def _leaf_paths(out_spec: pytree.TreeSpec) -> list[str]:
    numbered = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
    return ["output" + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(numbered)[0]]


def _agree(ctx: Any, failed: bool) -> bool:
    """True when any rank failed to prepare: then every rank stops before communicating."""
    flag = torch.tensor([1.0 if failed else 0.0], device=ctx.comm_device)
    dist.all_reduce(flag, group=ctx.group)
    return bool(flag.item() > 0)


def _step(ctx: Any, prep: _Prepared) -> TorchRankResult:
    mine = [stage.stage_index for stage in prep.stages]
    first, last = 0 in mine, prep.n_stages - 1 in mine
    losses: list[torch.Tensor] = []
    step_kwargs: dict[str, Any] = {"target": prep.target, "losses": losses} if last else {}
    ctx.stage, ctx.action = mine[0], "schedule.step"
    outputs = prep.schedule.step(*(prep.args if first else ()), **(prep.kwargs if first else {}), **step_kwargs)
    ctx.action = "collect grads"
    result = TorchRankResult(ctx.rank, losses=[loss.detach().cpu().reshape(()) for loss in losses])
    if last:
        outputs = restructure(outputs, prep.loss.out_spec)
        result.outputs = pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, outputs)
    if first:  # torch accumulates into the full-batch inputs through the chunks (views) it made
        result.input_grads = {name: value.grad.detach().cpu() for name, value in prep.named_inputs.items()
                              if isinstance(value, torch.Tensor) and value.grad is not None}
    for stage in prep.stages:
        result.stage_grads[stage.stage_index], unmapped = stage_grads(stage.submod, prep.names, prep.by_id)
        result.unmapped += unmapped
    return result


def torch_rank_step(ctx: Any, plan: TorchPlan) -> TorchRankResult:
    """What every rank runs (top-level, so it pickles); torch's failures leave as one line."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    prepared: _Prepared | None = None
    try:
        prepared = _prepare(ctx, plan)
    except Exception as err:
        failure = as_step_error(err)
        if failure is not err:
            failure.__cause__ = err
    # A failure before any communication is agreed on, so no rank waits for a peer that gave up
    # and the World's processes stay up; the failing ranks say why.
    if _agree(ctx, prepared is None):
        if prepared is None:
            return TorchRankResult(ctx.rank, failure=str(failure), failure_stage=ctx.stage,
                                   failure_traceback="".join(traceback.format_exception(failure)))
        return TorchRankResult(ctx.rank)
    assert prepared is not None
    try:
        return _step(ctx, prepared)
    except TorchStepError:
        raise
    except Exception as err:
        raise as_step_error(err) from err
