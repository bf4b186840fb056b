"""Later checks of the same model reuse its trace: a split is cut along the recipe of an earlier one.

    hit = []
    pipe = split_reusing(factory, built, args, kwargs, split_spec=..., policy=..., tracer="auto", hits=hit)
    if hit and hit[0].still_traced_the_same() is False: ...   # a failing check ran on a stale graph

Tracing is most of a split (torch.export takes 1-2 s on a tiny HuggingFace model). A check whose
model factory, model structure, inputs, cut and tracer are all those of an earlier check in this
process cuts its freshly built model along that check's graph instead of tracing it again. The key
holds: the factory's callable, pickled (a function by its name, a ``functools.partial`` with its
arguments), its dtype, device and seed; every submodule's name, class and ``training`` flag; every
parameter's and buffer's name, shape, dtype, device and ``requires_grad``, and which of them are
one tensor; every module's class and its class's forward (the objects: a patched forward is
another key); the inputs' structure, with each tensor's shape, dtype, device and ``requires_grad``
and every other value itself; the split_spec, the policy and the tracer. Where any of it does not
pickle (a lambda, a local class, a user's ``nn.Module`` given as the model, which may change
between checks), or a module has a forward of its own (a hook library's wrapper, which would keep
the model alive here), nothing is reused.

The key also holds what forward reads beyond the model's own tensors (pipecheck._split.code_reads:
the helper methods it calls and the globals they read), but it cannot see everything (a global dict
changed in place). The graph is all that is reused, and a stale graph can only make the pipeline
compute something eager does not: a check that fails on a reused split traces the model again, and
where the graph differs, ``assert_equivalent`` says so instead of blaming the pipeline. The runner
is never run again for it (and after a timeout the model is not even traced again).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._split.code_reads import code_reads
from pipecheck._split.model_factory import ModelFactory
from pipecheck._split.pipe import Pipe, split_along, split_module
from pipecheck._split.recipe import SplitRecipe, same_graph
from pipecheck._split.traced import try_resolve
from pipecheck.policies import Policy

Key = tuple[tuple[Any, ...], bytes]
_KEPT = 16  # the recipes of the last 16 distinct splits
_LARGE = 1 << 20  # bytes: a constant this large that the model holds itself is read off the next model
_recipes: OrderedDict[Key, SplitRecipe] = OrderedDict()


@dataclass
class Hit:
    """A split cut along an earlier trace, and how to make that trace again to see if it still holds."""

    key: Key
    recipe: SplitRecipe
    retrace: Callable[[], Pipe]
    looked: list[bool | None] = field(default_factory=list)  # what the one look found

    def still_traced_the_same(self) -> bool | None:
        """Whether tracing the model now gives the graph that was reused (None: it could not be traced
        again or compared, so nobody knows); one that changed is forgotten. Traced once: asked again, the
        same answer."""
        if not self.looked:
            try:
                same = _same_recipe(self.retrace().recipe, self.recipe)
            except Exception:  # out of memory, say: the check's verdict stands as it is
                same = None
            if same is not True:  # changed, or not comparable: the next check traces afresh
                _recipes.pop(self.key, None)
            self.looked.append(same)
        return self.looked[0]


def _same_recipe(fresh: SplitRecipe, kept: SplitRecipe) -> bool | None:
    """The same graph, binding and outputs (each function and class in them the same object: a custom
    autograd.Function's call too), and the same constants, tensors by value, where ``kept`` keeps them;
    None where the graphs cannot be compared (an object in them that does not even pickle by identity)."""
    if not set(kept.constants) <= set(fresh.constants):
        return False
    same = same_graph(fresh, kept)
    if not same:
        return same
    return all(_same_value(fresh.constants[target], value) for target, value in kept.constants.items())


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, fx.GraphModule) or isinstance(b, fx.GraphModule):  # a subgraph: its code and tensors
        if not (isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule) and a.code == b.code):
            return False
        mine, theirs = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
        return mine.keys() == theirs.keys() and all(_same_value(mine[k], theirs[k]) for k in mine)
    try:
        return pickle.dumps(a) == pickle.dumps(b)
    except Exception:
        return False


def split_reusing(factory: ModelFactory, built: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None, *,
                  split_spec: Mapping[str, Any] | None, policy: Policy | None, tracer: str,
                  hits: list[Hit] | None = None) -> Pipe:
    """``split_module(built, ...)``, cut along an earlier check's graph where everything it depends on is
    the same; such a reuse is appended to ``hits`` (None: never reuse)."""
    def trace(model: nn.Module) -> Pipe:
        return split_module(model, args, kwargs, split_spec=split_spec, policy=policy, tracer=tracer)

    key = _key(factory, built, args, kwargs, split_spec, policy, tracer) if hits is not None else None
    recipe = _recipes.get(key) if key is not None else None
    if key is not None and recipe is not None:
        pipe = split_along(built, recipe, args, kwargs)
        if pipe is not None:
            _recipes.move_to_end(key)
            hits.append(Hit(key, recipe, lambda: trace(factory())))  # type: ignore[union-attr]
            return pipe
    pipe = trace(built)
    if key is not None:
        large = {target for target, value in pipe.recipe.constants.items()
                 if isinstance(value, torch.Tensor) and value.nbytes >= _LARGE
                 and try_resolve(built, target) is value}  # not kept alive here: the next model has its own
        _recipes[key] = pipe.recipe.without_constants(large)
        while len(_recipes) > _KEPT:
            _recipes.popitem(last=False)
    return pipe


def forget_splits() -> None:
    """Trace every model again from now on (the recipes kept so far are dropped)."""
    _recipes.clear()


def _key(factory: ModelFactory, built: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
         split_spec: Mapping[str, Any] | None, policy: Policy | None, tracer: str) -> Key | None:
    if isinstance(factory.source, nn.Module) or any("forward" in m.__dict__ for m in built.modules()):
        return None
    first_name: dict[int, str] = {}
    tensors = []
    for kind, named in (("param", built.named_parameters(remove_duplicate=False)),
                        ("buffer", built.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            tensors.append((kind, name, first_name.setdefault(id(tensor), name), *_tensor_key(tensor)))
    modules = [(name, type(m).__module__, type(m).__qualname__, m.training)
               for name, m in built.named_modules(remove_duplicate=False)]
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    inputs = [_tensor_key(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    try:
        # The classes and their forwards themselves, held by the key: one patched or redefined is another key;
        # and what forward reads beyond them (helper methods, globals: pipecheck._split.code_reads).
        code = (*((type(m), type(m).forward) for m in built.modules()), code_reads(built))
        hash(code)
        return code, pickle.dumps((factory.source, str(factory.dtype), str(factory.device), factory.seed, modules,
                                   tensors, str(spec), inputs, dict(split_spec or {}), policy, tracer))
    except Exception:  # a lambda, a local class, an argument that does not pickle: no reuse
        return None


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tuple(tensor.shape), str(tensor.dtype), str(tensor.device), tensor.requires_grad
