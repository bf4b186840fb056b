"""Boundary values: what each stage received and sent, per micro-batch, forward and backward.

    recorder = Boundaries()
    instrument(pipe, recorder)          # pipe: a private copy (job.split()), never the check's own
    ...run the pipe's stage modules...   # any engine that calls stage.module(*inputs)
    recorder.values[(1, 0, "received", "relu")]  # stage 1, micro-batch 0: the value it received

The stage modules get hooks, not wrappers: a forward pre-hook records the
values a stage receives, a forward hook the values it sends, and each value
that needs a gradient passes through an identity autograd function whose
backward records the gradient flowing through it (the gradient an output
received, the gradient an input's producer is sent). The k-th forward of a
stage module is micro-batch k; a forward that autograd runs inside a backward
(activation recompute) and a forward of meta or fake tensors (shape inference)
are not micro-batches and are not recorded. Values are copied to the host.

:func:`first_divergence` compares a runner's values with the reference's in
dataflow order: the forward from the first stage to the last (what a stage
received, then what it sent), then the backward from the last stage to the
first (the gradients a stage received, then those it sent).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.hooks import RemovableHandle

from pipecheck._split.pipe import Pipe, Stage
from pipecheck.errors import plural

POINTS = ("received", "sent", "grad received", "grad sent")  # in a stage's dataflow order
BoundaryKey = tuple[int, int, str, str]  # (stage, micro-batch, point, value name)


@dataclass
class Boundaries:
    """A recording of boundary values: ``values[(stage, microbatch, point, name)]`` (host tensors)."""

    values: dict[BoundaryKey, torch.Tensor] = field(default_factory=dict)
    forwards: dict[int, int] = field(default_factory=dict)  # stage -> forwards recorded so far
    # Received values that changed between their forward and their backward (a reused receive buffer
    # written in place under the stage's saved activations): key -> largest change.
    overwritten: dict[BoundaryKey, float] = field(default_factory=dict)
    paused: bool = False  # while set, a forward is no micro-batch (an engine's probe on real tensors)
    # While a check records: the reference's shape of each value, what a StageRecorder checks an engine's
    # values against (filled by the check, never by a recording).
    shapes: dict[BoundaryKey, tuple[int, ...]] = field(default_factory=dict)

    def exported(self) -> dict[BoundaryKey, torch.Tensor]:
        """``values`` with the overwritten received values as ``(stage, mb, "overwritten", name)`` keys
        (their change as a 0-dim tensor): what a rank returns in StepResult.boundaries."""
        return {**self.values, **{(stage, mb, "overwritten", name): torch.tensor(change)
                                  for (stage, mb, _, name), change in self.overwritten.items()}}

    def imported(self, values: Mapping[BoundaryKey, torch.Tensor]) -> None:
        """Take in what :meth:`exported` gave (on another process)."""
        for (stage, mb, point, name), value in values.items():
            if point == "overwritten":
                self.overwritten[(stage, mb, "received", name)] = float(value)
            else:
                self.values[(stage, mb, point, name)] = value

    def record(self, stage: int, microbatch: int, point: str, name: str, value: Any) -> None:
        """Record one boundary value (every tensor leaf of it; a nested value as ``name[i]``).

        The call an engine makes itself when it does not run the stage modules of ``job.split()``:
        ``point`` is one of ``"received"``, ``"sent"``, ``"grad received"``, ``"grad sent"``.
        """
        if point not in POINTS:
            raise ValueError(f"point={point!r}: use one of {POINTS}")
        leaves = pytree.tree_leaves(value)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                key = (stage, microbatch, point, name if len(leaves) == 1 else f"{name}[{i}]")
                self.values.setdefault(key, leaf.detach().to("cpu", copy=True))  # first wins: a W pass re-walks


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN."""
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


class _Tap(torch.autograd.Function):
    """Identity forward (a copy, so a stage may write into it); its backward records the gradient."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, recorder: Boundaries, key: BoundaryKey,
                watched: torch.Tensor | None = None) -> torch.Tensor:
        ctx.recorder, ctx.key, ctx.watched = recorder, key, watched
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if grad is not None:
            ctx.recorder.record(*ctx.key, grad)
        if ctx.watched is not None:  # a received value: is it still what the forward received?
            stage, mb, _, name = ctx.key
            seen = ctx.recorder.values.get((stage, mb, "received", name))
            now = ctx.watched.detach().to("cpu")
            if seen is not None and seen.shape == now.shape and seen.dtype == now.dtype and not _same(seen, now):
                change = (now.double() - seen.double()).abs().nan_to_num(float("inf")).max().item() \
                    if seen.is_floating_point() else 1.0
                ctx.recorder.overwritten[(stage, mb, "received", name)] = change
        return grad, None, None, None


def _not_a_microbatch(args: tuple[Any, ...]) -> bool:
    """A forward autograd runs inside a backward (recompute), or one on meta/fake tensors."""
    if torch._C._current_graph_task_id() != -1:
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(leaf, torch.Tensor) and (leaf.is_meta or isinstance(leaf, FakeTensor))
               for leaf in pytree.tree_leaves(args))


def _tapped(value: Any, recorder: Boundaries, stage: int, mb: int, point: str, name: str) -> Any:
    """``value`` with every leaf that needs a gradient passed through a tap keyed like ``record``."""
    leaves, spec = pytree.tree_flatten(value)
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and torch.is_grad_enabled():
            key = (stage, mb, point, name if len(leaves) == 1 else f"{name}[{i}]")
            leaf = _Tap.apply(leaf, recorder, key, leaf if point == "grad sent" else None)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def output_names(pipe: Pipe) -> list[str]:
    """The last stage's output leaves as the report names them (``output``, ``output['logits']``)."""
    leaves = pytree.tree_unflatten(list(range(pipe.out_spec.num_leaves)), pipe.out_spec)
    return ["output" + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(leaves)[0]]


def stage_output_names(pipe: Pipe, stage: Stage) -> list[str]:
    return list(stage.outputs) if stage.index < pipe.num_stages - 1 else output_names(pipe)


def instrument(pipe: Pipe, recorder: Boundaries) -> list[RemovableHandle]:
    """Record every stage module's boundary values into ``recorder`` (hooks on ``pipe``'s own modules;
    removing the returned handles takes them off)."""
    return [handle for stage in pipe.stages
            for handle in _instrument_stage(stage, stage_output_names(pipe, stage), recorder)]


@contextmanager
def recording(pipe: Pipe, recorder: Boundaries) -> Iterator[Pipe]:
    """``pipe`` recording into ``recorder`` for the duration (for a pipe that is not a private copy)."""
    handles = instrument(pipe, recorder)
    try:
        yield pipe
    finally:
        for handle in handles:
            handle.remove()


def _instrument_stage(stage: Stage, out_names: list[str], recorder: Boundaries) -> list[RemovableHandle]:
    return instrument_module(stage.module, stage.index, [src.name for src in stage.inputs], out_names, recorder)


def _chained(word: str, count: int) -> list[str]:
    return [word] if count == 1 else [f"{word}[{i}]" for i in range(count)]


def instrument_module(module: torch.nn.Module, stage: int, in_names: list[str] | None, out_names: list[str] | None,
                      recorder: Boundaries) -> list[RemovableHandle]:
    """Record the boundary values of ``module``, stage ``stage`` of some split: its positional inputs
    named ``in_names`` (keyword inputs by their keywords), its outputs (a tuple or list, or one value)
    named ``out_names``. None: a stage of a chain (each stage gets what the one before returned):
    its positional inputs are ``input`` (``input[i]`` of several), its outputs ``output``
    (``output[i]``); see :func:`chain_producers`."""
    current: list[int] = []  # the micro-batch of the forward under way

    def before(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if recorder.paused or _not_a_microbatch((args, kwargs)):
            current.clear()
            return None
        mb = recorder.forwards.get(stage, 0)  # counted once the forward returns: one that raises is none
        current[:] = [mb]
        names = in_names if in_names is not None else _chained("input", len(args))
        for name, value in list(zip(names, args)) + list(kwargs.items()):
            recorder.record(stage, mb, "received", name, value)
        args = tuple(_tapped(value, recorder, stage, mb, "grad sent", name)
                     for name, value in zip(names, args)) + args[len(names):]
        kwargs = {name: _tapped(value, recorder, stage, mb, "grad sent", name) for name, value in kwargs.items()}
        return args, kwargs

    def after(_module: Any, _args: tuple[Any, ...], outputs: Any) -> Any:
        if not current:
            return None
        mb = current.pop()
        recorder.forwards[stage] = mb + 1
        several = isinstance(outputs, (tuple, list))
        values = list(outputs) if several else [outputs]
        names = out_names if out_names is not None else _chained("output", len(values) if several else 1)
        for name, value in zip(names, values):
            recorder.record(stage, mb, "sent", name, value)
        tapped = [_tapped(value, recorder, stage, mb, "grad received", name)
                  for name, value in zip(names, values)] + values[len(names):]
        if not several:
            return tapped[0]
        return type(outputs)(*tapped) if hasattr(outputs, "_fields") else type(outputs)(tapped)

    return [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(after)]


def pause_for_metadata_probes(stage: Any, recorder: Boundaries) -> None:
    """Record nothing while torch's pipeline ``stage`` runs its metadata inference: from torch 2.15 a
    stage probes shapes with a real forward and backward before the first micro-batch, which would
    otherwise count as one. Through the stage's forward context, where torch has it (before 2.15
    the probe runs on meta tensors, which are never recorded)."""
    register = getattr(stage, "register_forward_context", None)
    if register is None:
        return

    @contextmanager
    def probing(info: Any) -> Iterator[None]:
        before = recorder.paused
        recorder.paused = bool(getattr(info, "is_metadata_inference", False))
        try:
            yield
        finally:
            recorder.paused = before

    register(probing)


def chain_producers(truth: Mapping[BoundaryKey, torch.Tensor]) -> dict[tuple[int, str], int | None]:
    """Producers for stages instrumented as a chain (``in_names=None`` past the first stage): a
    stage's ``input`` comes from the stage before it; anything else it receives is a model input."""
    return {(stage, base): stage - 1 if stage > 0 and base == "input" else None
            for stage, _, point, name in truth if point == "received" for base in [name.split("[", 1)[0]]}


@dataclass(frozen=True)
class Divergence:
    """The earliest boundary value in dataflow order where the runner and the reference differ.

    ``point`` is what the stage did with the value ("received", "sent", "grad received",
    "grad sent"); ``microbatches`` diverge (or were never recorded: ``missing``), ``matching`` agree.
    ``producer``: the stage that made the value (None: a model input; for a gradient, the stage the
    value belongs to). ``error`` is the largest absolute difference, ``relative`` that over the
    reference's largest magnitude (inf where shapes differ or a value is missing).
    """

    stage: int
    direction: str  # "forward" or "backward"
    point: str
    value: str
    producer: int | None
    microbatches: tuple[int, ...]
    matching: tuple[int, ...]
    missing: tuple[int, ...]
    error: float
    relative: float
    more_values: int = 0  # other values diverging at the same stage and point
    mismatch: str = ""  # "shape (4, 16) where the reference has (8, 16)", or the dtypes, when they differ
    # In a training check: the optimizer step it is in and its schedule step there (None: a one-step check).
    optimizer_step: int | None = None
    schedule_step: int | None = None

    def text(self) -> str:
        where = {"received": "received", "sent": "sent", "grad received": "received the gradient of",
                 "grad sent": "sent back the gradient of"}[self.point]
        source = ("a model input" if self.producer is None and self.point in ("received", "grad sent")
                  else f"from stage {self.producer}" if self.point == "received"
                  else f"to stage {self.producer}" if self.point == "grad sent" else None)
        what = f"{self.value!r}" + (f" ({source})" if source else "")
        if self.more_values:
            what += f" and {plural(self.more_values, 'other value')}"
        mbs = _mb_list(self.microbatches, "differs") if self.microbatches else ""
        if self.missing:
            mbs = (mbs + "; " if mbs else "") + _mb_list(self.missing, "never reached it")
        ok = f"; {_mb_list(self.matching, 'matches')}" if self.matching else ""
        error = (f", max abs error {self.error:.2e} ({self.relative:.1e} of its largest value)"
                 if self.error == self.error and self.error != float("inf") else "")
        if self.mismatch:
            error = f", {self.mismatch}"
        return (f"first divergence: stage {self.stage} {where} {what} in the {self.direction}: "
                f"{mbs}{ok}{error}")


def _mb_list(mbs: tuple[int, ...], verb: str) -> str:
    word = "micro-batch" if len(mbs) == 1 else "micro-batches"
    verb = verb if len(mbs) == 1 else {"differs": "differ", "matches": "match", "never reached it": "never reached it"}[verb]
    return f"{word} {', '.join(map(str, mbs))} {verb}"


def _mismatch(test: torch.Tensor, truth: torch.Tensor) -> str:
    if test.shape != truth.shape:
        return f"shape {tuple(test.shape)} where the reference has {tuple(truth.shape)}"
    if test.dtype != truth.dtype:
        return f"dtype {str(test.dtype).removeprefix('torch.')} where the reference has {str(truth.dtype).removeprefix('torch.')}"
    return ""


def diverges(test: torch.Tensor, truth: torch.Tensor) -> tuple[bool, float, float]:
    """(differs, max abs error, relative error) under a diagnosis's loose closeness, not a verdict's."""
    if test.shape != truth.shape or test.dtype != truth.dtype:
        return True, float("inf"), float("inf")
    if test.is_complex():
        test, truth = torch.view_as_real(test.resolve_conj()), torch.view_as_real(truth.resolve_conj())
    if not test.is_floating_point():
        equal = bool(torch.equal(test, truth))
        return not equal, 0.0 if equal else float("inf"), 0.0 if equal else float("inf")
    t64, r64 = test.double(), truth.double()
    same = (t64 == r64) | (t64.isnan() & r64.isnan())
    diff = (t64 - r64).abs().masked_fill(same, 0.0).nan_to_num(float("inf"))
    error = diff.max().item() if diff.numel() else 0.0
    finite = r64[torch.isfinite(r64)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    rel = max(1e-4, 8 * torch.finfo(test.dtype).eps)
    relative = error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))
    return error > rel * scale, error, relative


def _order(num_stages: int) -> Iterator[tuple[int, str]]:
    for stage in range(num_stages):
        yield stage, "received"
        yield stage, "sent"
    for stage in reversed(range(num_stages)):
        yield stage, "grad received"
        yield stage, "grad sent"


def producers_of(pipe: Pipe) -> dict[tuple[int, str], int | None]:
    """(consuming stage, value name) -> the stage that made it (None: a model input)."""
    return {(s.index, src.name): src.stage for s in pipe.stages for src in s.inputs}


def backward_scale(test: Mapping[BoundaryKey, torch.Tensor], truth: Mapping[BoundaryKey, torch.Tensor]) -> float:
    """The one factor c with every backward boundary value = c x the reference's, when there is one
    and it is not 1 (an engine that scales the loss later, as torch's schedules do with
    ``scale_grads``: its boundary gradients are n times the reference's, and still right); else 1."""
    keys = [key for key in truth if key[2] in ("grad received", "grad sent") and key in test
            and test[key].shape == truth[key].shape and test[key].is_floating_point()
            and truth[key].is_floating_point()]
    if not keys:
        return 1.0
    dot = sum(float((test[k].double() * truth[k].double()).sum()) for k in keys)
    norm = sum(float((truth[k].double() ** 2).sum()) for k in keys)
    if not norm > 0 or not dot > 0:
        return 1.0
    scale = dot / norm
    if abs(scale - 1.0) <= 1e-3 or any(diverges(test[k], (truth[k].double() * scale).to(truth[k].dtype))[0]
                                       for k in keys):
        return 1.0
    return scale


def first_divergence(test: Mapping[BoundaryKey, torch.Tensor], truth: Mapping[BoundaryKey, torch.Tensor],
                     n_microbatches: int, num_stages: int, producers: Mapping[tuple[int, str], int | None]
                     ) -> tuple[Divergence | None, float]:
    """The earliest (stage, point) in dataflow order where some value of some micro-batch differs
    from the reference's, or the runner recorded nothing for a micro-batch the reference has; and the
    factor the backward's values were compared under (see :func:`backward_scale`)."""
    scale = backward_scale(test, truth)
    recorded = {(key[0], key[2]) for key in test}
    for stage, point in _order(num_stages):
        if (stage, point) not in recorded and point.startswith("grad"):
            continue  # nothing recorded there at all (no tap: a no-grad forward, a runner recording forwards only)
        names = list(dict.fromkeys(key[3] for key in truth if key[0] == stage and key[2] == point))
        found: list[tuple[str, list[int], list[int], list[int], float, float, str]] = []
        for name in names:
            bad: list[int] = []
            good: list[int] = []
            missing: list[int] = []
            worst, worst_rel, why = 0.0, 0.0, ""
            for mb in range(n_microbatches):
                key = (stage, mb, point, name)
                if key not in truth:
                    continue
                if key not in test:
                    missing.append(mb)
                    continue
                expected = truth[key]
                if scale != 1.0 and point.startswith("grad"):
                    expected = (expected.double() * scale).to(expected.dtype)
                differs, error, relative = diverges(test[key], expected)
                (bad if differs else good).append(mb)
                if differs:
                    worst, worst_rel = max(worst, error), max(worst_rel, relative)
                    why = why or _mismatch(test[key], expected)
            if bad or missing:
                found.append((name, bad, good, missing, worst, worst_rel, why))
        if found:
            name, bad, good, missing, error, relative, why = found[0]
            base = name.split("[", 1)[0]
            producer = producers.get((stage, base), stage) if point in ("received", "grad sent") else stage
            return Divergence(stage, "forward" if point in ("received", "sent") else "backward", point, name,
                              producer, tuple(bad), tuple(good), tuple(missing),
                              error if bad else float("inf"), relative if bad else float("inf"),
                              len(found) - 1, why), scale
    return None, scale


def overwritten_text(overwritten: Mapping[BoundaryKey, float]) -> str:
    """What the first received value that changed under its stage's saved activations says."""
    (stage, mb, _, name), change = min(overwritten.items())
    others = len(overwritten) - 1
    more = f" ({plural(others, 'more value')} too)" if others else ""
    return (f"first divergence: stage {stage} received {name!r} for micro-batch {mb} right, but it changed before "
            f"that micro-batch's backward (by up to {change:.2e}){more}: the tensor the stage saved for backward was "
            "overwritten in place, as a receive buffer reused for the next micro-batch is; give each in-flight "
            "micro-batch its own buffer, or copy what was received")
