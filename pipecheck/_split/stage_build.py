"""A rank's own stages, built alone: the model's structure on the meta device, cut along the driver's
graph, and only the stages the rank runs made real, holding the driver's values.

    path = write_stage_state(pipe, folder)     # the driver, once a job: every stage's tensors, one file
    pipe = split_own_stages(device, factory, recipe, args, kwargs, stages=frozenset({0, 2}), state=path)
    # None where it cannot be done safely: the rank then builds the whole model, as it always did

A rank of a distributed check used to build the whole model from the factory, then keep its stages:
with 4 ranks on one machine, 4 whole models beside the driver's. Here the factory runs under
``torch.device("meta")`` (under its seed: it draws nothing, and the caller's RNG is put back as
before), the model is cut along the driver's recipe (no trace), and every parameter, buffer and
tensor attribute of the rank's own stages is replaced by a tensor on the rank's device holding the
driver's value, read from the file the driver wrote (``torch.load(mmap=True)``: a rank reads only the
pages of its own tensors). The other stages stay on meta: they hold no memory. One meta tensor gives
one real tensor, wherever the rank's stages hold it: a parameter tied between two of its stages stays
one tensor, as in a whole build; ties across ranks stay one tensor a rank.

The values are the driver's split's, not the factory's: the same weights on every rank as the
driver's eager model, even for a factory whose weights are not reproducible from process to process.

Nothing is guessed: where the factory is a user's module (deep-copied, as before), raises under meta,
builds a lazy module, where the driver's file lacks a tensor or holds one of another shape, dtype or
tying, or where anything the rank's stages read is still on meta afterwards (a tensor in a list
attribute, a module a graph node calls as a bound method), the answer is None and the caller builds
the whole model.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import Pipe, split_along
from pipecheck._split.recipe import SplitRecipe

STATE_PREFIX = "stage-state-"  # then a random name: one file a job, in the World's folder

# Where a module holds a tensor: a parameter, a buffer (persistent or not), or a plain attribute.
Place = tuple[nn.Module, str, str]  # (module, "_parameters" | "_buffers" | "__dict__", name)


def held_tensors(module: nn.Module) -> Iterator[tuple[str, Place, torch.Tensor]]:
    """Every tensor ``module`` and its submodules hold, by a name that is the same for the same model cut
    the same way in any process (``blocks.0.attn.in_proj_weight``): a tensor reachable two ways comes
    twice, under both names."""
    for path, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for kind, found in (("_parameters", sub._parameters), ("_buffers", sub._buffers), ("__dict__", vars(sub))):
            for name, value in found.items():
                if isinstance(value, torch.Tensor):
                    yield f"{prefix}{name}", (sub, kind, name), value


def stage_state(pipe: Pipe) -> dict[str, torch.Tensor] | None:
    """Every stage's tensors as the driver holds them, keyed ``"<stage>:<name>"`` (detached: a tensor two
    stages hold is one storage, saved once); None where one is not a plain strided tensor (a subclass,
    sparse, quantized), which ``torch.load(weights_only=True)`` may refuse."""
    state: dict[str, torch.Tensor] = {}
    for stage in pipe.stages:
        for name, _place, value in held_tensors(stage.module):
            if type(value) not in (torch.Tensor, nn.Parameter) or value.layout != torch.strided or value.is_meta:
                return None
            state[f"{stage.index}:{name}"] = value.detach()
    return state


def write_stage_state(pipe: Pipe, folder: str) -> str | None:
    """Write :func:`stage_state` of ``pipe`` to a new file in ``folder``; its path, or None where there is
    nothing to write safely. The caller removes the file once the ranks are done with it."""
    state = stage_state(pipe)
    if state is None:
        return None
    path = os.path.join(folder, f"{STATE_PREFIX}{uuid.uuid4().hex}.pt")
    try:
        torch.save(state, path)
    except (OSError, RuntimeError):  # a full disk (torch's zip writer raises RuntimeError): built whole, as before
        remove_stage_state(path)
        return None
    except BaseException:
        remove_stage_state(path)
        raise
    return path


def remove_stage_state(path: str | None) -> None:
    """Remove the driver's file (gone already where its World stopped: its folder went with it)."""
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def builds_alone(factory: Any) -> bool:
    """Whether a rank may build only its own stages of ``factory``'s model: a factory that makes it (a
    user's module is deep-copied whole, as it always was)."""
    return isinstance(factory, ModelFactory) and not isinstance(factory.source, nn.Module)


def split_own_stages(device: torch.device, factory: Any, recipe: bytes, args: Sequence[Any],
                     kwargs: Mapping[str, Any] | None, stages: frozenset[int], state: str) -> Pipe | None:
    """The driver's split of ``factory``'s model, cut along ``recipe``, with only ``stages`` real, on
    ``device``, holding the values in the driver's file ``state``; None where that cannot be done safely
    (see the module's docstring): build the whole model instead."""
    if not builds_alone(factory):
        return None
    try:
        with torch.device("meta"):
            skeleton = factory.on("meta")()
    except Exception:  # a factory that computes with its tensors' values (.item(), numpy): built whole
        return None
    if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in skeleton.modules()):
        return None
    try:
        plan = SplitRecipe.load(recipe, torch.device(device))
        pipe = split_along(skeleton, plan, args, kwargs) if plan is not None else None
    except Exception:
        return None
    if pipe is None:
        return None
    try:
        values = torch.load(state, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return None
    if not isinstance(values, dict) or not _materialise(pipe, stages, values, torch.device(device)):
        return None
    return pipe


def _materialise(pipe: Pipe, stages: frozenset[int], values: Mapping[str, Any], device: torch.device) -> bool:
    """Put the driver's ``values`` in place of every meta tensor ``stages`` hold; False (nothing usable)
    where one is missing or differs in shape, dtype or tying, or something they read stays on meta."""
    places: list[tuple[Place, torch.Tensor, torch.Tensor]] = []  # where, the meta tensor, the driver's value
    source: dict[int, tuple[int, int]] = {}  # meta tensor -> the driver's (storage, offset) behind it
    for s in sorted(stages):
        for name, place, meta in held_tensors(pipe.stages[s].module):
            if not meta.is_meta:
                continue  # a constant the recipe carried, real already
            value = values.get(f"{s}:{name}")
            if (not isinstance(value, torch.Tensor) or value.shape != meta.shape or value.dtype != meta.dtype
                    or type(meta) not in (torch.Tensor, nn.Parameter)):
                return False
            where = (value.untyped_storage().data_ptr(), int(value.storage_offset())) if value.numel() else (-id(meta), 0)
            if source.setdefault(id(meta), where) != where:
                return False  # tied on this rank, not on the driver
            places.append((place, meta, value))
    storages = [ptr for ptr, _ in source.values() if ptr >= 0]
    if len(set(storages)) != len(storages):
        return False  # tied (or views of one tensor) on the driver, not here
    made: dict[int, torch.Tensor] = {}
    for (module, kind, name), meta, value in places:
        real = made.get(id(meta))
        if real is None:
            real = made[id(meta)] = _real(meta, value, device)
        if kind == "__dict__":
            module.__dict__[name] = real
        else:  # as the module's own code assigns it: an RNN refreshes its list of flat weights
            setattr(module, name, real)
    return not any(_reads_meta(pipe.stages[s].module) for s in stages)


def _real(meta: torch.Tensor, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The rank's own copy of the driver's ``value`` on ``device`` (never the file's pages), as ``meta``
    was: a Parameter with its ``requires_grad`` and any attributes set on it."""
    data = value.to(device=device, copy=True)
    if isinstance(meta, nn.Parameter):
        param = nn.Parameter(data, requires_grad=meta.requires_grad)
        param.__dict__.update(vars(meta))
        return param
    return data.requires_grad_(meta.requires_grad)


def _reads_meta(stage: nn.Module) -> bool:
    """Whether anything the stage reads is still on meta: a tensor its modules hold in a container
    (a list, a dict), or one of a module a graph node calls or passes without it being a submodule."""
    modules = {id(m): m for m in stage.modules()}
    own = len(modules)
    for module in list(modules.values())[:own]:
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                for found in (getattr(node.target, "__self__", None), *pytree.tree_leaves((node.args, node.kwargs))):
                    if isinstance(found, nn.Module):
                        modules.setdefault(id(found), found)
    for i, module in enumerate(modules.values()):
        if i >= own and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            return True  # outside the stage: its tensors were not replaced
        held = [value for key, value in vars(module).items() if key != "_modules"]
        if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in pytree.tree_leaves(held)):
            return True
    return False
