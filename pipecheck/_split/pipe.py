"""The splitter: cut a traced model into stages and describe them as a ``Pipe``.

    pipe = pc.split(model, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING})
    pipe.num_stages, pipe.stage_module(1), pipe.tied_groups, pipe.edges
    print(pipe)

Every stage is an ``fx.GraphModule`` whose parameters keep their original
FQNs. A stage's forward takes the values listed in ``stage.inputs`` (model
inputs or values of earlier stages, however far back) and returns
``stage.outputs``; the last stage returns the model's output leaves. The model
is deep-copied first, so the user's module is never touched.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import linecache
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.checkpoints import outline_checkpoints, register_region_modules
from pipecheck._split.inputs import as_args
from pipecheck._split.markers import PIPE_SPLIT_OP, is_marker
from pipecheck._split.model_factory import (
    ModelFactory,
    ModelLike,
    build_module,
    copy_module,
    is_default_generator,
)
from pipecheck._split.model_outputs import caches_left_out
from pipecheck._split.recipe import SplitRecipe
from pipecheck._split.trace import check_tracer, trace
from pipecheck._split.traced import SplitSpec, Traced, normalize_split_spec
from pipecheck.errors import SplitError, plural
from pipecheck.policies import Policy, Unit, validate_cuts

COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Source:
    """Where a stage input comes from: a model input (``stage is None``) or an earlier stage."""

    stage: int | None
    name: str

    def __str__(self) -> str:
        return f"input {self.name}" if self.stage is None else f"stage {self.stage}.{self.name}"


@dataclass(frozen=True)
class Edge:
    """Stage ``dst`` consumes value ``name`` from stage ``src`` (``None``: a model input)."""

    src: int | None
    dst: int
    name: str


@dataclass(frozen=True)
class TiedGroup:
    """One parameter used by more than one stage; ``aliases`` are its other FQNs."""

    fqn: str
    aliases: tuple[str, ...]
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Stage:
    index: int
    module: fx.GraphModule
    inputs: tuple[Source, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]  # canonical FQNs, as model.named_parameters() names them
    buffers: tuple[str, ...]
    local_to_fqn: Mapping[str, str]  # the stage module's own parameter names -> canonical FQN
    buffer_fqns: Mapping[str, str] = field(default_factory=dict)  # its own buffer names -> canonical FQN

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """This stage's buffers by canonical FQN (the tensors themselves: a forward may update them)."""
        return {self.buffer_fqns[local]: buffer for local, buffer in self.module.named_buffers(remove_duplicate=False)
                if local in self.buffer_fqns}


def _plain(value: Any) -> Any:
    """fx's immutable containers -> plain tuple/list/dict, so outputs compare with eager ones."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    return value


class Pipe:
    """A model cut into stages. Build with :func:`pipecheck.split`."""

    def __init__(self, stages: list[Stage], traced: Traced, out_spec: pytree.TreeSpec,
                 output_sources: tuple[Source | None, ...], tied_groups: list[TiedGroup],
                 model_name: str, model: nn.Module, recipe: SplitRecipe | None = None) -> None:
        """``recipe``: the one ``traced`` was rebuilt from (a rank's split along the driver's), kept as it is."""
        self.stages = stages
        self.input_names = traced.input_names
        self.tracer = traced.tracer
        self.out_spec = out_spec
        self.output_sources = output_sources  # per output leaf; None for a constant
        self.tied_groups = tied_groups
        self.model_name = model_name
        self._bind = functools.partial(traced.binding, model)
        self._holders = _param_holders(stages)
        # The traced graph, for ranks to cut their own model the same way without tracing it again.
        self.recipe = recipe if recipe is not None else SplitRecipe.of(
            traced.graph, model, traced.attrs, tracer=traced.tracer, input_names=traced.input_names,
            binding=traced.binding, out_spec=traced.out_spec)

    def __deepcopy__(self, memo: dict[int, Any]) -> Pipe:
        """Stages copied with their parameters and buffers (ties kept); the output structure shared
        (a TreeSpec is immutable, and deep-copying one warns), and so are the recipe and the binding."""
        for shared in (self.out_spec, self.recipe, self._bind):  # immutable; the binding reads forward's signature
            memo[id(shared)] = shared
        for stage in self.stages:  # torch's default generator, lifted by torch.export: the copy draws from it too
            for value in vars(stage.module).values():
                if isinstance(value, torch.Generator) and is_default_generator(value):
                    memo[id(value)] = value
        copied = object.__new__(Pipe)
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        for stage in copied.stages:  # each copy compiled its forward anew
            source_freed_with(stage.module)
        return copied

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_module(self, i: int) -> fx.GraphModule:
        return self.stages[i].module

    def stage_params(self, i: int) -> list[str]:
        return list(self.stages[i].params)

    @property
    def edges(self) -> list[Edge]:
        return [Edge(src.stage, stage.index, src.name) for stage in self.stages for src in stage.inputs]

    def bind_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Map the model's (args, kwargs) to the graph's named inputs."""
        return self._bind(tuple(args), dict(kwargs or {}))

    def param_stages(self, fqn: str) -> tuple[int, ...]:
        """The stages holding parameter ``fqn`` (more than one for a tied parameter)."""
        return self._holders.get(fqn, ())

    def buffer_stages(self, fqn: str) -> tuple[int, ...]:
        """The stages holding buffer ``fqn``."""
        return tuple(stage.index for stage in self.stages if fqn in stage.buffers)

    @contextlib.contextmanager
    def buffers_restored(self) -> Iterator[Pipe]:
        """This pipe for a block whose runs may update its buffers; their values put back after."""
        saved = [(b, b.detach().clone()) for stage in self.stages for b in stage.module.buffers()]
        try:
            yield self
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    def buffers_after_step(self) -> dict[str, torch.Tensor]:
        """Every stage-held buffer by canonical FQN, copied as it is now (after a step ran): where
        several stages hold one, the last stage's, which ran last."""
        found: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            found.update({fqn: b.detach().clone() for fqn, b in stage.named_buffers().items()})
        return found

    def __repr__(self) -> str:
        return f"<Pipe {self.model_name}: {plural(self.num_stages, 'stage')}, tracer={self.tracer!r}>"

    def __str__(self) -> str:
        lines = [f"Pipe({self.model_name}, {plural(self.num_stages, 'stage')}, tracer={self.tracer})"]
        for stage in self.stages:
            lines.append(f"  stage {stage.index}:")
            lines.append(f"    inputs:  {', '.join(map(str, stage.inputs)) or '-'}")
            shown = ", ".join(stage.outputs) if stage.index < self.num_stages - 1 else "model outputs"
            lines.append(f"    outputs: {shown}")
            lines.append(f"    params:  {_short_list(stage.params)}")
            if stage.buffers:
                lines.append(f"    buffers: {_short_list(stage.buffers)}")
        for group in self.tied_groups:
            alias = f" (aliases: {', '.join(group.aliases)})" if group.aliases else ""
            lines.append(f"  tied: {group.fqn}{alias} in stages {', '.join(map(str, group.stages))}")
        return "\n".join(lines)


def _short_list(names: Sequence[str], limit: int = 8) -> str:
    if not names:
        return "-"
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", ... ({len(names)} in all)"


def _apply_policy(graph: fx.Graph, policy: Policy, canonical: dict[int, str], attrs: dict[str, Any]) -> None:
    for node in [n for n in graph.nodes if is_marker(n)]:
        graph.erase_node(node)
    units: list[Unit] = []
    nodes: list[fx.Node] = []
    counted: set[int] = set()
    for node in graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        params, nbytes = 0, 0
        for tensor in _node_params(node, attrs):
            if id(tensor) not in counted and id(tensor) in canonical:
                counted.add(id(tensor))
                params += tensor.numel()
                nbytes += tensor.numel() * tensor.element_size()
        units.append(Unit(node.name, params, nbytes))
        nodes.append(node)
    cuts = validate_cuts(policy(units), len(units), policy)
    for cut in cuts:
        with graph.inserting_before(nodes[cut]):
            graph.call_function(PIPE_SPLIT_OP, (), {})


def _target(node: fx.Node) -> str:
    """The attribute path of a get_attr / call_module / placeholder node."""
    return str(node.target)


def _node_params(node: fx.Node, attrs: dict[str, Any]) -> list[torch.Tensor]:
    if node.op == "call_module":
        return list(attrs[_target(node)].parameters())
    return [attrs[_target(a)] for a in node.all_input_nodes
            if a.op == "get_attr" and isinstance(attrs[_target(a)], nn.Parameter)]


def _assign_stages(graph: fx.Graph) -> tuple[dict[fx.Node, int], int]:
    stage_of: dict[fx.Node, int] = {}
    current = 0
    counts = [0]
    for node in graph.nodes:
        if is_marker(node):
            current += 1
            counts.append(0)
        elif node.op in COMPUTE_OPS:
            stage_of[node] = current
            counts[current] += 1
    empty = [i for i, c in enumerate(counts) if c == 0]
    if empty:
        raise SplitError(
            f"the cuts leave stage(s) {empty} of {len(counts)} empty (no computation between two cuts, "
            "or a cut at the very start or end of forward). Fix: remove the extra pipe_split()/split_spec "
            "entry, or move it so every stage computes something."
        )
    return stage_of, len(counts)


def _build_stage(index: int, nodes: list[fx.Node], stage_of: dict[fx.Node, int],
                 returns: list[Any], traced: Traced) -> tuple[fx.GraphModule, tuple[Source, ...]]:
    """Copy one stage's nodes into a new graph with placeholders for what crosses in."""
    external: list[fx.Node] = []

    def note(arg: fx.Node) -> None:
        if arg.op != "get_attr" and stage_of.get(arg) != index and arg not in external:
            external.append(arg)

    for node in nodes:
        for arg in node.all_input_nodes:
            note(arg)
    for value in returns:
        if isinstance(value, fx.Node):
            note(value)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in external:
        env[arg] = graph.placeholder(arg.name)
    roots: dict[str, Any] = {}

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:  # a get_attr: every stage that uses it gets its own copy
            env[arg] = graph.get_attr(_target(arg))
            roots[_target(arg)] = traced.attrs[_target(arg)]
        return env[arg]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
        if node.op == "call_module":
            roots[_target(node)] = traced.attrs[_target(node)]
    graph.output(tuple(lookup(v) if isinstance(v, fx.Node) else v for v in returns))
    outline_checkpoints(graph, roots)  # each checkpointed region: one call that recomputes it in backward
    module = source_freed_with(fx.GraphModule(roots, graph, class_name=f"Stage{index}"))
    register_region_modules(module)
    sources = tuple(Source(None if a.op == "placeholder" else stage_of[a],
                           _target(a) if a.op == "placeholder" else a.name) for a in external)
    return module, sources


def source_freed_with(module: fx.GraphModule) -> fx.GraphModule:
    """``module``, whose compiled forward's source torch.fx forgets when the module is freed.

    fx keeps the source of every forward it compiles in a process-wide cache and in ``linecache``,
    never freed: a stage module a check, measured at 3.4 KiB a check on the driver and on every
    rank (benchmarks/soak.py), growing without bound over a long test session.
    """
    weakref.finalize(module, _forget_source, type(module).forward.__code__.co_filename)
    return module


def _forget_source(key: str) -> None:
    cache = getattr(getattr(fx.graph_module, "_loader", None), "eval_cache", None)
    if isinstance(cache, dict):
        cache.pop(key, None)
    linecache.cache.pop(key, None)


def partition(traced: Traced, model: nn.Module, recipe: SplitRecipe | None = None) -> Pipe:
    canonical = {id(p): name for name, p in model.named_parameters()}
    order = {name: i for i, name in enumerate(canonical.values())}
    canonical_buffers = {id(b): name for name, b in model.named_buffers()}
    stage_of, n_stages = _assign_stages(traced.graph)
    output_node = next(n for n in traced.graph.nodes if n.op == "output")
    leaves, out_spec = pytree.tree_flatten(_plain(output_node.args[0]))
    if traced.out_spec is not None:
        out_spec = traced.out_spec
    users_after: dict[fx.Node, int] = {}  # node -> last stage that reads it
    for node, s in stage_of.items():
        for arg in node.all_input_nodes:
            users_after[arg] = max(users_after.get(arg, -1), s)
    stages: list[Stage] = []
    for index in range(n_stages):
        nodes = [n for n, s in stage_of.items() if s == index]
        if index == n_stages - 1:
            returns: list[Any] = list(leaves)
        else:
            returns = [n for n in nodes if users_after.get(n, -1) > index
                       or any(leaf is n for leaf in leaves)]
        module, sources = _build_stage(index, nodes, stage_of, returns, traced)
        local = dict(module.named_parameters(remove_duplicate=False))
        local_to_fqn = {name: canonical[id(p)] for name, p in local.items() if id(p) in canonical}
        params = tuple(sorted(set(local_to_fqn.values()), key=order.__getitem__))
        buffer_fqns = {local: canonical_buffers[id(b)] for local, b in module.named_buffers(remove_duplicate=False)
                       if id(b) in canonical_buffers}
        buffers = tuple(dict.fromkeys(buffer_fqns.values()))
        outputs = tuple(v.name for v in returns if isinstance(v, fx.Node)) if index < n_stages - 1 else ()
        stages.append(Stage(index, module, sources, outputs, params, buffers, local_to_fqn, buffer_fqns))
    output_sources = tuple(
        (Source(stage_of[v], v.name) if v in stage_of else Source(None, _target(v)) if v.op == "placeholder" else None)
        if isinstance(v, fx.Node) else None for v in leaves)
    return Pipe(stages, traced, out_spec, output_sources, _tied_groups(model, stages), type(model).__name__, model,
                recipe)


def _tied_groups(model: nn.Module, stages: list[Stage]) -> list[TiedGroup]:
    all_names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(name)
    holders = _param_holders(stages)
    return [TiedGroup(names[0], tuple(names[1:]), holders[names[0]])
            for names in all_names.values() if len(holders.get(names[0], ())) > 1]


def _param_holders(stages: list[Stage]) -> dict[str, tuple[int, ...]]:
    """Canonical FQN -> the stages holding it, in stage order (one pass, not one per parameter)."""
    holders: dict[str, list[int]] = {}
    for stage in stages:
        for fqn in stage.params:
            holders.setdefault(fqn, []).append(stage.index)
    return {fqn: tuple(indices) for fqn, indices in holders.items()}


def split(model: ModelLike, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
          split_spec: SplitSpec | None = None, policy: Policy | None = None, tracer: str = "auto") -> Pipe:
    """Cut ``model`` into pipeline stages at ``pipe_split()`` markers, ``split_spec`` or ``policy``.

        pipe = pc.split(model, (x,), split_spec={"layers.2": pc.SplitPoint.BEGINNING})
        pipe = pc.split(model, (x,), policy=pc.policies.balanced_params(4))

    An nn.Module is deep-copied, so stage modules never share parameters with
    ``model``; a factory's fresh module is used as built.
    """
    check_tracer(tracer)
    built, owned = build_module(model)
    return split_module(built if owned else copy_module(built), args, kwargs, split_spec=split_spec,
                        policy=policy, tracer=tracer)


def split_on(device: torch.device, model: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None, *,
             split_spec: SplitSpec | None, policy: Policy | None, tracer: str, recipe: bytes | None = None) -> Pipe:
    """A rank's own split, as the driver made it: a ModelFactory built on ``device``, cut the same way.

    With the driver's ``recipe`` (``pipe.recipe.dumps()``), the rank's model is cut along the driver's
    graph with no trace, unless that graph names another device; without one, it is traced again.
    """
    factory = model.on(device) if isinstance(model, ModelFactory) else model
    check_tracer(tracer)
    built, owned = build_module(factory)  # first: the model's code may register operators the graph calls
    own = built if owned else copy_module(built)
    plan = SplitRecipe.load(recipe, torch.device(device)) if recipe is not None else None
    pipe = split_along(own, plan, args, kwargs) if plan is not None else None
    return pipe if pipe is not None else split_module(own, args, kwargs, split_spec=split_spec, policy=policy,
                                                      tracer=tracer)


def split_along(model: nn.Module, recipe: SplitRecipe, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> Pipe | None:
    """``model`` (pipecheck's own, as built) cut along the graph of a split of the same model, for a call
    with ``(args, kwargs)``: no trace. None where the graph names an attribute the model lacks."""
    attrs = recipe.attrs(model)
    if attrs is None:
        return None
    binding = recipe.binding.for_call(model, as_args(args), dict(kwargs or {}))
    traced = Traced(recipe.graph(), attrs, recipe.input_names, binding, recipe.tracer, recipe.out_spec)
    return partition(traced, model, recipe)  # the recipe it was cut along: not built again from its graph


def split_module(model: nn.Module, args: Sequence[Any] | Any, kwargs: Mapping[str, Any] | None = None, *,
                 split_spec: SplitSpec | None = None, policy: Policy | None = None, tracer: str = "auto") -> Pipe:
    """:func:`split` of a module pipecheck owns, as it is: the stages share its parameters and buffers."""
    if split_spec is not None and policy is not None:
        raise SplitError("both split_spec and policy were given; they disagree on where to cut. "
                         "Fix: pass one of them.")
    check_tracer(tracer)
    model = caches_left_out(model)
    spec = normalize_split_spec(model, split_spec or {})
    traced = trace(model, as_args(args), dict(kwargs or {}), spec, tracer)
    if policy is not None:
        canonical = {id(p): name for name, p in model.named_parameters()}
        _apply_policy(traced.graph, policy, canonical, traced.attrs)
    return partition(traced, model)
