"""Models as DeepSpeed layer lists: pipecheck's split as layers, and a user's layer list as a model.

    layout = split_layout(pipe, pipe.bind_inputs(args, kwargs))   # what travels between the stages
    layer = PipeStageLayer(pipe.stages[1], layout, constants)      # stage 1 as one DeepSpeed layer
    model = LayerListModel(layers, parts=[0, 2, 4])                # the eager reference of a layer list

DeepSpeed's ``PipelineModule`` is a chain: each layer gets the previous
layer's output, and only a tensor or a tuple of tensors crosses a stage
boundary. A split model is not a chain (a skip connection, a keyword input
read by a later stage, an output of a middle stage), so each stage becomes one
layer that receives a *bundle*: every value produced before it (or fed as a
model input) that it or a later stage still needs. It passes on what later
stages need; values a later stage needs travel through the intermediate
stages. Tied parameters become DeepSpeed ``TiedLayerSpec`` modules, one per
set of stages sharing them, whose parameters the stage layers use.

A user's layer list runs eagerly as :class:`LayerListModel`: the same layers
in order, parameters named as DeepSpeed names them (``"3.weight"``,
``"tied_modules.embed.weight"``), one module per tied key, and a
``pipe_split()`` at each of DeepSpeed's stage boundaries.

Nothing here imports DeepSpeed: the layer classes are recognised by name, so
the driver needs DeepSpeed only where the user's own layers already did.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from pipecheck._split.markers import pipe_split
from pipecheck._split.pipe import Pipe, Source, Stage


def _batched(value: Any) -> bool:
    """Split on dim 0 into micro-batches (what DeepSpeed's data iterator feeds)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


@dataclass(frozen=True)
class TiedParams:
    """Parameters several stages use, held by one DeepSpeed tied module (as ``p0``, ``p1``, ...)."""

    key: str  # the TiedLayerSpec key: "stages_0_3"
    stages: tuple[int, ...]
    fqns: tuple[str, ...]

    def attr(self, fqn: str) -> str:
        return f"p{self.fqns.index(fqn)}"


@dataclass(frozen=True)
class SplitLayout:
    """What crosses each stage boundary when a Pipe runs as a DeepSpeed layer chain."""

    feed: tuple[str, ...]  # model inputs split into micro-batches, in the data iterator's order
    constants: tuple[str, ...]  # the other inputs: the same whole value in every micro-batch
    carried: tuple[tuple[Source, ...], ...]  # carried[s]: the bundle stage s receives (s = 0: the feed)
    tied: tuple[TiedParams, ...]
    scalars: Mapping[Source, str] = field(default_factory=dict)  # carried Python numbers: "int", "float", "bool"

    def outgoing(self, stage: int) -> tuple[Source, ...] | None:
        """The bundle ``stage`` sends on (None for the last stage: it returns the model's outputs)."""
        return self.carried[stage + 1] if stage + 1 < len(self.carried) else None

    def tied_of(self, stage: int) -> list[TiedParams]:
        return [group for group in self.tied if stage in group.stages]


def split_layout(pipe: Pipe, bound: Mapping[str, Any]) -> SplitLayout:
    """The layer chain for ``pipe``; ``bound`` are the model's inputs by name (one full batch)."""
    feed = tuple(name for name in pipe.input_names if name in bound and _batched(bound[name]))
    constants = tuple(name for name in bound if name not in feed)
    produced_by = {Source(None, name): -1 for name in feed}
    last_use: dict[Source, int] = {}
    for stage in pipe.stages:
        for name in stage.outputs:
            produced_by[Source(stage.index, name)] = stage.index
        for src in stage.inputs:
            if src in produced_by:
                last_use[src] = max(last_use.get(src, stage.index), stage.index)
    carried = [tuple(Source(None, name) for name in feed)]
    for s in range(1, pipe.num_stages):
        carried.append(tuple(src for src, last in last_use.items() if produced_by[src] < s <= last))
    by_stages: dict[tuple[int, ...], list[str]] = {}
    for group in pipe.tied_groups:
        by_stages.setdefault(group.stages, []).append(group.fqn)
    tied = tuple(TiedParams("stages_" + "_".join(map(str, stages)), stages, tuple(fqns))
                 for stages, fqns in by_stages.items())
    return SplitLayout(feed, constants, tuple(carried), tied)


class PipeStageLayer(nn.Module):
    """One stage of a Pipe as one DeepSpeed layer: bundle in, bundle (or the model's outputs) out.

    It follows DeepSpeed's rules for what crosses a boundary without changing a value: a Python
    number (a size read on one stage and used on a later one) travels as a 0-dim tensor and is a
    number again on arrival; a floating tensor it sends that needs no gradient (a model input or a
    constant passed on) is sent as a leaf that accepts one, because the sender runs backward on
    every floating tensor it sent; and every floating tensor it received gets at least a zero
    gradient, because the receiver sends back the gradient of each (one used only through a
    comparison would otherwise have none).
    """

    def __init__(self, stage: Stage, layout: SplitLayout, constants: Mapping[str, Any],
                 record_input_grads: Sequence[str] = ()) -> None:
        super().__init__()
        self.stage = stage.module
        self.index = stage.index
        self.stage_inputs = stage.inputs
        self.output_names = stage.outputs
        self.incoming = layout.carried[stage.index]
        self.outgoing = layout.outgoing(stage.index)
        self.constants = {Source(None, name): value for name, value in constants.items()}
        self.scalars = dict(layout.scalars)
        self.sent_types: dict[Source, type] = {}  # what the last forward sent, before any encoding
        self.record = frozenset(record_input_grads) if stage.index == 0 else frozenset()
        self.recorded: list[dict[str, torch.Tensor]] = []  # stage 0: the inputs whose gradients are wanted
        self.on_forward: Callable[[int, int], None] | None = None  # (stage, micro-batch): names the action
        self.calls = 0

    def forward(self, bundle: Any) -> Any:
        values = bundle if isinstance(bundle, tuple) else (bundle,)
        if self.on_forward is not None:
            self.on_forward(self.index, self.calls)
        self.calls += 1
        env = dict(self.constants)
        env.update((src, _decode(self.scalars[src], v) if src in self.scalars else v)
                   for src, v in zip(self.incoming, values))
        if self.record:
            self.recorded.append({src.name: env[src].requires_grad_() for src in self.incoming
                                  if src.name in self.record})
        outputs = self.stage(*[env[src] for src in self.stage_inputs])
        if self.outgoing is None:
            sent = tuple(outputs)
        else:
            env.update((Source(self.index, name), value) for name, value in zip(self.output_names, outputs))
            self.sent_types = {src: type(env[src]) for src in self.outgoing}
            sent = tuple(_encode(self.scalars[src], env[src]) if src in self.scalars else _sendable(env[src])
                         for src in self.outgoing)
        received = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad
                    ] if self.index else []
        return _zero_gradients_to(sent, received) if received else sent


_SCALARS = {"bool": (bool, torch.bool), "int": (int, torch.int64), "float": (float, torch.float64)}


def scalar_kind(kind: type) -> str | None:
    """"bool", "int" or "float" for a Python number type DeepSpeed must carry as a tensor."""
    return next((name for name, (python, _) in _SCALARS.items() if issubclass(kind, python)), None)


def _encode(kind: str, value: Any) -> torch.Tensor:
    return torch.tensor(value, dtype=_SCALARS[kind][1])


def _decode(kind: str, value: torch.Tensor) -> Any:
    return _SCALARS[kind][0](value.item())


def _sendable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
        return value.detach().requires_grad_()
    return value


class _ZeroGradientsTo(torch.autograd.Function):
    """``carrier`` unchanged; in backward, a zero gradient for each of ``received`` besides the
    carrier's own: every received tensor then has a gradient to send back, even one the stage used
    only through a comparison (its true gradient is zero)."""

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, *received: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(r.shape, r.dtype, r.device) for r in received]
        return carrier.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes]
        return (grad, *zeros)


def _zero_gradients_to(sent: tuple[Any, ...], received: list[torch.Tensor]) -> tuple[Any, ...]:
    for i, value in enumerate(sent):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
            return (*sent[:i], _ZeroGradientsTo.apply(value, *received), *sent[i + 1:])
    return sent  # no floating tensor to carry the zeros: the boundary check refuses such a stage


def pass_through(module: nn.Module, inputs: Any) -> Any:
    """The forward of a tied layer that only places its module on a stage (top-level: DeepSpeed
    calls it with the module)."""
    return inputs


def identity(inputs: Any) -> Any:
    """A parameter-free padding layer: every stage gets the same number of layers."""
    return inputs


class TiedParamsModule(nn.Module):
    """DeepSpeed's tied module for one :class:`TiedParams`: its parameters, shaped like the model's."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> None:
        super().__init__()
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape, dtype=dtype)))


# --- a user's layer list ---------------------------------------------------------------------------


def spec_kind(layer: Any) -> str:
    """"tied", "spec" (a LayerSpec), "module" or "callable", recognised without importing DeepSpeed."""
    names = {cls.__name__ for cls in type(layer).__mro__}
    if "TiedLayerSpec" in names:
        return "tied"
    if "LayerSpec" in names:
        return "spec"
    return "module" if isinstance(layer, nn.Module) else "callable"


class LayerListModel(nn.Module):
    """A DeepSpeed layer list as one eager module, parameters named as DeepSpeed names them.

    Layer ``i`` built from a ``LayerSpec`` (or given as a module) is child ``"i"``; a
    ``TiedLayerSpec``'s module is ``tied_modules.<key>``, built at its key's first use and
    shared by every later use (called through the spec's ``forward_fn`` when it has one).
    ``parts`` are DeepSpeed's stage boundaries (layer indices); a ``pipe_split()`` marks each.
    """

    def __init__(self, layers: Sequence[Any], parts: Sequence[int] = ()) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()  # registered first, as DeepSpeed does
        self.kinds = [spec_kind(layer) for layer in layers]
        self.forward_fns: list[Any] = []
        self.keys: list[str | None] = []
        for i, (layer, kind) in enumerate(zip(layers, self.kinds)):
            self.keys.append(str(layer.key) if kind == "tied" else None)
            self.forward_fns.append(layer.forward_fn if kind == "tied" else None)
            if kind == "tied" and str(layer.key) not in self.tied_modules:
                self.tied_modules[str(layer.key)] = layer.build()
            elif kind == "spec":
                self.add_module(str(i), layer.build())
            elif kind == "module":
                self.add_module(str(i), layer)
        self.plain = [layer if kind == "callable" else None for layer, kind in zip(layers, self.kinds)]
        self.cuts = frozenset(int(p) for p in list(parts)[1:-1])

    def module(self, i: int) -> nn.Module | None:
        """The module layer ``i`` holds (its tied key's for a tied layer; None for a plain callable)."""
        key = self.keys[i]
        if key is not None:
            return self.tied_modules[key]
        return None if self.kinds[i] == "callable" else self.get_submodule(str(i))

    def layer(self, i: int) -> Callable[[Any], Any]:
        """Layer ``i`` as DeepSpeed calls it."""
        module, fn = self.module(i), self.forward_fns[i]
        if module is None:
            return self.plain[i]  # type: ignore[return-value]
        if fn is None:
            return module
        return functools.partial(fn, module)

    def forward(self, inputs: Any) -> Any:
        x = inputs
        for i in range(len(self.kinds)):
            if i in self.cuts:
                pipe_split()
            x = self.layer(i)(x)
        return x


def layer_param_counts(model: LayerListModel) -> list[int]:
    """Trainable parameters per layer, as DeepSpeed counts them for ``partition_method='parameters'``
    (a tied layer counts its module at every use)."""
    modules = [model.module(i) for i in range(len(model.kinds))]
    return [0 if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad)
            for module in modules]


# --- DeepSpeed's rules for what crosses a stage boundary, checked before any rank starts -----------

_SENDABLE = (torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16,
             torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)  # its DTYPE_TO_ID
_META_SIZE = 256  # int32 slots for a boundary's metadata (its TENSOR_META_SIZE)


@dataclass(frozen=True)
class BoundaryProblem:
    """A value DeepSpeed cannot carry across a stage boundary: what it would do instead."""

    stage: int  # the stage that fails (the sender, or the receiver for a missing gradient)
    message: str


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        what = f"{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    else:
        what = type(value).__name__
    return f"{'an' if what[0] in 'aeiou' else 'a'} {what}"


def _as_sent(value: Any, stage: int) -> tuple[list[torch.Tensor], list[BoundaryProblem]]:
    """The tensors DeepSpeed would send for ``value`` (a tensor or a tuple of tensors)."""
    if isinstance(value, torch.Tensor):
        tensors = [value]
    elif isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        tensors = list(value)
    else:
        items = value if isinstance(value, tuple) else [value]
        bad = ", ".join(f"[{i}] {_describe(v)}" for i, v in enumerate(items) if not isinstance(v, torch.Tensor))
        what = f"a tuple holding {bad}" if isinstance(value, tuple) else _describe(value)
        return [], [BoundaryProblem(stage, f"stage {stage} sends {what} to stage {stage + 1}: DeepSpeed sends "
                                           "only a tensor or a tuple of tensors between stages (it fails with "
                                           "'Could not send meta type' or an assert in _send_tensor_meta)")]
    problems = []
    meta = 2 + sum(2 + t.dim() for t in tensors)
    if meta > _META_SIZE:
        problems.append(BoundaryProblem(stage, f"stage {stage} sends {len(tensors)} tensors: their metadata "
                                               f"takes {meta} slots, DeepSpeed has {_META_SIZE}"))
    for i, t in enumerate(tensors):
        if t.dtype not in _SENDABLE:
            problems.append(BoundaryProblem(stage, f"stage {stage} sends [{i}] {_describe(t)}: DeepSpeed cannot "
                                                   "send that dtype"))
        elif t.is_floating_point() and not t.requires_grad:
            problems.append(BoundaryProblem(stage, f"stage {stage} sends [{i}] {_describe(t)} that does not "
                                                   "require grad (a model input or a constant): DeepSpeed runs "
                                                   "backward on every floating tensor a stage sends ('element 0 "
                                                   "of tensors does not require grad')"))
    return tensors, problems


def boundary_problems(stages: Sequence[Callable[[Any], Any]], first_input: Any,
                      loss: Callable[[Any], torch.Tensor]) -> list[BoundaryProblem]:
    """Run one micro-batch through ``stages`` as DeepSpeed's PipelineEngine passes values, in one
    process: what it would fail on, every problem at once (empty: DeepSpeed can run it).

    The first stage gets detached inputs; each later one gets fresh copies of what the previous
    sent, floating ones requiring grad; backward runs from the loss and then from every floating
    tensor each stage sent, with the gradients its receiver found.
    """
    inputs = first_input if isinstance(first_input, tuple) else (first_input,)
    if not all(isinstance(v, torch.Tensor) for v in inputs):
        return [BoundaryProblem(0, f"the model input is {_describe(first_input)}: DeepSpeed's data loader feeds "
                                   "the first stage only a tensor or a tuple of tensors")]
    value: Any = tuple(v.detach().clone() for v in inputs) if isinstance(first_input, tuple) \
        else first_input.detach().clone()
    problems: list[BoundaryProblem] = []
    sent: list[list[torch.Tensor]] = []
    received: list[list[torch.Tensor]] = [[]]
    for index, stage in enumerate(stages):
        value = stage(value)
        if index == len(stages) - 1:
            break
        tensors, found = _as_sent(value, index)
        problems += found
        if not tensors:
            return problems
        sent.append(tensors)
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        received.append(leaves)
        value = tuple(leaf.clone() for leaf in leaves) if isinstance(value, tuple) else leaves[0].clone()
    if problems:
        return problems
    result = loss(value)
    if result.requires_grad:
        result.backward()
    for index in range(len(stages) - 2, -1, -1):
        pairs = {i: (out, leaf) for i, (out, leaf) in enumerate(zip(sent[index], received[index + 1]))
                 if out.is_floating_point()}
        missing = [i for i, (_, leaf) in pairs.items() if leaf.grad is None]
        for i in missing:
            problems.append(BoundaryProblem(index + 1, f"stage {index + 1} receives [{i}] "
                                                       f"{_describe(pairs[i][1])} from stage {index} but computes "
                                                       "no gradient for it (unused, or used only through a "
                                                       "comparison or .detach()): DeepSpeed asserts every "
                                                       "received floating tensor has a gradient to send back "
                                                       "(_exec_send_grads)"))
        if missing:
            return problems
        backward = [(out, leaf.grad) for out, leaf in pairs.values() if out.requires_grad]
        if backward:
            torch.autograd.backward([out for out, _ in backward], [grad for _, grad in backward])
    return problems
