"""Which random ops a split's stages run, and a check's training switched to pipecheck's randomness contract.

    training = with_randomness(training, pipe, run, runner_name, seed)   # InputError if the runner cannot follow

A stage's random ops are read from its graph (a checkpointed region's too): dropout modules in train
mode, functional dropout with ``training=True``, ``scaled_dot_product_attention`` with a
``dropout_p`` above 0, and every op torch tags as drawing from a seeded generator (``torch.rand``,
``bernoulli``, stochastic depth's ``bernoulli_``). Randomness the graph does not show (a leaf module that
draws inside) is still caught by the determinism probe before anything is compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from pipecheck._core.training import Training
from pipecheck._split.checkpoints import CheckpointedRegion, run_checkpointed
from pipecheck._split.model_factory import is_default_generator
from pipecheck._split.pipe import Pipe
from pipecheck.errors import InputError

_TORCH_DROPOUT = {torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout}
_FUNCTIONAL_DROPOUT = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                       *_TORCH_DROPOUT}
_ATEN_DROPOUT = ("aten::dropout", "aten::feature_dropout", "aten::alpha_dropout", "aten::feature_alpha_dropout")
_RANDOM_FUNCTIONS = {torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
                     torch.randperm, torch.bernoulli, torch.normal, torch.multinomial, torch.poisson}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "log_normal_", "cauchy_", "multinomial"}


def _nodes(module: fx.GraphModule) -> Iterator[tuple[nn.Module, fx.Node]]:
    """(the module a node's targets resolve in, the node): a stage's and its checkpointed regions'."""
    for node in module.graph.nodes:
        yield module, node
        if node.op == "call_function" and node.target is run_checkpointed:
            region = getattr(module, str(node.args[0].target))
            if isinstance(region, CheckpointedRegion):
                yield from _nodes(region.module)


def _inner_dropout(module: nn.Module) -> str:
    """What draws inside a module fx keeps whole (``nn.TransformerEncoderLayer``, ``nn.LSTM``), "" if nothing."""
    if not module.training:
        return ""
    for name, inner in module.named_modules():
        if isinstance(inner, nn.modules.dropout._DropoutNd) and inner.training and inner.p > 0:
            return f"its {name or 'own'} dropout"
        if isinstance(inner, nn.RNNBase) and inner.num_layers == 1:
            continue  # torch applies an RNN's dropout between its layers only
        if isinstance(getattr(inner, "dropout", None), float) and inner.dropout > 0:  # nn.RNN/LSTM/GRU, attention
            return f"dropout={inner.dropout} in {name or 'it'}"
    return ""


def _argument(node: fx.Node, position: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def _random(owner: nn.Module, node: fx.Node) -> str | None:
    """What random op ``node`` is (None: not one, or one drawing from a generator of the model's own, which
    the contract does not cover: the determinism probe refuses it)."""
    generator = node.kwargs.get("generator")
    if isinstance(generator, fx.Node) and generator.op == "get_attr":  # torch.export lifts it to an attribute
        generator = getattr(owner, str(generator.target), None)
    if generator is not None and not (isinstance(generator, torch.Generator) and is_default_generator(generator)):
        return None
    if node.op == "call_module":
        try:
            module = owner.get_submodule(str(node.target))
        except AttributeError:
            return None
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            return f"{node.target} ({type(module).__name__})"
        inner = _inner_dropout(module)
        return f"{node.target} ({type(module).__name__}, {inner})" if inner else None
    target = node.target
    if node.op == "call_method":
        return f".{target}() ({node.name})" if target in _RANDOM_METHODS else None
    if node.op != "call_function":
        return None
    if target in _FUNCTIONAL_DROPOUT:
        p, train = _argument(node, 1, "p", 0.5), _argument(node, 2, "train" if target in _TORCH_DROPOUT else "training",
                                                           True)
        return f"{getattr(target, '__name__', target)} ({node.name})" if p != 0 and train is not False else None
    if target is F.scaled_dot_product_attention:
        return f"scaled_dot_product_attention with dropout_p ({node.name})" \
            if _argument(node, 4, "dropout_p", 0.0) not in (0, 0.0) else None
    if target in _RANDOM_FUNCTIONS:
        return f"{getattr(target, '__name__', target)} ({node.name})"
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
        if name in _ATEN_DROPOUT:
            return f"{name} ({node.name})" if _argument(node, 1, "p", 0.5) != 0 and \
                _argument(node, 2, "train", True) is not False else None
        if name == "aten::scaled_dot_product_attention":
            return f"{name} with dropout_p ({node.name})" \
                if _argument(node, 4, "dropout_p", 0.0) not in (0, 0.0) else None
        if torch.Tag.nondeterministic_seeded in target.tags:
            return f"{name} ({node.name})"
    elif getattr(target, "__name__", "") == "stochastic_depth":  # torchvision's, kept whole by fx
        drops = _argument(node, 1, "p", 0.5) not in (0, 0.0) and _argument(node, 3, "training", True) is not False
        return f"stochastic_depth ({node.name})" if drops else None
    return None


def random_ops(pipe: Pipe) -> list[str]:
    """``stage s: what`` for every random op the split's stages run, in stage order."""
    return [f"stage {stage.index}: {what}" for stage in pipe.stages for owner, node in _nodes(stage.module)
            for what in [_random(owner, node)] if what is not None]


def with_randomness(training: Training, pipe: Pipe, run: Any, runner_name: str, seed: int) -> Training:
    """``training`` with the model's random ops drawn by pipecheck's randomness contract, or an InputError
    saying why it cannot be (before any eager work); ``training`` itself when the model draws nothing."""
    found = random_ops(pipe)
    if not found:
        return training
    named = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if not getattr(run, "follows_random_contract", False):
        raise InputError(
            f"{pipe.model_name} draws random numbers in train mode ({named}), and runner {runner_name!r} does not say "
            "it follows pipecheck's randomness contract, so no check can line its draws up with eager's. Fix: "
            "runner='reference', 'distributed' or 'torch' (they follow it), or make the engine draw each stage's forward "
            "inside pc.randomness.drawing(job.random_seed, stage=..., microbatch=...) and set its attribute "
            "follows_random_contract = True (docs/randomness.md). model.eval() checks the deterministic model "
            "only: it leaves the engine's handling of randomness (recompute, masks per micro-batch) unchecked.")
    return dataclasses.replace(training, dropout=tuple(found), random_seed=seed)
