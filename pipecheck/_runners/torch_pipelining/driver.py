"""The "torch" runner: torch.distributed.pipelining, driven on pipecheck's World.

    pc.assert_equivalent(model, (x,), runner="torch", n_microbatches=4)
    res = run_torch(job)            # a pc.StepResult, like every runner's

This is the driver side; every rank (``_torch_rank.py``) traces the job's model
with torch's own ``pipeline()``, builds its stage(s) with ``Pipe.build_stage``
and runs one ``step`` of torch's schedule: any of torch's seven
("gpipe" -> ``ScheduleGPipe`` (``ScheduleLoopedBFS`` with several stages per
rank), "1f1b" -> ``Schedule1F1B``, "interleaved" -> ``ScheduleInterleaved1F1B``,
"zb" / "interleaved_zb" -> ``ScheduleInterleavedZeroBubble`` (one / any number
of stages per rank), "zbv" -> ``ScheduleZBVZeroBubble``, "dualpipev" ->
``ScheduleDualPipeV``, or torch's class names; ``pipecheck._schedule.torch_classes``).
The layout (stages per rank, placement, micro-batch count) is checked against
torch's rules on the driver before any rank starts; "zbv" and "dualpipev" place
stages in a V (stage ``r`` and ``2p - 1 - r`` on rank ``r``).
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
and every replica as it is, so that torch bug shows as one stage's share.

Input gradients are read from the full-batch inputs given to ``step`` (torch
accumulates into them through its chunks). What torch cannot run comes back
as :class:`pipecheck.EngineError`: torch's message, then the rank and stage.

A model with random ops (dropout) is drawn by pipecheck's randomness contract:
each ``forward_one_chunk`` torch runs draws inside ``pc.randomness.drawing``,
once torch's own split is seen to draw what pipecheck's split draws
(``randomness.py`` beside this; refused before any rank starts otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pipecheck._core.result import RankReport, StepResult
from pipecheck._runners.base import (
    adapter_error,
    timeout_error,
)
from pipecheck._runners.engine import EngineRunner, merge_reports
from pipecheck._runners.job import Job
from pipecheck._runners.torch_pipelining.randomness import refuse_other_draws
from pipecheck._runners.torch_pipelining.rank import (
    TorchRankResult,
    TorchStepError,
    TorchStepSpec,
    instrument_torch_stage,
    restructure,
    stage_submodule,
    torch_pipe,
    torch_rank_step,
)
from pipecheck._runners.torch_pipelining.train import torch_rank_train, train_torch
from pipecheck._runtime.boundaries import Boundaries
from pipecheck._schedule.torch_classes import TORCH_SCHEDULES, torch_layout
from pipecheck._split.checkpoints import reentrant_regions
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.markers import SplitPoint
from pipecheck._split.microbatch import split_microbatches, unwrap_replicated
from pipecheck._split.pipe import COMPUTE_OPS, Pipe
from pipecheck._split.traced import normalize_split_spec
from pipecheck._world.world import World
from pipecheck.errors import (
    AdapterError,
    EngineError,
    InputError,
    PipecheckError,
    RankError,
    RankFailedError,
    RankTimeoutError,
    WorldError,
    first_line,
)
from pipecheck.losses import MicrobatchLoss

ENGINE = "torch.distributed.pipelining"
_OWN_ERROR = f"{TorchStepError.__module__}.{TorchStepError.__qualname__}"


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
            + "\nFix: give runner='torch' a split_spec or pipe_split() markers, or use tracer='fx'.",
            engine=ENGINE,
        )
    return cuts


def plan_torch_step(job: Job, pipe: Pipe) -> TorchStepSpec:
    """What every rank gets: the job's inputs and torch's cut and schedule for ``pipe``."""
    if not isinstance(job.schedule, str):
        raise InputError(f"runner='torch' takes a schedule name ({', '.join(map(repr, TORCH_SCHEDULES))}), not "
                         f"{type(job.schedule).__name__}: torch builds its own schedule.")
    # torch's rules for the layout, checked here: torch itself checks few, and some only inside a rank
    layout = torch_layout(job.schedule, pipe.num_stages, job.n_microbatches, job.stages_per_rank)
    if job.policy is not None:
        cuts, keep_markers = policy_module_cuts(pipe), False
    else:
        cuts, keep_markers = normalize_split_spec(job.build_model(), job.split_spec or {}), True
    unrunnable = unrunnable_by_torch(job, pipe)
    if unrunnable:  # torch's words first, as its own failure would read
        raise EngineError("\n".join([*unrunnable, f"{ENGINE} would fail on this split mid-step, its other ranks "
                                     "waiting on the failing one: refused before any rank started."]), engine=ENGINE)
    spec = TorchStepSpec(job.model, job.args, job.kwargs, job.loss_fn, job.target, job.n_microbatches,
                         layout.key, pipe.num_stages, cuts, keep_markers, pytree.treespec_dumps(pipe.out_spec),
                         layout.class_name, layout.stage_to_rank, record=job.boundaries is not None,
                         random_seed=job.random_seed)
    if job.random_seed is not None:  # eager replays pipecheck's split's draws: torch's split must draw the same
        _check_torch_draws(job, pipe, spec)
    return spec


def _check_torch_draws(job: Job, pipe: Pipe, spec: TorchStepSpec) -> None:
    """torch's split, traced and run forward here, draws what pipecheck's split draws (InputError if not);
    torch failing to trace or run it is an EngineError in torch's words, before any rank starts."""
    try:
        _, torch_pipeline, _, _ = torch_pipe(spec, torch.device(job.device))
        refuse_other_draws(job, pipe, torch_pipeline,
                           [stage_submodule(torch_pipeline, s) for s in range(torch_pipeline.num_stages)])
    except PipecheckError:
        raise
    except Exception as err:
        kind = type(err).__qualname__ if type(err).__module__ == "builtins" else \
            f"{type(err).__module__}.{type(err).__qualname__}"
        message = _one_line(kind, str(err))
        known = next((why for words, why in TORCH_BUGS.items() if words in message), "")
        raise EngineError(f"{message}\n{known}{ENGINE} failed in this process, before any rank started: pipecheck "
                          "traced the model with torch's pipeline() and ran its split forward to check that it draws "
                          f"the random numbers pipecheck's split draws; {_setting(job)}.", engine=ENGINE) from err


class TorchRunner(EngineRunner):
    """The "torch" runner: one training step of a job through torch.distributed.pipelining."""

    __name__ = "torch"
    label, engine = "runner='torch'", ENGINE
    # every stage forward torch runs is drawn by pipecheck's randomness contract, once torch's own split is
    # seen to draw what pipecheck's does (pipecheck._runners.torch_pipelining.randomness)
    follows_random_contract = True
    rank_step = staticmethod(torch_rank_step)
    rank_train = staticmethod(torch_rank_train)  # what every rank runs for a training loop (train.py)

    def plan(self, job: Job, pipe: Pipe) -> TorchStepSpec:
        return plan_torch_step(job, pipe)

    def check_world(self, job: Job, world: World) -> None:
        if world.properties.gpus_shared:
            # gloo's send/recv hand a tensor's data pointer to its TCP transport as host memory (no CUDA
            # staging, unlike its collectives), and torch's PipelineStage passes CUDA tensors as they are.
            gpus = sorted(set(world.properties.devices))
            raise EngineError(
                f"runner='torch' needs one GPU per rank, and {world!r} runs {world.world_size} ranks on "
                f"{len(gpus)} GPU(s) ({', '.join(gpus)}): ranks that share a GPU talk through gloo, whose "
                f"point-to-point send/recv cannot carry the CUDA tensors {ENGINE} hands it (every rank aborts). "
                "Fix: runner='distributed', which passes tensors between ranks on one GPU on the device (CUDA "
                f"IPC); or as many GPUs as ranks ({world.world_size}, NCCL); or device='cpu'.", engine=ENGINE)

    def world_failed(self, err: WorldError, job: Job, plan: Any) -> EngineError | AdapterError:
        return engine_error(err, job)

    def rank_failed(self, report: RankReport, job: Job, plan: Any) -> EngineError | AdapterError:
        assert report.failure is not None
        return _engine_error(report.failure, "before running the schedule", job)

    def reference_boundaries(self, job: Job) -> tuple[Boundaries, dict[tuple[int, str], int | None]]:
        """torch cuts and names the values itself: its own split, run in this process, is the truth
        a failing check lines the ranks' recorded values up with."""
        return torch_reference_boundaries(job)

    def train(self, job: Job) -> list[StepResult]:
        """Several optimizer steps, torch's stages and schedule kept across them (``train.py`` beside this)."""
        return train_torch(self, job)

    def merge(self, job: Job, pipe: Pipe, plan: Any, reports: Sequence[TorchRankResult]) -> StepResult:
        last = next(r for r in reports if r.losses)  # torch merges the outputs on the last stage's rank
        return merge_reports(pipe, reports, outputs=last.outputs, loss=torch.stack(last.losses).mean(),
                             input_grads={name: g for r in reports for name, g in r.input_grads.items()})


run_torch = TorchRunner()


def torch_reference_boundaries(job: Job) -> tuple[Boundaries, dict[tuple[int, str], int | None]]:
    """The boundary values a correct run of torch's own split gives, named as torch names them: torch's
    ``pipeline()`` traced here as the ranks trace it, its stage modules run in this process micro-batch
    by micro-batch (each loss divided by n_microbatches, as the reference's); and each stage input's
    producing stage (None: a model input)."""
    spec = plan_torch_step(job, job.structure())
    _, torch_pipeline, _, _ = torch_pipe(spec, torch.device(job.device))
    truth = Boundaries()
    n = job.n_microbatches
    for stage in range(torch_pipeline.num_stages):
        instrument_torch_stage(stage_submodule(torch_pipeline, stage), stage, truth)
    args, kwargs = cast_inputs((tuple(job.args), dict(job.kwargs)), None, torch.device(job.device))
    loss_of = MicrobatchLoss(job.loss_fn, cast_inputs(job.target, None, torch.device(job.device)), n)
    for mb, (mb_args, mb_kwargs) in enumerate(split_microbatches((args, kwargs), n)):
        mb_args, mb_kwargs = unwrap_replicated((mb_args, mb_kwargs))
        output = restructure(torch_pipeline(*mb_args, **mb_kwargs), spec.out_spec)
        (loss_of(mb, output) / n).backward()
    return truth, _torch_producers(torch_pipeline)


def _torch_producers(torch_pipeline: Any) -> dict[tuple[int, str], int | None]:
    calls = {node: int(str(node.target).rsplit("_", 1)[-1]) for node in torch_pipeline.split_gm.graph.nodes
             if node.op == "call_module" and str(node.target).startswith("submod_")}
    found: dict[tuple[int, str], int | None] = {}
    for node, stage in calls.items():
        placeholders = [p.name for p in stage_submodule(torch_pipeline, stage).graph.nodes if p.op == "placeholder"]
        for name, arg in zip(placeholders, node.args):
            source = arg.args[0] if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.args else arg
            found[(stage, name)] = calls.get(source) if isinstance(source, fx.Node) else None
    return found


def torch_message(error: RankError) -> tuple[str, str | None]:
    """``(message, context)`` of a rank's failure inside torch: the innermost cause's message in one
    line, and where torch wrapped it ("[Stage 0] failed to run forward") as context."""
    if error.exc_type == _OWN_ERROR:
        return first_line(error.message), None
    telling = [(kind, message) for kind, message in error.causes if first_line(message)]
    if telling:  # the innermost cause that says something (a bare StopIteration deep inside fx says nothing)
        cause_type, cause_message = telling[-1]
        return _one_line(cause_type, cause_message), first_line(error.message).rstrip(":") or error.exc_type
    if not first_line(error.message) and error.raised_at:  # a bare assert: where is all there is to say
        return f"{error.exc_type} (raised at {error.raised_at})", None
    return _one_line(error.exc_type, error.message), None


def _one_line(exc_type: str, message: str) -> str:
    """torch's own errors by their message; Python's built-in ones with their type, as Python prints them."""
    first = first_line(message)
    if not first or "." not in exc_type:
        return f"{exc_type}: {first}".rstrip(": ")
    return first


def engine_error(err: WorldError, job: Job) -> EngineError | AdapterError:
    """A World failure of a torch step as an EngineError carrying torch's message, rank and stage."""
    if isinstance(err, RankFailedError):
        return _engine_error(err.error, "in schedule.step", job)
    if isinstance(err, RankTimeoutError):
        return timeout_error(err, ENGINE, "stuck", _setting(job))
    return EngineError(f"{ENGINE} could not run: {first_line(str(err))} ({_setting(job)})\n{err}", engine=ENGINE,
                       rank=getattr(err, "rank", None), stage=getattr(err, "stage", None))


def _engine_error(error: RankError, when: str, job: Job) -> EngineError | AdapterError:
    """First line: the message alone (what a table cell shows); then where, the settings, the traceback.
    A failure of pipecheck's own code calling torch is an AdapterError instead."""
    if error.in_pipecheck:
        return adapter_error(error, ENGINE)
    message, context = torch_message(error)
    inside = f" (inside torch: {context})" if context else ""
    known = next((why for words, why in TORCH_BUGS.items() if words in message), "")
    return EngineError(
        f"{message}\n{known}"
        f"{ENGINE} failed on rank {error.rank}, stage {error.stage}, {when}{inside}; {_setting(job)}.\n"
        f"Traceback on rank {error.rank}:\n{error.traceback.rstrip()}",
        engine=ENGINE, rank=error.rank, stage=error.stage, cause=error,
    )


TORCH_BUGS = {
    "input tensor has to be contiguous": (
        "This is torch.distributed.pipelining's bug, not your model's: it sends a stage's output as it is, and "
        "torch.distributed sends only contiguous tensors (gloo raises this; NCCL can deliver scrambled values, "
        "pytorch/pytorch#62283). A value handed on at the cut is a view (a transpose, an expand, a slice). "
        "Fix: make it contiguous before the cut (.contiguous()), or cut elsewhere; runner='distributed' sends it "
        "as it is.\n"),
    "a leaf Variable that requires grad is being used in an in-place operation": (
        "This is torch.distributed.pipelining's bug, not your model's: it hands a stage the activations it receives "
        "as leaf tensors that require grad, and an in-place op on one at the start of the stage (x += ..., "
        "ReLU(inplace=True), a residual add_) fails there, where eager ran it on a computed value. Fix: cut "
        "elsewhere (not just before an in-place op), or make that op out of place; runner='distributed' runs it.\n"),
}
"""torch's failures that are known bugs of torch.distributed.pipelining (the words of its message -> a line
saying so, and the way round it)."""


def _setting(job: Job) -> str:
    return (f"schedule {job.schedule!r}, n_microbatches={job.n_microbatches}, "
            f"stages_per_rank={job.stages_per_rank}")


def unrunnable_by_torch(job: Job, pipe: Pipe) -> list[str]:
    """What torch.distributed.pipelining fails on mid-step (the other ranks waiting on the failing
    one: a World restart), found in this process before any rank starts and said in torch's words
    first: ``schedule.step`` gives the step's keyword inputs to stage 0's module, so a keyword that
    a later stage reads and stage 0 does not raises "got an unexpected keyword argument" there, on
    every schedule and torch version pipecheck supports. (torch's refusal of skip connections is not
    predicted here: whether a value crosses more than one stage depends on torch's own split.)"""
    problems = []
    if any(reentrant_regions(stage.module) for stage in pipe.stages):
        problems.append("torch.utils.checkpoint(..., use_reentrant=True) cannot be traced by torch.export, which "
                        "torch's pipeline() traces the model with (\"found non-fx-graphable type\": the checkpointed "
                        "function is an argument); pipecheck's runners recompute it. Fix: use_reentrant=False (HF: "
                        "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))")
    first = {src.name for src in pipe.stages[0].inputs if src.stage is None}
    for key in job.kwargs:
        later = [stage.index for stage in pipe.stages[1:] if any(src.stage is None and src.name == key
                                                                 for src in stage.inputs)]
        if later and key not in first:
            problems.append(f"forward() got an unexpected keyword argument {key!r}: torch's schedule.step gives "
                            f"keyword inputs to stage 0's module, and {key!r} is read by stage(s) {later}, not "
                            "stage 0. Fix: pass it positionally, or cut so stage 0 reads it")
    return problems
