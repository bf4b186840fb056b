"""The arguments of a check or a pipeline run, validated up front and in one place.

    check_arguments("assert_equivalent", model=model, args=args, n_microbatches=4, seed=0, ...)

Every problem is found before anything runs (no model is built, nothing is traced, no rank
starts) and all of them are reported together, each with its fix, as one :class:`InputError`:
a wrong type must not surface later as a bare ``TypeError`` from deep inside torch, nor, worse,
pass vacuously (``n_microbatches=True``, ``check_grads="no"``, an empty batch).
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from pipecheck._core.training import Batch, Training
from pipecheck._split.inputs import as_args
from pipecheck._split.microbatch import Replicated
from pipecheck.errors import InputError
from pipecheck.losses import check_loss_reduction

_UNSET: Any = object()


def _shown(value: Any) -> str:
    """``value`` as a message shows it: its repr if short, else its type (a tensor's repr is pages)."""
    text = repr(value)
    return text if len(text) <= 48 and "\n" not in text else f"<{type(value).__name__}>"


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _is_int(value: Any) -> bool:
    """An integer, numpy's included (what ``operator.index`` takes), but not a bool."""
    if _is_bool(value):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def plain(value: Any) -> Any:
    """A numpy scalar as the Python number it is (validated arguments travel on as Python's own)."""
    if _is_bool(value):
        return bool(value)
    if _is_int(value):
        return operator.index(value)
    if isinstance(value, numbers.Real) and not isinstance(value, float):
        return float(value)
    return value


def _positive_int(name: str, value: Any, problems: list[str], *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < 1:
        problems.append(f"{name}={_shown(value)} must be a positive int. Fix: pass e.g. {name}=2"
                        + (f", or leave it out ({name}=None)." if optional else "."))


def _required_parameters(fn: Callable[..., Any]) -> list[str]:
    """The parameters ``fn()`` would be missing (none where the signature cannot be read)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: let the call itself tell
        return []
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_model(model: Any, problems: list[str]) -> None:
    if isinstance(model, nn.Module):
        return
    if not callable(model):
        problems.append(f"model must be an nn.Module or a zero-argument factory returning one, got "
                        f"{type(model).__name__}. Fix: pass the module, or e.g. model=lambda: MyModel(d=64).")
        return
    needed = _required_parameters(model)
    if needed:
        name = getattr(model, "__name__", None) or repr(model)
        what = "a class whose constructor" if isinstance(model, type) else "a factory that"
        problems.append(f"model={name} is {what} needs {', '.join(needed)}: pipecheck builds the model by "
                        f"calling model() with no arguments. Fix: pass a built module (model={name}(...)) or a "
                        f"zero-argument factory (model=lambda: {name}(...)).")


def _foreign_leaves(value: Any, where: str) -> list[str]:
    """Values of a kind torch does not take as a tensor: numpy arrays (named, with the conversion)."""
    found = []
    for path, leaf in pytree.tree_flatten_with_path(value)[0]:
        name = f"{where}{pytree.keystr(path)}"
        if isinstance(leaf, Replicated):
            leaf, name = leaf.value, f"{name}.value"
        if type(leaf).__module__ == "numpy" and type(leaf).__name__ == "ndarray":
            found.append(f"{name} is a numpy.ndarray; pipecheck splits, traces and compares tensors. "
                         f"Fix: pass torch.from_numpy({name}).")
    return found


def _empty_batches(values: list[tuple[Any, str]], n_microbatches: Any) -> list[str]:
    """Inputs split on an empty dim 0: nothing to compare if no input has a batch, and unsplittable
    beside one that has (an empty input without a batch dimension is Replicated)."""
    batched = [(f"{where}{pytree.keystr(path)}", leaf) for value, where in values
               for path, leaf in pytree.tree_flatten_with_path(value)[0]
               if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    empty = [(name, leaf) for name, leaf in batched if leaf.shape[0] == 0]
    if not empty:
        return []
    if len(empty) == len(batched):
        return [f"{name} has shape {tuple(leaf.shape)}: an empty batch (dim 0 is the batch), so there would be "
                "nothing to compare. Fix: pass at least one sample per micro-batch." for name, leaf in empty]
    if not _is_int(n_microbatches) or n_microbatches < 2:
        return []  # one micro-batch: every input goes whole
    return [f"{name} has shape {tuple(leaf.shape)}, an empty dim 0, beside inputs with a batch: it cannot be "
            f"split into n_microbatches={n_microbatches}. Fix: if it has no batch dimension, pass it as "
            "pc.Replicated(...): every micro-batch then gets it whole." for name, leaf in empty]


def _check_mapping(name: str, value: Any, problems: list[str], example: str) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        problems.append(f"{name} must be a dict, got {type(value).__name__} {_shown(value)}. Fix: pass {example}.")
        return
    odd = [key for key in value if not isinstance(key, str)]
    if odd:
        problems.append(f"{name} has keys that are not names: {_shown(odd)}. Fix: pass {example}.")


def _check_trace_path(trace_path: Any, problems: list[str]) -> None:
    if trace_path is None:
        return
    if not isinstance(trace_path, (str, os.PathLike)):
        problems.append(f"trace_path={_shown(trace_path)} must be a file path. Fix: trace_path='timeline.json'.")
        return
    folder = os.path.dirname(os.path.abspath(os.fspath(trace_path)))
    if not os.path.isdir(folder):
        problems.append(f"trace_path={os.fspath(trace_path)!r} is in a folder that does not exist ({folder}). "
                        "Fix: create the folder first, or write the timeline elsewhere.")


def _world_like(world: Any, world_class: type) -> bool:
    """A pc.World, or an object that stands in for one (a test's fake, an engine's wrapper)."""
    return isinstance(world, world_class) or all(hasattr(world, name) for name in ("run", "world_size", "device"))


def check_arguments(
    caller: str, *, model: Any = _UNSET, args: Any = (), kwargs: Any = None, split_spec: Any = None,
    policy: Any = None, loss_fn: Any = None, target: Any = None, n_microbatches: Any = 1,
    world_size: Any = None, stages_per_rank: Any = 1, seed: Any = 0, check_grads: Any = True,
    timeout: Any = None, world: Any = None, world_optional: bool = True, trace_path: Any = None,
) -> None:
    """Raise one InputError listing every problem with the arguments of ``caller``, each with its fix."""
    from pipecheck._world.world import World  # the World class only, to name a wrong ``world``

    problems: list[str] = []
    if model is not _UNSET:
        _check_model(model, problems)
    _check_mapping("kwargs", kwargs, problems, "kwargs={'mask': mask}")
    _check_mapping("split_spec", split_spec, problems,
                   "a dict of submodule FQNs to split points, e.g. split_spec={'layers.2': pc.SplitPoint.BEGINNING}")
    if policy is not None and not callable(policy):
        problems.append(f"policy={_shown(policy)} is not a policy. Fix: pass one from pc.policies, e.g. "
                        "policy=pc.policies.balanced_params(4).")
    if loss_fn is not None and not callable(loss_fn):
        problems.append(f"loss_fn={_shown(loss_fn)} is not callable. Fix: pass loss_fn(outputs, target) -> scalar tensor, "
                        "e.g. pc.losses.cross_entropy.")
    if loss_fn is None and target is not None:
        problems.append("target was given without loss_fn. Fix: pass loss_fn=..., or drop target to use the "
                        "default random-projection loss.")
    _positive_int("n_microbatches", n_microbatches, problems)
    _positive_int("world_size", world_size, problems, optional=True)
    _positive_int("stages_per_rank", stages_per_rank, problems)
    if not _is_int(seed) or not -2**63 <= seed < 2**64:  # what torch.manual_seed takes
        problems.append(f"seed={_shown(seed)} must be an int in [-2**63, 2**64). Fix: pass e.g. seed=0.")
    if not _is_bool(check_grads):
        problems.append(f"check_grads={_shown(check_grads)} must be True or False. Fix: check_grads=False to "
                        "compare outputs and loss only.")
    if timeout is not None and (_is_bool(timeout) or not isinstance(timeout, numbers.Real)
                                or not math.isfinite(timeout) or timeout <= 0):
        problems.append(f"timeout={_shown(timeout)} must be a positive number of seconds. Fix: pass e.g. timeout=60, "
                        "or leave it out for the default.")
    if (world is not None or not world_optional) and not _world_like(world, World):
        problems.append(f"world={_shown(world)} is not a pc.World. Fix: `with pc.World(2) as world:` and pass world=world"
                        + (", or leave it out (a shared World is used)." if world_optional else "."))
    _check_trace_path(trace_path, problems)
    named_kwargs = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    values = [(as_args(args), "args"), (named_kwargs, "kwargs"), (target, "target")]
    for value, where in values:
        problems += _foreign_leaves(value, where)
    problems += _empty_batches(values[:2], n_microbatches)
    if len(problems) == 1:
        raise InputError(f"{caller}: {problems[0]}")
    if problems:
        raise InputError(f"{caller} was called with {len(problems)} problems:\n"
                         + "\n".join(f"  - {p}" for p in problems))


def training_arguments(caller: str, *, steps: Any = 1, accumulation_steps: Any = 1, optimizer: Any = None,
                       clip_grad_norm: Any = None, loss_reduction: Any = "mean", ignore_index: Any = -100,
                       batches: Any = None, loss_fn: Any = None, data_parallel: Any = 1
                       ) -> tuple[Training, tuple[Batch, ...]]:
    """The check's training loop and its batches, or one InputError listing every problem."""
    problems: list[str] = []
    _positive_int("steps", steps, problems)
    _positive_int("accumulation_steps", accumulation_steps, problems)
    _positive_int("data_parallel", data_parallel, problems)
    if optimizer is not None and not callable(optimizer):
        problems.append(f"optimizer={_shown(optimizer)} is not a factory. Fix: pass a function of the parameters, "
                        "e.g. a top-level def sgd(params): return torch.optim.SGD(params, lr=0.1) and optimizer=sgd (a lambda cannot travel to a World's ranks).")
    if isinstance(optimizer, torch.optim.Optimizer):
        problems[-1] = ("optimizer= is an optimizer already built over some parameters; pipecheck builds one "
                        "over each engine's own copy. Fix: pass a factory, e.g. optimizer=lambda params: "
                        f"torch.optim.{type(optimizer).__name__}(params, lr=...) (top-level, to travel to a World's ranks).")
    if clip_grad_norm is not None:
        if _is_bool(clip_grad_norm) or not isinstance(clip_grad_norm, numbers.Real) or not (
                math.isfinite(clip_grad_norm) and float(clip_grad_norm) > 0):
            problems.append(f"clip_grad_norm={_shown(clip_grad_norm)} must be a positive number (the largest "
                            "gradient 2-norm). Fix: e.g. clip_grad_norm=1.0.")
        elif optimizer is None:
            problems.append("clip_grad_norm was given without optimizer: clipping is part of the optimizer step. "
                            "Fix: pass a top-level def sgd(params): return torch.optim.SGD(params, lr=0.1) and optimizer=sgd (a lambda cannot travel to a World's ranks) too.")
    try:
        check_loss_reduction(loss_reduction)
    except InputError as err:
        problems.append(str(err))
    else:
        if loss_reduction == "token_mean" and loss_fn is None:
            problems.append("loss_reduction='token_mean' needs loss_fn returning every token's loss (reduction="
                            "'none') and a target of labels. Fix: loss_fn=lambda logits, labels: F.cross_entropy("
                            "logits.flatten(0, -2), labels.flatten(), reduction='none').")
    if not _is_int(ignore_index):
        problems.append(f"ignore_index={_shown(ignore_index)} must be an int (the label the loss skips). "
                        "Fix: e.g. ignore_index=-100.")
    found: tuple[Batch, ...] = ()
    if batches is not None:
        found = tuple(batches) if isinstance(batches, (list, tuple)) else ()
        wrong = [i for i, batch in enumerate(found) if not isinstance(batch, Batch)]
        if not found or wrong:
            problems.append(f"batches={_shown(batches)} must be a non-empty list of pc.Batch"
                            + (f" (item {wrong[0]} is {type(found[wrong[0]]).__name__})" if wrong else "")
                            + ". Fix: batches=[pc.Batch((x0,), target=y0), pc.Batch((x1,), target=y1)].")
        elif _is_int(steps) and _is_int(accumulation_steps) and len(found) != steps * accumulation_steps:
            problems.append(f"batches has {len(found)} batches, but steps={steps} x accumulation_steps="
                            f"{accumulation_steps} schedule steps need {steps * accumulation_steps}. Fix: one "
                            "pc.Batch per schedule step, or steps=len(batches) // accumulation_steps.")
        for i, batch in enumerate(found if not wrong else ()):
            problems += _foreign_leaves((batch.args, dict(batch.kwargs), batch.target), f"batches[{i}]")
        if loss_fn is None and not wrong and any(batch.target is not None for batch in found):
            problems.append("batches have targets but no loss_fn was given: the default loss (a random projection "
                            "of the outputs) takes none. Fix: pass loss_fn=..., or leave target out of the batches.")
    if len(problems) == 1:
        raise InputError(f"{caller}: {problems[0]}")
    if problems:
        raise InputError(f"{caller} was called with {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    training = Training(plain(steps), plain(accumulation_steps), optimizer,
                        None if clip_grad_norm is None else float(clip_grad_norm), loss_reduction, plain(ignore_index),
                        plain(data_parallel))
    return training, found
