"""The rank side of runner="deepspeed": DeepSpeed's PipelineEngine, one ``train_batch``, torn down.

    result = deepspeed_rank_step(ctx, spec)      # on every rank of the World, via world.run

Every rank imports DeepSpeed once per process (on the CPU accelerator, its
shared-memory all-reduce op never compiled: pipecheck does not use it), wraps
the World's gloo group with ``deepspeed.init_distributed``, builds the
``PipelineModule`` from the spec's layers (one stage per rank), gives it the
model's weights, and runs one ``engine.train_batch()`` with a torch SGD whose
step pre-hook reads the gradients (after DeepSpeed's tied all-reduce, before
the step and DeepSpeed's ``zero_grad``). Gradient clipping is off: DeepSpeed's
default of 1.0 would rescale the gradients (by stage 0's norm alone, in
pipeline mode). Each micro-batch's label is its index, so the loss is the
job's own ``loss_fn`` on pipecheck's target chunk, and the outputs are recorded
as DeepSpeed hands them to the loss. Afterwards the engine is torn down (its
process groups, threads and the hooks that keep it alive), so a World runs any
number of DeepSpeed jobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import logging
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.result import RankReport
from pipecheck._runners.deepspeed.layers import (
    PipeStageLayer,
    SplitLayout,
    TiedParams,
    TiedParamsModule,
    identity,
    pass_through,
    split_layout,
)
from pipecheck._runners.rank_side import prepare_together
from pipecheck._runtime.boundaries import Boundaries, instrument, instrument_module
from pipecheck._split.inputs import cast_inputs
from pipecheck._split.microbatch import split_microbatches, unwrap_replicated
from pipecheck._split.pipe import Pipe, Source, split_on
from pipecheck._world.worker import RankContext
from pipecheck.losses import LossFn, MicrobatchLoss
from pipecheck.policies import Policy

ENGINE = "DeepSpeed"


class DeepSpeedStepError(RuntimeError):
    """DeepSpeed set up something pipecheck cannot check: another accelerator than the CPU, a
    partition other than the one planned, a parameter with no counterpart in the model."""


@dataclass
class EngineSetup:
    """One rank's DeepSpeed inputs, built before any communication."""

    layers: list[Any]
    partition_method: str
    parts: tuple[int, ...]  # the stage boundaries pipecheck planned; DeepSpeed's must agree
    batches: list[tuple[Any, torch.Tensor]]  # (inputs, label = micro-batch index) per micro-batch
    loss: RecordingLoss
    micro_batch_size: int
    engine_fqn: Callable[[str], str]  # DeepSpeed's parameter or buffer name -> the model's FQN
    load: Callable[[nn.Module], None]  # the model's weights into the PipelineModule
    input_grads: Callable[[nn.Module], dict[str, list[torch.Tensor]]] = lambda pm: {}  # name -> per micro-batch
    recorder: Boundaries | None = None  # records boundary values (a failing check's second run)
    record_stage_module: bool = False  # record at DeepSpeed's stage module (a layer list's stages are no modules)
    feed: Callable[[tuple[Any, ...], dict[str, Any], int], list[Any]] | None = None  # (args, kwargs, n) -> micro-batches


@dataclass
class DeepSpeedRankResult(RankReport):
    """One rank's share of the step (CPU tensors only; one stage per rank), or why it could not start."""

    outputs: list[Any] = field(default_factory=list)  # last stage: per micro-batch, in order
    loss: torch.Tensor | None = None  # what train_batch returned
    input_grads: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # first stage: per micro-batch


class RecordingLoss:
    """DeepSpeed's loss_fn: the job's loss of micro-batch ``label``; records the outputs DeepSpeed
    gives it, by micro-batch."""

    def __init__(self, loss_of: Callable[[int, Any], torch.Tensor], restructure: Callable[[Any], Any]) -> None:
        self.loss_of = loss_of
        self.restructure = restructure
        self.outputs: dict[int, Any] = {}

    def __call__(self, outputs: Any, label: torch.Tensor) -> torch.Tensor:
        microbatch = int(label.reshape(-1)[0])
        outputs = self.restructure(outputs)
        loss = self.loss_of(microbatch, outputs)
        self.outputs[microbatch] = pytree.tree_map(_to_cpu, outputs)
        return loss


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


# --- DeepSpeed in a persistent rank ------------------------------------------------------------------


def import_deepspeed() -> Any:
    """DeepSpeed on the CPU accelerator, wrapping the World's process group (once per process)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: no CUDA probing, no warning
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != "cpu":
        raise DeepSpeedStepError(
            f"DeepSpeed chose its {accelerator!r} accelerator in this rank (it was imported before pipecheck set "
            "DS_ACCELERATOR=cpu, e.g. by a script's top-level import re-run in the rank); pipecheck drives "
            "DeepSpeed on CPU. Fix: import deepspeed inside `if __name__ == '__main__':`, or set DS_ACCELERATOR=cpu.")
    _skip_shm_op_build()
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")  # the group exists: DeepSpeed only wraps it
    return deepspeed


def _skip_shm_op_build() -> None:
    """Mark DeepSpeed's CPU shared-memory all-reduce op as unavailable before ``init_distributed``.

    DeepSpeed compiles it (g++, minutes) when its torch backend starts, and uses it only when
    launched with LOCAL_SIZE; pipecheck's ranks never are. ``deepspeed.ops.__compatible_ops__`` is
    the table DeepSpeed consults (0.19); should a release move it, the op is built once into
    ``$TORCH_EXTENSIONS_DIR`` instead, which is slow but still correct.
    """
    try:
        import deepspeed.ops as ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except ImportError:
        return
    table = vars(ops)
    if "__compatible_ops__" not in table:  # probing every op runs compilers; none is needed here
        table["__compatible_ops__"] = dict.fromkeys(ALL_OPS, False)
    table["__compatible_ops__"]["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def _local_rank(rank: int) -> Iterator[None]:
    """PipelineModule and deepspeed.initialize read LOCAL_RANK (and nothing else from the environment)."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def _config(setup: EngineSetup) -> dict[str, Any]:
    n = len(setup.batches)
    return {
        "train_batch_size": setup.micro_batch_size * n,
        "train_micro_batch_size_per_gpu": setup.micro_batch_size,
        "gradient_accumulation_steps": n,
        "gradient_clipping": 0.0,  # DeepSpeed's default 1.0 would clip before pipecheck reads
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def deepspeed_rank_step(ctx: RankContext, spec: Any) -> DeepSpeedRankResult:
    """What every rank runs (top-level, so it pickles). ``spec.setup(ctx)`` builds the rank's
    :class:`EngineSetup`; a failure there is agreed on by all ranks and returned as data, so the
    World stays up. A failure inside DeepSpeed raises, and the World reports it."""
    stopped = DeepSpeedRankResult(ctx.rank)

    def prepare() -> tuple[Any, EngineSetup]:
        with clock(stopped.timings, "import_s"):
            ctx.action = "import deepspeed"
            deepspeed = import_deepspeed()
        ctx.action = "prepare layers"
        return deepspeed, spec.setup(ctx)

    prepared = prepare_together(ctx, stopped, prepare)
    if prepared is None:
        return stopped
    result = _train_batch(ctx, *prepared)
    result.timings.update(stopped.timings)
    return result


@contextlib.contextmanager
def clock(timings: dict[str, float], key: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - started


@contextlib.contextmanager
def quiet_tied_broadcast() -> Iterator[None]:
    """DeepSpeed broadcasts tied weights at construction outside no_grad; torch then warns at backward
    that c10d::broadcast_ has no autograd kernel. The gradients are right (checked): the warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
        yield


def build_engine(ctx: RankContext, deepspeed: Any, setup: EngineSetup, num_stages: int, config: dict[str, Any],
                 optimizer_of: Callable[[list[nn.Parameter]], torch.optim.Optimizer], dynamic_shape: bool = False,
                 ) -> tuple[Any, nn.Module, dict[int, str]]:
    """DeepSpeed's PipelineModule of ``setup.layers`` over ``num_stages`` stages (the World's other ranks are
    its data-parallel replicas), holding the model's weights, and its engine: ``(engine, module, names)``,
    ``names`` each parameter's DeepSpeed name by ``id``."""
    from deepspeed.pipe import PipelineModule

    with _local_rank(ctx.rank):  # DeepSpeed reads LOCAL_RANK
        ctx.action = "PipelineModule"
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 print()s the partition
            module = PipelineModule(layers=setup.layers, num_stages=num_stages, loss_fn=setup.loss,
                                    partition_method=setup.partition_method, dynamic_shape=dynamic_shape)
        parts = tuple(int(p) for p in module.parts)  # numpy ints with partition_method="parameters"
        if parts != setup.parts:
            raise DeepSpeedStepError(f"DeepSpeed partitioned the layers as {list(parts)}, pipecheck planned "
                                     f"{list(setup.parts)}")
        setup.load(module)
        if setup.recorder is not None and setup.record_stage_module:  # this stage's layers, as one chain link
            instrument_module(module, ctx.rank, None, None, setup.recorder)
        names = {id(p): name for name, p in module.named_parameters()}
        optimizer = optimizer_of(list(module.parameters()))
        ctx.action = "deepspeed.initialize"
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine, module, names


def frozen_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed's step needs when the check wants none: SGD at lr 0 (torch's SGD refuses an
    empty parameter list, which a stage of parameter-free layers has)."""
    return torch.optim.SGD(params or [nn.Parameter(torch.zeros(()))], lr=0.0)


def _train_batch(ctx: RankContext, deepspeed: Any, setup: EngineSetup) -> DeepSpeedRankResult:
    result = DeepSpeedRankResult(ctx.rank, stage_grads={ctx.rank: {}})
    ctx.stage = ctx.rank
    groups_before = set(dist.distributed_c10d._world.pg_map)
    names: dict[int, str] = {}

    def optimizer_of(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = frozen_sgd(params)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: result.stage_grads[ctx.rank].update(
            {setup.engine_fqn(names[id(p)]): p.grad.detach().cpu().clone() for group in opt.param_groups
             for p in group["params"] if id(p) in names and p.grad is not None}))
        return optimizer

    with clock(result.timings, "build_s"):
        engine, module, built = build_engine(ctx, deepspeed, setup, ctx.world_size, _config(setup), optimizer_of)
        names.update(built)
    with clock(result.timings, "train_batch_s"), quiet_tied_broadcast():
        ctx.action = "train_batch"
        loss = engine.train_batch(data_iter=iter(setup.batches))
    ctx.action = "collect"
    result.loss = loss.detach().cpu().reshape(())
    recorded = sorted(setup.loss.outputs)
    result.outputs = [setup.loss.outputs[mb] for mb in recorded]
    result.buffers = {ctx.rank: {setup.engine_fqn(name): b.detach().cpu().clone()
                                 for name, b in module.named_buffers()}}
    result.input_grads = setup.input_grads(module)
    if setup.recorder is not None:
        result.boundaries = setup.recorder.exported()
    with clock(result.timings, "teardown_s"):
        ctx.action = "teardown"
        teardown(engine, groups_before)
    return result


def teardown(engine: Any, keep: set[Any]) -> None:
    """Free what one engine holds in a persistent rank.

    The last stage's engine is otherwise never collected: its outputs' autograd nodes hold
    DeepSpeed's backward hooks, which close over the engine (a cycle Python's gc cannot see),
    and with it about five gloo groups, their threads and sockets.
    """
    import deepspeed.runtime.pipe.p2p as p2p

    engine.destroy()
    for key in engine.pipe_buffers:  # the outputs (and the hooks on their autograd nodes) go first
        engine.pipe_buffers[key] = []
    engine.loss = engine.total_loss = engine.outputs = None
    engine.fwd_outputs = []
    p2p._groups = p2p._grid = None  # DeepSpeed's p2p module keeps the last engine's groups in globals
    gc.collect()
    dist.barrier()  # no rank may still be talking on a group destroyed below
    for group in [g for g in list(dist.distributed_c10d._world.pg_map) if g not in keep]:
        dist.destroy_process_group(group)
    gc.collect()


# --- what DeepSpeed builds: pipecheck's split, or a user's layer list ------------------------------


@dataclass(frozen=True)
class SplitModelSpec:
    """runner="deepspeed": the job's model split by pipecheck, one DeepSpeed layer per stage
    (see :mod:`pipecheck._runners.deepspeed.layers`). Every rank builds the model itself and cuts it along
    the driver's split (its recipe)."""

    model: Callable[[], nn.Module]  # seeded and picklable (a ModelFactory is built on the rank's device)
    split_spec: Mapping[str, Any] | None
    policy: Policy | None
    tracer: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: LossFn | None
    target: Any
    n_microbatches: int
    input_grads_of: tuple[str, ...] = ()  # fed model inputs whose gradients are wanted
    scalars: dict[Source, str] = field(default_factory=dict)  # boundary values that are Python numbers
    record: bool = False  # record the stage modules' boundary values (a failing check's second run)
    recipe: bytes | None = None  # the driver's split (pipe.recipe.dumps()): ranks cut along it, no trace

    def engine_built(self, engine: Any) -> None:
        """Called on every rank of a training check once DeepSpeed's engine exists: a subclass may set the
        engine's knobs here (as a user's script would after ``deepspeed.initialize``)."""

    def layout(self, pipe: Pipe, bound: Mapping[str, Any]) -> SplitLayout:
        """The layer chain: what each boundary carries (as the driver's dry run found), the tied modules."""
        return dataclasses.replace(split_layout(pipe, bound), scalars=dict(self.scalars))

    def setup(self, ctx: RankContext) -> EngineSetup:
        from deepspeed.pipe import TiedLayerSpec

        args, kwargs = cast_inputs((tuple(self.args), dict(self.kwargs)), None, ctx.device)
        pipe = split_on(ctx.device, self.model, args, kwargs, split_spec=self.split_spec, policy=self.policy,
                        tracer=self.tracer, recipe=self.recipe)
        recorder = Boundaries() if self.record else None
        if recorder is not None:  # pipecheck's own stage modules, named as the reference names their values
            instrument(pipe, recorder)
        bound = pipe.bind_inputs(args, kwargs)
        layout = self.layout(pipe, bound)
        constants = {name: unwrap_replicated(bound[name]) for name in layout.constants}
        stage_layers = [PipeStageLayer(stage, layout, constants, self.input_grads_of) for stage in pipe.stages]
        for layer in stage_layers:
            layer.on_forward = _naming(ctx)
        per_stage = 1 + max(len(layout.tied_of(s)) for s in range(pipe.num_stages))
        layers: list[Any] = []
        for stage, layer in zip(pipe.stages, stage_layers):
            tied = [TiedLayerSpec(group.key, TiedParamsModule, *_shapes(pipe, group), forward_fn=pass_through,
                                  tied_weight_attr=[group.attr(fqn) for fqn in group.fqns])
                    for group in layout.tied_of(stage.index)]
            layers += [identity] * (per_stage - 1 - len(tied)) + tied + [layer]
        microbatches = split_microbatches({name: bound[name] for name in layout.feed}, self.n_microbatches)
        target = cast_inputs(self.target, None, ctx.device)

        def feed(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Any]:
            """Another batch's micro-batches, as DeepSpeed's data iterator hands them to the first stage."""
            bound = pipe.bind_inputs(*cast_inputs((tuple(args), dict(kwargs)), None, ctx.device))
            return [tuple(mb[name] for name in layout.feed)
                    for mb in split_microbatches({name: bound[name] for name in layout.feed}, n)]

        return EngineSetup(
            layers=layers,
            partition_method="uniform",  # the same number of layers per stage: exactly one stage each
            parts=tuple(range(0, len(layers) + 1, per_stage)),
            batches=[(tuple(mb[name] for name in layout.feed), torch.tensor([i]))
                     for i, mb in enumerate(microbatches)],
            loss=RecordingLoss(MicrobatchLoss(self.loss_fn, target, self.n_microbatches),
                               lambda outputs: pytree.tree_unflatten(list(outputs), pipe.out_spec)),
            micro_batch_size=max(1, bound[layout.feed[0]].shape[0] // self.n_microbatches),
            engine_fqn=_split_names(pipe, layout, per_stage).__getitem__,
            load=lambda module: _load_split(module, pipe, layout),
            input_grads=_recorded_input_grads,
            recorder=recorder,
            feed=feed,
        )


def _naming(ctx: RankContext) -> Callable[[int, int], None]:
    def name(stage: int, microbatch: int) -> None:
        ctx.stage, ctx.action = stage, f"{stage}F{microbatch} (DeepSpeed)"

    return name


def _shapes(pipe: Pipe, group: TiedParams) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
    params = {fqn: p for stage in pipe.stages for local, p in stage.module.named_parameters(remove_duplicate=False)
              for fqn in [stage.local_to_fqn.get(local)] if fqn in group.fqns}
    return [tuple(params[fqn].shape) for fqn in group.fqns], [params[fqn].dtype for fqn in group.fqns]


class _Names(dict[str, str]):
    def __missing__(self, name: str) -> str:
        return name  # a name pipecheck cannot map is reported as it is: the check flags it


def _split_names(pipe: Pipe, layout: SplitLayout, per_stage: int) -> _Names:
    """DeepSpeed's parameter and buffer names -> the model's FQNs."""
    names = _Names()
    for stage in pipe.stages:
        layer = stage.index * per_stage + per_stage - 1
        for local, fqn in {**stage.local_to_fqn, **stage.buffer_fqns}.items():
            names[f"{layer}.stage.{local}"] = fqn
    for group in layout.tied:
        for fqn in group.fqns:
            names[f"tied_modules.{group.key}.{group.attr(fqn)}"] = fqn
    return names


def _local_stage_layers(module: nn.Module) -> list[PipeStageLayer]:
    return [child for child in module.children() if isinstance(child, PipeStageLayer)]


def _load_split(module: nn.Module, pipe: Pipe, layout: SplitLayout) -> None:
    """The stage layers hold the model's weights already; a tied parameter becomes DeepSpeed's tied
    module's, which the stage layer then uses (DeepSpeed all-reduces its gradient)."""
    for layer in _local_stage_layers(module):
        stage = pipe.stages[layer.index]
        for group in layout.tied_of(layer.index):
            tied = module.get_submodule(f"tied_modules.{group.key}")
            for fqn in group.fqns:
                shared = tied.get_parameter(group.attr(fqn))
                for local in [name for name, f in stage.local_to_fqn.items() if f == fqn]:
                    owner_name, _, attr = local.rpartition(".")
                    owner = layer.stage.get_submodule(owner_name)
                    with torch.no_grad():
                        shared.copy_(owner.get_parameter(attr))
                    setattr(owner, attr, shared)


def _recorded_input_grads(module: nn.Module) -> dict[str, list[torch.Tensor]]:
    grads: dict[str, list[torch.Tensor]] = {}
    for layer in _local_stage_layers(module):
        for recorded in layer.recorded:
            for name, value in recorded.items():
                if value.grad is not None:
                    grads.setdefault(name, []).append(value.grad.detach().cpu().clone())
    return grads


@dataclass(frozen=True)
class LayerListSpec:
    """A user's DeepSpeed layer list (``pc.engines.deepspeed.check``): DeepSpeed builds ``layers``;
    parameters are named after the reference list's layers, whose tied keys ``reference_keys`` holds."""

    layers: bytes  # the pickled layers: unpickled after DeepSpeed is imported on the CPU accelerator
    reference_keys: tuple[str | None, ...]  # per layer index: its tied key in the reference list
    partition_method: str
    parts: tuple[int, ...]
    state: dict[str, torch.Tensor]  # the reference model's parameters and buffers, by its names
    inputs: Any  # the first layer's input, one full batch
    loss_fn: LossFn | None
    target: Any
    n_microbatches: int
    record: bool = False  # record each stage's boundary values (a failing check's second run)

    def engine_fqn(self, name: str) -> str:
        head, _, rest = name.partition(".")
        if head.isdigit() and int(head) < len(self.reference_keys) and self.reference_keys[int(head)] is not None:
            return f"tied_modules.{self.reference_keys[int(head)]}.{rest}"
        return name

    def setup(self, ctx: RankContext) -> EngineSetup:
        inputs = cast_inputs(self.inputs, None, ctx.device)
        microbatches = split_microbatches(inputs, self.n_microbatches)
        first = next(leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor))
        return EngineSetup(
            layers=list(pickle.loads(self.layers)),
            partition_method=self.partition_method,
            parts=self.parts,
            batches=[(mb, torch.tensor([i])) for i, mb in enumerate(microbatches)],
            loss=RecordingLoss(MicrobatchLoss(self.loss_fn, cast_inputs(self.target, None, ctx.device),
                                              self.n_microbatches), lambda outputs: outputs),
            micro_batch_size=max(1, first.shape[0] // self.n_microbatches),
            engine_fqn=self.engine_fqn,
            load=self.load,
            recorder=Boundaries() if self.record else None,
            record_stage_module=True,
        )

    def load(self, module: nn.Module) -> None:
        with torch.no_grad():
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                fqn = self.engine_fqn(name)
                if fqn not in self.state:
                    raise DeepSpeedStepError(f"DeepSpeed's {name!r} has no counterpart {fqn!r} in the reference "
                                             f"model (which has {sorted(self.state)[:8]}...)")
                tensor.copy_(self.state[fqn])
