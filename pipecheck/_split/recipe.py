"""A split as the driver made it, sent to the ranks so that none of them traces the model again.

    recipe = pipe.recipe                     # made by pc.split: the traced graph, cuts placed, no metadata
    data = recipe.dumps()                    # bytes, or None where something in the graph does not pickle
    recipe = SplitRecipe.load(data, device)  # on a rank; None where it names another device
    pipe = split_along(model, recipe, args, kwargs)   # pipecheck._split.pipe: cut as the driver's was

The recipe holds the traced graph's nodes (op, name, target, arguments), the
names of its inputs, how to bind a call's arguments to them, and the graph's
constants that are not the model's own parameters, buffers or submodules
(a model's own attribute is read off the model it cuts, where it has one).
A rank builds its model from the job's seeded factory and partitions it with
the driver's graph: the same stages, edges and names, with no trace. A graph
that names a device other than the rank's (``aten.arange(..., device=cpu)``
traced on the driver, ranks on CUDA) is traced again on the rank instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.autograd_functions import function_call
from pipecheck._split.inputs import bind_signature
from pipecheck._split.traced import try_resolve
from pipecheck.errors import InputError

NodeRow = tuple[str, str, Any, Any, Any]  # op, name, target, args, kwargs (nodes as _Ref)


@dataclass(frozen=True)
class _Ref:
    """An earlier node of the graph, by its position."""

    index: int


@dataclass(frozen=True)
class ExportBinding:
    """Binds a call's arguments to an exported graph's inputs: the same structure as traced, flattened."""

    names: tuple[str, ...]
    in_spec: pytree.TreeSpec

    def for_call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExportBinding:
        return self  # nothing in it comes from the call

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bind_signature(model, args, kwargs)
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise InputError(
                "inputs have a different structure from the ones the model was exported with. "
                "Fix: pass the same positional args and kwargs as to pc.split."
            )
        return dict(zip(self.names, leaves))


@dataclass(frozen=True)
class SplitRecipe:
    """The driver's traced graph (cuts placed), small and without node metadata; see the module doc."""

    tracer: str
    nodes: tuple[NodeRow, ...]
    input_names: tuple[str, ...]
    binding: Any  # (model, args, kwargs) -> {input name: value}: ExportBinding, or trace_fx's FxBinding
    out_spec: pytree.TreeSpec | None
    constants: Mapping[str, Any]  # get_attr targets that are not the model's: their values
    devices: frozenset[torch.device]  # every device the graph names, in arguments or constants
    wrapped: frozenset[int] = frozenset()  # nodes calling a torch.fx.wrap'ed function (the one metadata codegen reads)

    @staticmethod
    def of(graph: fx.Graph, model: nn.Module, attrs: Mapping[str, Any], *, tracer: str,
           input_names: tuple[str, ...], binding: Any, out_spec: pytree.TreeSpec | None) -> SplitRecipe:
        index = {node: i for i, node in enumerate(graph.nodes)}

        def ref(node: fx.Node) -> Any:
            return _Ref(index[node])

        rows = tuple((node.op, node.name, node.target, fx.node.map_arg(node.args, ref),
                      fx.node.map_arg(node.kwargs, ref)) for node in graph.nodes)
        own = _owned_names(model)
        constants = {target: value for target, value in attrs.items() if target not in own}
        devices = _devices_in([(row[3], row[4]) for row in rows], constants)
        wrapped = frozenset(i for i, node in enumerate(graph.nodes) if node.meta.get("is_wrapped"))
        return SplitRecipe(tracer, rows, input_names, binding, out_spec, constants, frozenset(devices), wrapped)

    def fits(self, device: torch.device) -> bool:
        """Whether a model built on ``device`` can run this graph as it is (it names no other device)."""
        return fits(self.devices, device)

    def without_constants(self, targets: set[str]) -> SplitRecipe:
        """This recipe without the constants ``targets`` (a split along it reads them off its model)."""
        kept = {target: value for target, value in self.constants.items() if target not in targets}
        return dataclasses.replace(self, constants=kept)

    def graph(self) -> fx.Graph:
        graph = fx.Graph()
        made: list[fx.Node] = []

        def node(ref: Any) -> Any:
            return made[ref.index] if isinstance(ref, _Ref) else ref

        for i, (op, name, target, args, kwargs) in enumerate(self.nodes):
            new = graph.create_node(op, target, _refs_to_nodes(args, node), _refs_to_nodes(kwargs, node), name=name)
            if new.name != name:  # fx renames only on a clash, which a graph it made itself never has
                raise RuntimeError(f"pipecheck: the split's node {name!r} came back as {new.name!r}")
            if i in self.wrapped:  # the stage's code then says torch.fx.wrap(...) as the driver's does
                new.meta["is_wrapped"] = True
            made.append(new)
        return graph

    def attrs(self, model: nn.Module) -> dict[str, Any] | None:
        """What each ``get_attr``/``call_module`` target names: the model's own where it has one (as the
        tracers resolve them), else the constant the recipe carries; None where one is neither."""
        found: dict[str, Any] = {}
        for op, _name, target, _args, _kwargs in self.nodes:
            if op in ("get_attr", "call_module"):
                own = try_resolve(model, target)
                if own is None and target not in self.constants:
                    return None
                found[target] = own if own is not None else self.constants[target]
        return found

    def dumps(self) -> bytes | None:
        """The recipe as bytes, or None where the graph holds something that does not pickle (the ranks
        then trace the model themselves, as the driver did). The devices it names come first, so that a
        rank reads the rest only where it can use it."""
        buffer = io.BytesIO()
        try:
            _Pickler(buffer).dump(self)
        except Exception:  # any object in a user's graph; tracing on the rank is always correct
            return None
        return pickle.dumps((self.devices, buffer.getvalue()))

    @staticmethod
    def load(data: bytes, device: torch.device) -> SplitRecipe | None:
        """The recipe ``dumps`` made, for a model on ``device``; None where its graph names another device,
        or where it cannot be read here (an operator registered only once the model's own code ran)."""
        devices, payload = pickle.loads(data)
        if not fits(devices, device):
            return None
        try:
            recipe = pickle.loads(payload)
        except Exception:  # e.g. torch.ops.<library>.<op> before the library is imported: trace instead
            return None
        return recipe if isinstance(recipe, SplitRecipe) else None


def same_graph(a: SplitRecipe, b: SplitRecipe) -> bool | None:
    """Whether two recipes alive side by side hold the same graph, binding and outputs (not their constants),
    each function, class and operator in them compared as the object it is, so that nothing needs to pickle
    by name; None where something in them does not pickle even so (nobody knows)."""
    try:
        mine, theirs = (_identities(dataclasses.replace(recipe, constants={})) for recipe in (a, b))
    except Exception:
        return None
    return mine == theirs


def _identities(recipe: SplitRecipe) -> bytes:
    buffer = io.BytesIO()
    _ByIdentity(buffer).dump(recipe)
    return buffer.getvalue()


class _ByIdentity(pickle.Pickler):
    """pickle for a comparison in one process: a function, class or operator is its id (both recipes hold it
    alive while they are compared), so a local autograd.Function or an operator pickle cannot name compares."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                            torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
            return id(obj)
        return None


def fits(devices: frozenset[torch.device], device: torch.device) -> bool:
    return all(_same_device(named, device) for named in devices)


def _devices_in(arguments: list[Any], constants: Mapping[str, Any]) -> set[torch.device]:
    """Every device named in ``arguments`` (a ``torch.device``, or a string naming one: autocast's
    ``"cpu"``) and in ``constants`` (a tensor's own; a subgraph's, such as export's ``no_grad`` and
    autocast blocks, looked into)."""
    found: set[torch.device] = set()
    for leaf in pytree.tree_leaves(arguments):
        if isinstance(leaf, torch.device):
            found.add(leaf)
        elif isinstance(leaf, str) and leaf.split(":")[0] in _DEVICE_TYPES:
            with contextlib.suppress(RuntimeError):
                found.add(torch.device(leaf))
    for value in constants.values():
        if isinstance(value, torch.Tensor):
            found.add(value.device)
        elif isinstance(value, fx.GraphModule):
            found |= _devices_in([(node.args, node.kwargs) for node in value.graph.nodes],
                                 {**dict(value.named_parameters()), **dict(value.named_buffers()),
                                  **{name: m for name, m in value.named_children() if isinstance(m, fx.GraphModule)}})
        elif isinstance(value, nn.Module):
            found |= {t.device for t in (*value.parameters(), *value.buffers())}
    return found


_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "meta", "hpu", "mtia", "xla", "privateuseone")


def _refs_to_nodes(value: Any, node: Any) -> Any:
    """``value`` with each ``_Ref`` replaced by its node (fx's immutable containers rebuilt as fx builds them)."""
    if isinstance(value, _Ref):
        return node(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_refs_to_nodes(v, node) for v in value)
    if isinstance(value, tuple):  # a NamedTuple
        return type(value)(*(_refs_to_nodes(v, node) for v in value))
    if isinstance(value, list):
        return [_refs_to_nodes(v, node) for v in value]
    if isinstance(value, dict):
        return {k: _refs_to_nodes(v, node) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_refs_to_nodes(value.start, node), _refs_to_nodes(value.stop, node),
                     _refs_to_nodes(value.step, node))
    return value


def _owned_names(model: nn.Module) -> set[str]:
    """Every name the model itself gives a submodule, parameter or buffer (tied names too)."""
    names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    names |= {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    return names


def _same_device(named: torch.device, device: torch.device) -> bool:
    if named.type != device.type:
        return False
    return named.index is None or device.index is None or named.index == device.index


def _op_overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _op_packet(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _leaf_spec() -> pytree.TreeSpec:
    return pytree.tree_flatten(0)[1]


class _Pickler(pickle.Pickler):
    """pickle, with torch's operators by name (an ``OpOverload`` holds pybind objects that do not pickle), a
    custom autograd.Function's call by its class (pipecheck._split.autograd_functions), and a pytree leaf as
    torch's own (unpickling a ``LeafSpec`` makes a new one, which torch 2.10 warns of)."""

    def reducer_override(self, obj: Any) -> Any:
        function = getattr(obj, "autograd_function", None)
        if isinstance(function, type) and function_call(function) is obj:
            return function_call, (function,)
        if isinstance(obj, torch._ops.OpOverload):
            return _op_overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, _, name = obj._qualified_op_name.partition("::")
            return _op_packet, (namespace, name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, pytree.TreeSpec) and obj.is_leaf():
            return _leaf_spec, ()
        return NotImplemented

