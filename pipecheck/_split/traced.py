"""What a tracer hands the splitter, and what every tracer shares.

    traced = trace(model, args, kwargs, split_spec, tracer)   # see pipecheck._split.trace
    traced.graph          # placeholders, get_attr, compute nodes, pipe_split markers, output
    traced.input_names    # model inputs that are graph placeholders, in order
    traced.binding(model, args, kwargs) -> {input name: value}
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.markers import SplitPoint
from pipecheck._split.microbatch import unwrap_replicated
from pipecheck.errors import SplitError, TraceError

SplitSpec = Mapping[str, "SplitPoint | str"]


@dataclass
class Traced:
    """A traced model: one graph, the objects its ``get_attr`` targets name, and its I/O layout."""

    graph: fx.Graph
    attrs: dict[str, Any]  # get_attr / call_module target -> object (from the model copy)
    input_names: tuple[str, ...]
    binding: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], dict[str, Any]]  # picklable, no model held
    tracer: str
    out_spec: pytree.TreeSpec | None = None  # export: the graph returns flat leaves in this structure


def normalize_split_spec(model: nn.Module, split_spec: SplitSpec) -> dict[str, SplitPoint]:
    """Check every FQN names a submodule and every point is a SplitPoint; report all problems."""
    modules = dict(model.named_modules())
    problems: list[str] = []
    spec: dict[str, SplitPoint] = {}
    if not isinstance(split_spec, Mapping):
        raise SplitError(
            f"split_spec must be a dict of module FQN -> SplitPoint, got a {type(split_spec).__name__}: "
            f"{split_spec!r}.\nFix: e.g. split_spec={{{_example_fqn(modules)!r}: pc.SplitPoint.BEGINNING}} (FQNs as "
            "printed by model.named_modules())."
        )
    for fqn, point in split_spec.items():
        if not isinstance(fqn, str):
            named = [m for m in modules if m.rsplit(".", 1)[-1] == str(fqn)]
            hint = f" Did you mean {', '.join(repr(m) for m in named[:3])}?" if named else ""
            problems.append(f"  key {fqn!r} ({type(fqn).__name__}) is not a module FQN: keys are strings.{hint}")
            continue
        if fqn not in modules or fqn == "":
            close = difflib.get_close_matches(fqn, [m for m in modules if m], n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            problems.append(f"  {fqn!r} is not a submodule of {type(model).__name__}.{hint}")
            continue
        try:
            spec[fqn] = point if isinstance(point, SplitPoint) else SplitPoint(str(point).upper())
        except ValueError:
            problems.append(f"  {fqn!r}: split point {point!r} is not SplitPoint.BEGINNING or SplitPoint.END")
    if problems:
        raise SplitError(
            "split_spec has problems:\n" + "\n".join(problems)
            + "\nFix: use module FQNs as printed by model.named_modules(), mapped to SplitPoint.BEGINNING/END."
        )
    return spec


def _example_fqn(modules: Mapping[str, nn.Module]) -> str:
    """A submodule's FQN to show in an example: the last one named, or a made-up one for a leaf model."""
    names = [m for m in modules if m]
    return names[-1] if names else "layers.1"


def has_tensor(value: Any) -> bool:
    """Whether ``value`` holds a tensor anywhere (a ``pc.Replicated`` one included)."""
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(unwrap_replicated(value)))


def unused_spec(split_spec: dict[str, SplitPoint], called: set[str], tracer: str) -> None:
    unused = [fqn for fqn in split_spec if fqn not in called]
    if unused:
        raise SplitError(
            f"split_spec names modules that forward never calls: {unused}. "
            f"Fix: cut at a module that runs in forward (seen by the {tracer!r} tracer)."
        )


def resolve(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def try_resolve(root: nn.Module, target: str) -> Any:
    try:
        return resolve(root, target)
    except AttributeError:
        return None


def unknown_output_error(model: nn.Module, classes: list[str]) -> SplitError:
    """The refusal of a ``forward`` that returns objects torch's pytree cannot flatten."""
    return SplitError(
        f"{type(model).__name__}.forward returns an object of class {', '.join(classes)}, which torch.utils._pytree "
        "does not know, so no tracer can describe the outputs a stage must hand on (nor can they be split into "
        "micro-batches and compared). Fix: return a tuple, dict or NamedTuple of tensors, or register the class: "
        "torch.utils._pytree.register_dataclass for a dataclass, torch.utils._pytree.register_pytree_node "
        "otherwise (flatten to its tensors, unflatten back)."
    )


@contextlib.contextmanager
def state_kept(model: nn.Module, drop: type | None = None) -> Iterator[list[str]]:
    """Trace ``model``, put back every parameter, buffer and attribute forward assigned or
    registered, and list the parameters and buffers among them (``"fqn.name"``).

    A tracer runs ``forward`` on stand-ins (fx Proxies, export's fake tensors): ``self.buf += x``
    or a buffer registered on the first call would leave one in the module, whose next eager call
    then fails or stops updating the buffer. New plain attributes of class ``drop`` (fx's Proxies)
    are removed; others (fx's ``_tensor_constant0``) stay: the graph reads them.
    """
    saved = [(name, module, dict(module.__dict__), {key: dict(module.__dict__[key]) for key in _STATE})
             for name, module in model.named_modules()]
    assigned: list[str] = []
    try:
        yield assigned
    finally:
        for name, module, attributes, registries in saved:
            for key, entries in registries.items():
                registry = module.__dict__[key]
                assigned += [f"{name}.{attr}" if name else attr for attr, value in registry.items()
                             if entries.get(attr, _MISSING) is not value]
                registry.clear()
                registry.update(entries)
            for attr, value in list(module.__dict__.items()):
                if attr in attributes and attributes[attr] is not value:
                    module.__dict__[attr] = attributes[attr]
                elif attr not in attributes and drop is not None and isinstance(value, drop):
                    del module.__dict__[attr]


_MISSING = object()
_STATE = ("_parameters", "_buffers")


def state_assigned_error(tracer: str, model: nn.Module, assigned: list[str], other_way: str) -> TraceError:
    """The refusal of a trace during which forward assigned or registered parameters or buffers."""
    names = ", ".join(f"self.{name}" for name in sorted(set(assigned)))
    return TraceError(
        f"{tracer} could not trace {type(model).__name__}: forward assigns or registers {names} while it runs "
        "(`self.buf = ...`, `self.buf += x`, or a buffer registered on the first call), and a graph cannot record "
        "that. Fix: register every buffer in __init__ and update it in place (self.buf.add_(x))"
        + (f"; or {other_way}." if other_way else ".")
    )
