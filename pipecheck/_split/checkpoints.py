"""Activation checkpointing kept through the split: each stage recomputes what the model checkpoints.

    with checkpoints_marked():                # while a tracer runs
        graph = tracer.trace(model)           # each torch.utils.checkpoint call: its ops between two bounds
    outline_checkpoints(stage_graph, roots)   # each region of a stage: one checkpointed call

Left alone, both tracers lose a ``torch.utils.checkpoint`` call: fx and non-strict export record the
checkpointed function's ops inline (the stages then keep every activation and recompute nothing), and
export cannot record the reentrant variant at all (its ``function`` argument is a module or a
``functools.partial``, not a graph value). While pipecheck traces, ``torch.utils.checkpoint`` runs the
function plainly between two bounds (``pipecheck::checkpoint_bound``, a side-effectful op export keeps;
a call node under fx), whichever variant the model asked for (HF's ``gradient_checkpointing_enable``,
a plain ``checkpoint(fn, x, use_reentrant=...)``). Each stage's graph then turns the ops between two
bounds into one call that runs them under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
forward keeps only the region's inputs, and backward recomputes it, in every runner that runs
pipecheck's stages. The non-reentrant variant for both: a pipeline stage computes its gradients with
``torch.autograd.grad``, which the reentrant variant does not support; the two recompute the same
values (the RNG state restored as the model asked, ``preserve_rng_state``). A region a cut crosses is
checkpointed on each side of the cut.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch.fx.node import _side_effectful_functions

from pipecheck._split.markers import _active_fx_tracer

torch.library.define("pipecheck::checkpoint_bound",
                     "(bool begin, bool preserve_rng_state, bool reentrant, Tensor[] inputs) -> ()")


@torch.library.impl("pipecheck::checkpoint_bound", "CompositeExplicitAutograd")
def _checkpoint_bound_impl(begin: bool, preserve_rng_state: bool, reentrant: bool, inputs: list[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("pipecheck::checkpoint_bound")
def _checkpoint_bound_fake(begin: bool, preserve_rng_state: bool, reentrant: bool, inputs: list[torch.Tensor]) -> None:
    return None


CHECKPOINT_BOUND_OP = torch.ops.pipecheck.checkpoint_bound.default
_side_effectful_functions.add(CHECKPOINT_BOUND_OP)


def checkpoint_bound(begin: bool, preserve_rng_state: bool, reentrant: bool, inputs: list[Any]) -> None:
    """Where a checkpointed function's ops begin (with the tensors passed to it) or end, in the graph
    being traced."""
    if _active_fx_tracer:
        _active_fx_tracer[-1].create_proxy("call_function", checkpoint_bound,
                                           (begin, preserve_rng_state, reentrant, inputs), {})
    else:
        torch.ops.pipecheck.checkpoint_bound(begin, preserve_rng_state, reentrant, inputs)


_side_effectful_functions.add(checkpoint_bound)


def _tensors(args: Any) -> list[Any]:
    return [arg for arg in args if isinstance(arg, (torch.Tensor, fx.Proxy))]


def _bounded_reentrant(function: Any, preserve_rng_state: bool, args: tuple[Any, ...]) -> Any:
    checkpoint_bound(True, preserve_rng_state, True, _tensors(args))
    result = function(*args)
    checkpoint_bound(False, preserve_rng_state, True, [])
    return result


class _BoundedReentrant:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` while pipecheck traces."""

    @staticmethod
    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        return _bounded_reentrant(function, preserve_rng_state, args)


def _bounded_generator(function: Any, args: Any, kwargs: Any, *, preserve_rng_state: bool = True,
                       **_: Any) -> Iterator[None]:
    """Stands in for torch's non-reentrant context (torch >= 2.15): ``checkpoint`` runs the function
    between its two steps."""
    checkpoint_bound(True, preserve_rng_state, False, [])
    yield
    checkpoint_bound(False, preserve_rng_state, False, [])


def _bounded_generator_before_2_15(function: Any, preserve_rng_state: bool, *_: Any, **__: Any) -> Iterator[None]:
    """The same, for the generator's signature up to torch 2.14."""
    checkpoint_bound(True, preserve_rng_state, False, [])
    yield
    checkpoint_bound(False, preserve_rng_state, False, [])


_STAND_INS = {
    "CheckpointFunction": _BoundedReentrant,
    "_checkpoint_without_reentrant_generator_impl": _bounded_generator,  # torch 2.15
    "_checkpoint_without_reentrant_generator": _bounded_generator_before_2_15,  # torch 2.10 to 2.14
}


@contextlib.contextmanager
def checkpoints_marked() -> Iterator[None]:
    """While a tracer runs: ``torch.utils.checkpoint.checkpoint`` runs its function between two bounds
    (the names its body looks up at call time are replaced, so a ``functools.partial(checkpoint, ...)``
    made earlier, as HF's is, is seen too)."""
    original = {name: getattr(torch_checkpoint, name) for name in _STAND_INS if hasattr(torch_checkpoint, name)}
    if "_checkpoint_without_reentrant_generator_impl" in original:  # 2.15: the older name is not called
        original.pop("_checkpoint_without_reentrant_generator", None)
    for name in original:
        setattr(torch_checkpoint, name, _STAND_INS[name])
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(torch_checkpoint, name, value)


def is_checkpoint_bound(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (checkpoint_bound, CHECKPOINT_BOUND_OP)


@dataclass
class CheckpointedRegion:
    """The ops of one checkpointed region, as a graph of their own (held by the stage as a plain
    attribute: the parameters and modules it uses stay the stage's). ``reentrant``: the positions, among
    its inputs, of the tensors the model passed to a reentrant checkpoint (None: non-reentrant)."""

    module: fx.GraphModule
    preserve_rng_state: bool
    reentrant: tuple[int, ...] | None = None


def run_checkpointed(region: CheckpointedRegion, *args: Any) -> Any:
    """A stage's call of one region: forward keeps its inputs only, backward recomputes it.

    A reentrant checkpoint none of whose tensors requires grad gives outputs that do not either (torch
    warns "None of the inputs have requires_grad=True"): the parameters it uses get no gradient from it.
    The stage does as eager does."""
    if region.reentrant is not None and not any(
            isinstance(args[i], torch.Tensor) and args[i].requires_grad for i in region.reentrant):
        with torch.no_grad():
            return region.module(*args)
    return torch_checkpoint.checkpoint(region.module, *args, use_reentrant=False,
                                       preserve_rng_state=region.preserve_rng_state)


@dataclass
class _Region:
    nodes: list[fx.Node]
    preserve_rng_state: bool = True
    reentrant: list[fx.Node] | None = None  # the tensors passed to a reentrant checkpoint


def outline_checkpoints(graph: fx.Graph, roots: dict[str, Any]) -> int:
    """Turn each checkpointed region of a stage's ``graph`` into one :func:`run_checkpointed` call, its
    region added to ``roots`` (the stage module's attributes); the bounds are removed. Returns how many
    regions there were. A nested region is part of the outer one."""
    regions: list[_Region] = []
    depth, current = 0, _Region([])
    for node in list(graph.nodes):
        if is_checkpoint_bound(node):
            begin, preserve, reentrant, inputs = node.args
            if begin:
                if depth == 0:
                    current = _Region([], bool(preserve), list(inputs) if reentrant else None)
                depth += 1
            elif depth == 0:  # its beginning is in an earlier stage: the region starts with this stage
                regions.append(_Region(current.nodes, bool(preserve)))
                current = _Region([])
            else:
                depth -= 1
                if depth == 0:
                    regions.append(current)
                    current = _Region([])
            graph.erase_node(node)
        elif node.op in ("call_function", "call_method", "call_module"):
            current.nodes.append(node)
    if depth > 0:  # its end is in a later stage: the region ends with this stage
        regions.append(current)
    regions = [region for region in regions if region.nodes]
    for index, region in enumerate(regions):
        _outline(graph, roots, region, f"checkpointed_{index}")
    return len(regions)


def register_region_modules(module: fx.GraphModule) -> None:
    """The modules a stage's regions call (fx's leaf modules), registered on the stage as well: their
    parameters are the stage's."""
    for value in list(vars(module).values()):
        if isinstance(value, CheckpointedRegion):
            for node in value.module.graph.nodes:
                if node.op == "call_module":
                    try:
                        module.get_submodule(str(node.target))
                    except AttributeError:
                        module.add_submodule(str(node.target), value.module.get_submodule(str(node.target)))


def _outline(graph: fx.Graph, roots: dict[str, Any], found: _Region, name: str) -> None:
    nodes = found.nodes
    inside = set(nodes)
    inputs = list(dict.fromkeys(arg for node in nodes for arg in node.all_input_nodes if arg not in inside))
    outputs = [node for node in nodes if any(user not in inside for user in node.users)]
    region = fx.Graph()
    env: dict[fx.Node, fx.Node] = {arg: region.placeholder(f"in_{i}") for i, arg in enumerate(inputs)}
    for node in nodes:
        env[node] = region.node_copy(node, env.__getitem__)
    region.output(tuple(env[node] for node in outputs))
    modules = {str(node.target): roots[str(node.target)] for node in nodes if node.op == "call_module"}
    reentrant = None if found.reentrant is None else tuple(
        inputs.index(arg) for arg in found.reentrant if arg in inputs)
    roots[name] = CheckpointedRegion(fx.GraphModule(modules, region, class_name="Checkpointed"),
                                     found.preserve_rng_state, reentrant)
    with graph.inserting_after(nodes[-1]):  # after every input; every user outside the region comes later
        attr = graph.get_attr(name)
    with graph.inserting_after(attr):
        call = graph.call_function(run_checkpointed, (attr, *inputs))
    last = call
    for i, node in enumerate(outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, i))
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        graph.erase_node(node)


def reentrant_regions(module: fx.GraphModule) -> int:
    """How many of a stage's checkpointed regions the model checkpointed with ``use_reentrant=True``."""
    return sum(1 for value in vars(module).values()
               if isinstance(value, CheckpointedRegion) and value.reentrant is not None)


def regions_of(module: fx.GraphModule) -> list[CheckpointedRegion]:
    """A stage's checkpointed regions, in the order the stage calls them."""
    return [value for value in vars(module).values() if isinstance(value, CheckpointedRegion)]


def stage_nodes(module: fx.GraphModule) -> list[fx.Node]:
    """A stage's nodes and, where it calls a checkpointed region, the region's: what the stage computes,
    for whoever reads its graph (which modules it calls, which dtypes it names)."""
    nodes = []
    for node in module.graph.nodes:
        nodes.append(node)
        if node.op == "call_function" and node.target is run_checkpointed:
            region = getattr(module, str(node.args[0].target))
            nodes.extend(region.module.graph.nodes)
    return nodes
