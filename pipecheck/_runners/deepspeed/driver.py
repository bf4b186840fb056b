"""The "deepspeed" runner: DeepSpeed's PipelineEngine, driven on pipecheck's World.

    pc.assert_equivalent(model, (x,), runner="deepspeed", n_microbatches=4)   # pipecheck's split
    pc.engines.deepspeed.check(layers=[LayerSpec(...), ...], inputs=x, num_stages=2)  # your layers

Two ways in, one engine. ``runner="deepspeed"`` takes any model pipecheck can
split: each stage becomes one DeepSpeed layer (values a later stage needs
travel through the stages in between, tied parameters become a
``TiedLayerSpec``), so the zoo runs through DeepSpeed's own schedule, p2p and
tied all-reduce. :class:`DeepSpeedLayersRunner` takes a user's own layer
list, as DeepSpeed users write it; its eager reference is the same layers in
one process (``pc.engines.deepspeed.check`` sets that up).

Before any rank starts, one micro-batch runs through the stages in this
process as DeepSpeed passes values (:func:`boundary_problems`): what DeepSpeed
would crash or hang on (a non-tensor between stages, a floating tensor that
needs no gradient, a received tensor that gets none) is refused as an
EngineError naming the engine, rank and stage. Gradients come back by the
model's FQNs, every tied replica as its rank holds it.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.result import StepResult
from pipecheck._runners.deepspeed.layers import (
    BoundaryProblem,
    LayerListModel,
    PipeStageLayer,
    SplitLayout,
    boundary_problems,
    layer_param_counts,
    scalar_kind,
    split_layout,
)
from pipecheck._runners.deepspeed.rank import (
    ENGINE,
    DeepSpeedRankResult,
    LayerListSpec,
    SplitModelSpec,
    deepspeed_rank_step,
)
from pipecheck._runners.engine import EngineRunner, merge_reports
from pipecheck._runners.job import Job
from pipecheck._runtime.boundaries import Boundaries, chain_producers, instrument_module
from pipecheck._split.microbatch import merge_microbatches, split_microbatches, unwrap_replicated
from pipecheck._split.pipe import Pipe, Source
from pipecheck.errors import EngineError, InputError
from pipecheck.losses import MicrobatchLoss, Reduction


def _check_job(job: Job, runner: str) -> None:
    problems = []
    if job.schedule != "1f1b":
        problems.append(f"schedule={job.schedule!r}: DeepSpeed's PipelineEngine runs its own TrainSchedule "
                        "(1F1B); use schedule='1f1b'")
    if job.stages_per_rank != 1:
        problems.append(f"stages_per_rank={job.stages_per_rank}: DeepSpeed runs one stage per rank")
    if str(job.device) != "cpu":
        problems.append(f"device={job.device!r}: pipecheck drives DeepSpeed on its CPU accelerator (gloo) only")
    wide = sorted({str(p.dtype).removeprefix("torch.") for stage in job.structure().stages
                   for p in stage.module.parameters() if p.dtype in (torch.float64, torch.complex128)})
    if wide:
        problems.append(f"{' and '.join(wide)} parameters: DeepSpeed reduces gradients only in its accelerator's "
                        "dtypes (float32, bfloat16, float16; its engine asserts 'attempting to reduce an "
                        "unsupported grad type: torch.float64'); check it in float32 (dtype=torch.float32)")
    if problems:
        raise InputError(f"{runner} cannot run this job: " + "; ".join(problems) + ".")


def _refuse(problems: Sequence[BoundaryProblem], what: str) -> None:
    if problems:
        first = problems[0]
        raise EngineError(f"{ENGINE} cannot run {what}: " + "; ".join(p.message for p in problems)
                          + f". (refused before any rank started: on {ENGINE} rank {first.stage} would fail "
                          "or wait forever for its peer.)", engine=ENGINE, rank=first.stage, stage=first.stage)


class _DeepSpeedEngine(EngineRunner):
    """What both ways into DeepSpeed share: one ``train_batch`` on as many ranks as stages."""

    engine = ENGINE
    rank_step = staticmethod(deepspeed_rank_step)
    running, preparing = "in engine.train_batch", "before train_batch"

    def setting(self, job: Job, plan: Any) -> str:
        training = job.training
        setting = f"n_microbatches={job.n_microbatches}, gradient_clipping={training.clip_grad_norm or 0:g}"
        if not training.plain:
            setting += (f", gradient_accumulation_steps={training.accumulation_steps * job.n_microbatches}, "
                        f"data_parallel={training.data_parallel}")
        return setting

    def merge(self, job: Job, pipe: Pipe, plan: Any, reports: Sequence[DeepSpeedRankResult]) -> StepResult:
        last = reports[-1]
        input_grads = {name: merge_microbatches(chunks) for name, chunks in reports[0].input_grads.items()
                       if len(chunks) == job.n_microbatches}
        return merge_reports(pipe, reports, outputs=merge_microbatches(last.outputs), loss=last.loss,
                             input_grads=input_grads, timing_prefix="deepspeed")


# --- runner="deepspeed": pipecheck's split --------------------------------------------------------------


class DeepSpeedRunner(_DeepSpeedEngine):
    """runner="deepspeed": pipecheck's split of the job's model, each stage one DeepSpeed layer.

    ``spec`` is the rank side's recipe (:class:`SplitModelSpec`, or a subclass that lays the
    layers out differently).
    """

    __name__ = "deepspeed"
    label = "runner='deepspeed'"

    def __init__(self, spec: type[SplitModelSpec] = SplitModelSpec) -> None:
        self.spec = spec

    def plan(self, job: Job, pipe: Pipe) -> SplitModelSpec:
        _check_job(job, self.label)
        bound = job.bound
        layout = split_layout(pipe, bound)
        if not layout.feed:
            raise InputError("runner='deepspeed' needs a model input with a batch dimension: DeepSpeed's data "
                             f"loader feeds micro-batches, and {list(bound)} has none (all 0-dim, pc.Replicated "
                             "or not tensors).")
        wanted = tuple(name for name in layout.feed if bound[name].requires_grad)
        constant_grads = [name for name in layout.constants if _requires_grad(unwrap_replicated(bound[name]))]
        if constant_grads:
            raise InputError(f"runner='deepspeed' cannot give gradients of pc.Replicated inputs ({constant_grads}): "
                             "DeepSpeed feeds only micro-batched tensors through its pipe, and pipecheck hands "
                             "replicated values to each stage as constants. Fix: pass them with "
                             "requires_grad=False (detach()), or check them with runner='distributed'.")
        layout, problems = _split_problems(job, layout)
        _refuse(problems, f"{pipe.model_name} as pipecheck splits it")
        return self.spec(job.model, job.split_spec, job.policy, pipe.tracer, job.args, dict(job.kwargs),
                         job.loss_fn, job.target, job.n_microbatches, wanted, dict(layout.scalars),
                         record=job.boundaries is not None, recipe=pipe.recipe.dumps())

    def n_ranks(self, job: Job, pipe: Pipe, plan: Any) -> int:
        return pipe.num_stages

    def train(self, job: Job) -> list[StepResult]:
        """Several optimizer steps on one engine, DeepSpeed's own data parallel (``train.py`` beside this)."""
        from pipecheck._runners.deepspeed.train import train_deepspeed

        return train_deepspeed(self, job)


def _requires_grad(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in pytree.tree_leaves(value))


run_deepspeed = DeepSpeedRunner()  # the "deepspeed" runner: run_deepspeed(job), or run_deepspeed.train(job)


def _split_problems(job: Job, layout: SplitLayout) -> tuple[SplitLayout, list[BoundaryProblem]]:
    """One micro-batch through pipecheck's layer chain in this process: first to learn which
    boundary values are Python numbers (carried as 0-dim tensors), then as DeepSpeed passes values."""
    pipe = dataclasses.replace(job, boundaries=None).split()  # a private copy (the dry runs update its buffers)
    bound = job.bound
    constants = {name: unwrap_replicated(bound[name]) for name in layout.constants}
    first = split_microbatches({name: bound[name] for name in layout.feed}, job.n_microbatches)[0]
    value: Any = tuple(first[name] for name in layout.feed)
    scalars: dict[Source, str] = {}
    with torch.no_grad():
        for stage in pipe.stages[:-1]:
            layer = PipeStageLayer(stage, layout, constants)
            value = layer(value)
            scalars.update((src, kind) for src, kind in
                           ((src, scalar_kind(t)) for src, t in layer.sent_types.items()) if kind is not None)
    layout = dataclasses.replace(layout, scalars=scalars)
    layers = [PipeStageLayer(stage, layout, constants) for stage in pipe.stages]
    per_token = job.training.loss_reduction == "token_mean"  # loss_fn returns per-token losses
    loss_of = MicrobatchLoss(job.loss_fn, job.target, job.n_microbatches, Reduction(1.0, per_token=per_token))
    return layout, boundary_problems(layers, tuple(first[name] for name in layout.feed),
                                     lambda outputs: loss_of(0, pytree.tree_unflatten(list(outputs), pipe.out_spec)))


# --- a user's layer list ---------------------------------------------------------------------------------


def layer_parts(model: LayerListModel, num_stages: int, partition_method: str) -> tuple[int, ...]:
    """DeepSpeed's stage boundaries for the layer list, computed as ``PipelineModule`` computes them."""
    from deepspeed.runtime import utils as ds_utils

    n = len(model.kinds)
    method = partition_method.lower()
    if method == "uniform":
        parts = ds_utils.partition_uniform(num_items=n, num_parts=num_stages)
    elif method == "parameters":
        parts = ds_utils.partition_balanced(weights=layer_param_counts(model), num_parts=num_stages)
    else:
        raise InputError(f"partition_method={partition_method!r}: pipecheck checks DeepSpeed's 'uniform' and "
                         "'parameters' partitions.")
    return tuple(int(p) for p in parts)


def build_layer_list(layers: Sequence[Any], parts: Sequence[int]) -> LayerListModel:
    """The eager reference of a layer list (a top-level function: a picklable model factory)."""
    return LayerListModel(copy.deepcopy(list(layers)), parts)


class DeepSpeedLayersRunner(_DeepSpeedEngine):
    """A runner for a user's DeepSpeed layer list; the job's model must be its :class:`LayerListModel`.

        runner = DeepSpeedLayersRunner(layers, num_stages=2)
        pc.assert_equivalent(functools.partial(build_layer_list, layers, runner.parts), (x,), runner=runner)
    """

    __name__ = "deepspeed"
    label = "DeepSpeed's PipelineEngine"

    def __init__(self, layers: Sequence[Any], num_stages: int, partition_method: str = "parameters") -> None:
        self.layers = list(layers)
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= len(self.layers):
            raise InputError(f"num_stages={num_stages!r} must be an int from 1 to the number of layers "
                             f"({len(self.layers)}): DeepSpeed gives every stage at least one layer.")
        self.num_stages = num_stages
        self.partition_method = partition_method
        reference = LayerListModel(copy.deepcopy(self.layers))
        self.keys = tuple(reference.keys)
        self.parts = layer_parts(reference, num_stages, partition_method)
        empty = [s for s, (start, stop) in enumerate(zip(self.parts, self.parts[1:])) if start == stop]
        if empty:
            raise InputError(f"DeepSpeed's {partition_method!r} partition {list(self.parts)} leaves stage(s) "
                             f"{empty} without layers. Fix: fewer stages, or partition_method='uniform'.")

    def engine_layers(self) -> list[Any]:
        """The layers DeepSpeed builds: the user's, as given."""
        return self.layers

    def plan(self, job: Job, pipe: Pipe) -> LayerListSpec:
        _check_job(job, self.label)
        reference = job.build_model()
        if not isinstance(reference, LayerListModel):
            raise InputError("DeepSpeedLayersRunner checks a layer list against its LayerListModel; use "
                             "pc.engines.deepspeed.check(layers=..., inputs=...).")
        state = {name: t.detach().cpu().clone() for name, t in reference.state_dict().items()}  # before the dry run
        inputs = job.args[0]
        loss_of = MicrobatchLoss(job.loss_fn, job.target, job.n_microbatches)
        stages = [_layer_range(reference, start, stop) for start, stop in zip(self.parts, self.parts[1:])]
        _refuse(boundary_problems(stages, split_microbatches(inputs, job.n_microbatches)[0],
                                  lambda outputs: loss_of(0, outputs)), "this layer list")
        return LayerListSpec(pickle.dumps(list(self.engine_layers())), self.keys, self.partition_method,
                             self.parts, state, inputs, job.loss_fn, job.target, job.n_microbatches,
                             record=job.boundaries is not None)

    def n_ranks(self, job: Job, pipe: Pipe, plan: Any) -> int:
        return self.num_stages


    def reference_boundaries(self, job: Job) -> tuple[Boundaries, dict[tuple[int, str], int | None]]:
        """The boundary values of the layer list's stages run one after another in this process,
        micro-batch by micro-batch (each stage's layers as one module, as DeepSpeed's stage module runs
        them; each loss divided by n_microbatches), and each stage input's producing stage."""
        model = job.build_model()
        assert isinstance(model, LayerListModel)
        truth = Boundaries()
        stages = [_LayerRange(model, start, stop) for start, stop in zip(self.parts, self.parts[1:])]
        for stage, module in enumerate(stages):
            instrument_module(module, stage, None, None, truth)
        n = job.n_microbatches
        loss_of = MicrobatchLoss(job.loss_fn, job.target, n)
        for mb, inputs in enumerate(split_microbatches(job.args[0], n)):
            for module in stages:
                inputs = module(inputs)
            (loss_of(mb, inputs) / n).backward()
        return truth, chain_producers(truth.values)


class _LayerRange(nn.Module):
    """Layers ``start`` to ``stop`` of a layer list, as one module (as DeepSpeed's stage module runs them)."""

    def __init__(self, model: LayerListModel, start: int, stop: int) -> None:
        super().__init__()
        self.model, self.start, self.stop = model, start, stop

    def forward(self, x: Any) -> Any:
        return _layer_range(self.model, self.start, self.stop)(x)


def _layer_range(model: LayerListModel, start: int, stop: int) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        for i in range(start, stop):
            x = model.layer(i)(x)
        return x

    return run
