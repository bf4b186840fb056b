"""What a model returns that a pipeline has no reason to compare: HuggingFace's generation caches.

    model = caches_left_out(model)   # pipecheck's own copy, as built; the same module, another class
    left_out_notes(model)            # after a call: one line for each output left out, and why

A HuggingFace model called as users call it (``use_cache`` at its default, True) returns a
``transformers`` ``Cache`` (a ``DynamicCache``, an ``EncoderDecoderCache``, ...) beside its logits:
an object torch's pytree does not know, that no tracer can describe, and that holds each layer's
keys and values, which feed the attention outputs the check compares anyway. Such a cache is left
out of the model's outputs (it becomes ``None``) in every process that runs the model: the eager
model, the float64 truth and every runner's stages trace and run the same adapted forward, so they
agree on the outputs. The loss cannot read it, and no stage hands it on: a later layer that reads
an earlier layer's cache inside the same forward still does, through the graph's values.

Only pipecheck's own copy is adapted, by giving it a subclass of its class (same name) whose
``forward`` is the model's with the caches replaced; the user's module and class are untouched.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch.nn as nn
import torch.utils._pytree as pytree

_ADAPTED: dict[type, type] = {}


def _cache_class() -> type | None:
    """transformers' ``Cache`` base class, if transformers is imported (a model of it is then in use)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return getattr(cache_utils, "Cache", None)


def _hf_model_class() -> type | None:
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling_utils, "PreTrainedModel", None)


def caches_left_out(model: nn.Module) -> nn.Module:
    """``model`` (pipecheck's own) whose forward returns ``None`` where it returned a generation cache;
    any other model as it is."""
    hf_model = _hf_model_class()
    if hf_model is None or not isinstance(model, hf_model) or getattr(type(model), "_pipecheck_caches_out", False):
        return model
    model.__class__ = _adapted(type(model))
    return model


def left_out_notes(model: nn.Module) -> list[str]:
    """One note per output that :func:`caches_left_out` left out of ``model``'s outputs so far."""
    left = getattr(type(model), "_pipecheck_left_out", {})
    return [f"output{path} ({name}, the generation cache that use_cache=True builds) is left out of the "
            "comparison: the loss cannot read it and no stage hands it on; the keys and values it holds feed "
            "the attention outputs, which are compared. Fix, to leave it unbuilt: use_cache=False in the model's "
            "config or call." for path, name in sorted(left.items())]


def _adapted(cls: type) -> type:
    if cls not in _ADAPTED:
        original = cls.forward  # type: ignore[attr-defined]
        left_out: dict[str, str] = {}

        @functools.wraps(original)  # __wrapped__: tracers and binding see the model's own signature
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _without_caches(original(self, *args, **kwargs), left_out)

        _ADAPTED[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_pipecheck_caches_out": True, "_pipecheck_left_out": left_out
        })
    return _ADAPTED[cls]


def _without_caches(outputs: Any, left_out: dict[str, str]) -> Any:
    cache = _cache_class()
    if cache is None:
        return outputs
    paths, spec = pytree.tree_flatten_with_path(outputs, is_leaf=lambda value: isinstance(value, cache))
    if not any(isinstance(leaf, cache) for _, leaf in paths):
        return outputs
    leaves = []
    for path, leaf in paths:
        if isinstance(leaf, cache):
            left_out[pytree.keystr(path)] = type(leaf).__name__
            leaf = None
        leaves.append(leaf)
    return pytree.tree_unflatten(leaves, spec)

