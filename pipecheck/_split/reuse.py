"""Later checks of the same model reuse its trace: a split is cut along the recipe of an earlier one.

    pipe = split_reusing(factory, built, args, kwargs, split_spec=..., policy=..., tracer="auto")

Tracing is most of a split (torch.export takes 1-2 s on a tiny HuggingFace model). A check whose
model factory, model structure, inputs, cut and tracer are all those of an earlier check in this
process cuts its freshly built model along that check's graph instead of tracing it again. The key
holds: the factory's callable, pickled (a function by its name, a ``functools.partial`` with its
arguments), its dtype, device and seed; every submodule's name, class and ``training`` flag; every
parameter's and buffer's name, shape, dtype, device and ``requires_grad``, and which of them are
one tensor; every module's class and forward (the objects: a patched forward is another key); the
inputs' structure, with each tensor's shape, dtype, device and ``requires_grad``
and every other value itself; the split_spec, the policy and the tracer. Where any of it does not
pickle (a lambda, a local class, a user's ``nn.Module`` given as the model, which may change
between checks), nothing is reused.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import Pipe, split_along, split_module
from pipecheck._split.recipe import SplitRecipe
from pipecheck.policies import Policy

Key = tuple[tuple[Any, ...], bytes]
_KEPT = 16  # the recipes of the last 16 distinct splits
_recipes: OrderedDict[Key, SplitRecipe] = OrderedDict()


def split_reusing(factory: ModelFactory, built: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None, *,
                  split_spec: Mapping[str, Any] | None, policy: Policy | None, tracer: str) -> Pipe:
    """``split_module(built, ...)``, cut along an earlier check's graph where everything it depends on is the same."""
    key = _key(factory, built, args, kwargs, split_spec, policy, tracer)
    recipe = _recipes.get(key) if key is not None else None
    if recipe is not None:
        _recipes.move_to_end(key)  # type: ignore[arg-type]
        return split_along(built, recipe)
    pipe = split_module(built, args, kwargs, split_spec=split_spec, policy=policy, tracer=tracer)
    if key is not None:
        _recipes[key] = pipe.recipe
        while len(_recipes) > _KEPT:
            _recipes.popitem(last=False)
    return pipe


def forget_splits() -> None:
    """Trace every model again from now on (the recipes kept so far are dropped)."""
    _recipes.clear()


def _key(factory: ModelFactory, built: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
         split_spec: Mapping[str, Any] | None, policy: Policy | None, tracer: str) -> Key | None:
    if isinstance(factory.source, nn.Module):
        return None
    first_name: dict[int, str] = {}
    tensors = []
    for kind, named in (("param", built.named_parameters(remove_duplicate=False)),
                        ("buffer", built.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            tensors.append((kind, name, first_name.setdefault(id(tensor), name), *_tensor_key(tensor)))
    modules = [(name, type(m).__module__, type(m).__qualname__, m.training)
               for name, m in built.named_modules(remove_duplicate=False)]
    # The classes and forwards themselves, held by the key: a forward patched or a class redefined is another key.
    code = tuple((type(m), type(m).forward, m.__dict__.get("forward")) for m in built.modules())
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    inputs = [_tensor_key(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    try:
        return code, pickle.dumps((factory.source, str(factory.dtype), str(factory.device), factory.seed, modules,
                                   tensors, str(spec), inputs, dict(split_spec or {}), policy, tracer))
    except Exception:  # a lambda, a local class, an argument that does not pickle: no reuse
        return None


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tuple(tensor.shape), str(tensor.dtype), str(tensor.device), tensor.requires_grad
