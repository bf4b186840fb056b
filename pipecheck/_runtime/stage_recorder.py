"""An engine's stage boundary values named in pipecheck's terms, by stage and position, on any process.

    recorders = [job.recorder(s) for s in range(job.structure().num_stages)]
    # on the process that runs stage s (a recorder pickles: send it there, and back with what it holds):
    rec.inputs(mb, h, x)                 # what stage s received for micro-batch mb, in pipecheck's order
    rec.outputs(mb, out)                 # what it sent (the last stage: the model's output, or its leaves)
    rec.output_grads(mb, out_grad)       # backward: the gradients its outputs received
    rec.input_grads(mb, h.grad, None)    # and those it sent back (None: an input with no gradient)
    # back on the driver:
    return pc.StepResult(outputs, loss, grads, boundaries=job.recorded(recorders))

``print(rec)`` lists which value is position k. A recorder records only while the check records
(its second run, after a failure: ``rec.active``); otherwise each call only checks its counts and
copies nothing. While recording it also checks every value's shape against the reference's.
``rec.watch(module)`` records a stage module that takes the stage's inputs positionally, forward
and backward, through hooks (the k-th forward is micro-batch k).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.hooks import RemovableHandle

from pipecheck._runtime.boundaries import (
    Boundaries,
    BoundaryKey,
    Divergence,
    _not_a_microbatch,
    _tapped,
    diverges,
    stage_output_names,
)
from pipecheck._split.pipe import Pipe
from pipecheck.errors import RecordingError, plural

# What each point is called, the method that records it, and the point of the value a gradient belongs to.
_WHAT = {"received": "inputs", "sent": "outputs", "grad sent": "input gradients", "grad received": "output gradients"}
_METHOD = {"received": "inputs", "sent": "outputs", "grad sent": "input_grads", "grad received": "output_grads"}
_VALUE_POINT = {"grad sent": "received", "grad received": "sent"}


@dataclass(frozen=True)
class _Slot:
    """One position of a stage's inputs or outputs: pipecheck's name and where the value comes from or goes."""

    name: str
    where: str  # "from stage 0", "a model input", "to stage 2", "a model output"


@dataclass
class StageRecorder:
    """Records one stage's boundary values, named by position as pipecheck's split has them.

    Made by ``job.recorder(stage)``; see the module's docstring. It pickles with what it recorded, so
    an engine sends it to the process running the stage and back; ``job.recorded(recorders)`` gives
    what they hold as ``StepResult.boundaries``.
    """

    stage: int
    num_stages: int
    n_microbatches: int
    input_slots: tuple[_Slot, ...]
    output_slots: tuple[_Slot, ...]
    active: bool  # the check is recording: values are copied to the host and their shapes checked
    shapes: dict[tuple[int, str, str], tuple[int, ...]] = field(default_factory=dict, repr=False)  # (mb, point, name)
    recording: Boundaries = field(default_factory=Boundaries, repr=False)

    @classmethod
    def for_stage(cls, pipe: Pipe, stage: int, n_microbatches: int, boundaries: Boundaries | None) -> StageRecorder:
        """Stage ``stage`` of ``pipe``; active when ``boundaries`` is set (the check records), its shapes then."""
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < pipe.num_stages:
            raise RecordingError(f"job.recorder(stage={stage!r}): pipecheck's split of this job has "
                                 f"{plural(pipe.num_stages, 'stage')}, 0 to {pipe.num_stages - 1}. Fix: pass a stage "
                                 f"index in that range (print(job.structure()) shows the stages).")
        this = pipe.stages[stage]
        consumers: dict[str, list[int]] = {}
        for other in pipe.stages:
            for src in other.inputs:
                if src.stage == stage:
                    consumers.setdefault(src.name, []).append(other.index)
        model_outputs = {src.name for src in pipe.output_sources if src is not None and src.stage == stage}
        inputs = tuple(_Slot(src.name, "a model input" if src.stage is None else f"from stage {src.stage}")
                       for src in this.inputs)
        last = stage == pipe.num_stages - 1
        outputs = tuple(_Slot(name, "a model output" if last else _destinations(consumers.get(name, []),
                                                                                name in model_outputs))
                        for name in stage_output_names(pipe, this))
        shapes = {} if boundaries is None else {
            (mb, point, name): shape for (s, mb, point, name), shape in boundaries.shapes.items() if s == stage}
        return cls(stage, pipe.num_stages, n_microbatches, inputs, outputs, boundaries is not None, shapes)

    # --- what an engine calls ---------------------------------------------------------------------------------

    def inputs(self, microbatch: int, *values: Any) -> None:
        """What the stage received for ``microbatch``: one value per input, in pipecheck's order."""
        self._record(microbatch, "received", values)

    def outputs(self, microbatch: int, *values: Any) -> None:
        """What the stage sent for ``microbatch``: one value per output (the last stage: the model's output
        as one value, or its leaves as pytree flattens it)."""
        self._record(microbatch, "sent", values)

    def input_grads(self, microbatch: int, *grads: torch.Tensor | None) -> None:
        """The gradients the stage sent back for its inputs, one per input (None: none for that input)."""
        self._record(microbatch, "grad sent", grads)

    def output_grads(self, microbatch: int, *grads: Any) -> None:
        """The gradients the stage's outputs received, one per output (None: none for that output)."""
        self._record(microbatch, "grad received", grads)

    def watch(self, module: torch.nn.Module) -> list[RemovableHandle]:
        """Record ``module``'s forwards as this stage's micro-batches (the k-th is micro-batch k): its
        positional inputs and its outputs, and the gradients through both. ``module`` must take the
        stage's inputs positionally in pipecheck's order and return its outputs (a tuple, or one value).
        Nothing is hooked while the check is not recording; remove the returned handles to stop."""
        if not self.active:
            return []
        current: list[int] = []  # the micro-batch of the forward under way
        book, stage = self.recording, self.stage

        def before(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if book.paused or _not_a_microbatch((args, kwargs)):
                current.clear()
                return None
            mb = book.forwards.get(stage, 0)
            if kwargs:
                raise RecordingError(f"stage {stage}'s watched module was called with keyword arguments "
                                     f"{sorted(kwargs)}; watch() names positional inputs only.\n{self._table('received', mb)}\n"
                                     f"Fix: call it with stage {stage}'s inputs positionally in this order, or record "
                                     "them with recorder.inputs(mb, ...).")
            pairs = self._checked(mb, "received", args)
            current[:] = [mb]
            for slot, value in pairs:
                book.record(stage, mb, "received", slot.name, value)
            return tuple(_tapped(value, book, stage, mb, "grad sent", slot.name) for slot, value in pairs), kwargs

        def after(_module: Any, _args: tuple[Any, ...], outputs: Any) -> Any:
            if not current:
                return None
            mb = current.pop()
            book.forwards[stage] = mb + 1
            positional = isinstance(outputs, (tuple, list)) and len(outputs) == len(self.output_slots)
            values = tuple(outputs) if positional else (outputs,)
            pairs = self._checked(mb, "sent", values)
            for slot, value in pairs:
                book.record(stage, mb, "sent", slot.name, value)
            tapped = [_tapped(value, book, stage, mb, "grad received", slot.name) for slot, value in pairs]
            if positional:
                return type(outputs)(*tapped) if hasattr(outputs, "_fields") else type(outputs)(tapped)
            if len(pairs) == 1:
                return tapped[0]
            return pytree.tree_unflatten(tapped, pytree.tree_flatten(outputs)[1])  # the model's output, its leaves tapped

        return [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(after)]

    def exported(self) -> dict[BoundaryKey, torch.Tensor]:
        """What this recorder holds, as ``StepResult.boundaries`` takes it."""
        return self.recording.exported()

    # --- checking and naming ------------------------------------------------------------------------------------

    def _record(self, mb: int, point: str, values: tuple[Any, ...]) -> None:
        pairs = self._checked(mb, point, values)
        if self.active:
            for slot, value in pairs:
                self.recording.record(self.stage, mb, point, slot.name, value)

    def _checked(self, mb: int, point: str, values: tuple[Any, ...]) -> list[tuple[_Slot, Any]]:
        """Each value with the position it fills; a RecordingError for a wrong micro-batch, count or shape."""
        if not isinstance(mb, int) or isinstance(mb, bool) or not 0 <= mb < self.n_microbatches:
            raise RecordingError(f"stage {self.stage}'s recorder.{_METHOD[point]}(microbatch={mb!r}, ...): the job runs "
                                 f"{plural(self.n_microbatches, 'micro-batch')}, 0 to {self.n_microbatches - 1}. Fix: "
                                 "pass the index of the micro-batch in the job's order (pc.split_microbatches's; in a "
                                 "training check numbered across the run: schedule step i's replica r's j-th is "
                                 "(i * d + r) * n + j).")
        slots = self.input_slots if point in ("received", "grad sent") else self.output_slots
        if len(values) == len(slots):
            pairs = list(zip(slots, values))
        elif (point in ("sent", "grad received") and self.stage == self.num_stages - 1 and len(values) == 1
              and len(leaves := pytree.tree_leaves(values[0])) == len(slots)):
            pairs = list(zip(slots, leaves))  # the model's output as one structure
        else:
            last = (f" (or the model's output as one value, flattened to {len(slots)} leaves)"
                    if self.stage == self.num_stages - 1 and point in ("sent", "grad received") else "")
            raise RecordingError(
                f"stage {self.stage}'s {_WHAT[point]} for micro-batch {mb}: {plural(len(values), 'value')} given, but "
                f"pipecheck's split has {plural(len(slots), 'value')} there{last}.\n{self._table(point, mb)}\n"
                f"Fix: call recorder.{_METHOD[point]}(mb, ...) with one value per position, in this order"
                f"{'; None for a gradient the stage has not' if point.startswith('grad') else ''}.")
        if self.active:
            self._check_shapes(mb, point, pairs)
        return pairs

    def _expected(self, mb: int, point: str, name: str) -> tuple[int, ...] | None:
        """The reference's shape for this value (a gradient has its value's shape)."""
        found = self.shapes.get((mb, point, name))
        return found if found is not None else self.shapes.get((mb, _VALUE_POINT.get(point, point), name))

    def _check_shapes(self, mb: int, point: str, pairs: list[tuple[_Slot, Any]]) -> None:
        wrong: list[str] = []
        given: list[tuple[int, ...]] = []
        for position, (slot, value) in enumerate(pairs):
            leaves = pytree.tree_leaves(value)
            for i, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    continue
                name = slot.name if len(leaves) == 1 else f"{slot.name}[{i}]"
                expected, shape = self._expected(mb, point, name), tuple(leaf.shape)
                given.append(shape)
                if expected is not None and shape != expected:
                    wrong.append(f"position {position} {name!r} has shape {shape} where pipecheck's split has {expected}")
        if not wrong:
            return
        slots = self.input_slots if point in ("received", "grad sent") else self.output_slots
        known = sorted(split_shape for slot in slots if (split_shape := self._expected(mb, point, slot.name)) is not None)
        swapped = ("; the shapes given are the split's, at other positions: the values are not in pipecheck's order"
                   if sorted(given) == known else "")
        raise RecordingError(
            f"stage {self.stage}'s {_WHAT[point]} for micro-batch {mb}: {'; '.join(wrong)}{swapped}.\n"
            f"{self._table(point, mb)}\nFix: pass stage {self.stage}'s {_WHAT[point]} in this order, each the value of "
            f"micro-batch {mb} alone (pc.split_microbatches cuts the batch as the reference does); if the stage did get "
            "this shape, the engine's micro-batches are not pipecheck's.")

    def _table(self, point: str, mb: int | None = None, indent: str = "") -> str:
        """The positions of ``point``'s values: index, name, where from or to, and the shape when known."""
        inputs = point in ("received", "grad sent")
        slots = self.input_slots if inputs else self.output_slots
        methods = "recorder.inputs and recorder.input_grads" if inputs else "recorder.outputs and recorder.output_grads"
        last = "; or the model's output as one value" if not inputs and self.stage == self.num_stages - 1 else ""
        head = f"stage {self.stage}'s " if not indent else ""
        lines = [f"{indent}{head}{'inputs' if inputs else 'outputs'}, in pipecheck's order ({methods} take them so{last}):"]
        for k, slot in enumerate(slots):
            shape = None if mb is None else self._expected(mb, point, slot.name)
            shown = f", shape {shape} for micro-batch {mb}" if shape is not None else ""
            lines.append(f"{indent}  {k}: {slot.name!r} ({slot.where}){shown}")
        if not slots:
            lines.append(f"{indent}  (none)")
        return "\n".join(lines)

    def __str__(self) -> str:
        state = "recording" if self.active else "not recording: the check records on its second run, after a failure"
        return "\n".join([f"StageRecorder of stage {self.stage} of {self.num_stages}, "
                          f"{plural(self.n_microbatches, 'micro-batch')} ({state})",
                          self._table("received", indent="  "), self._table("sent", indent="  ")])

    def __repr__(self) -> str:
        held = len(self.recording.values)
        return (f"<StageRecorder stage {self.stage} of {self.num_stages}: {plural(len(self.input_slots), 'input')}, "
                f"{plural(len(self.output_slots), 'output')}, {'holding ' + plural(held, 'value') if self.active else 'inactive'}>")


def _destinations(stages: list[int], model_output: bool) -> str:
    where = [f"to stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"] if stages else []
    return " and ".join(where + (["a model output"] if model_output else [])) or "read by no later stage"


def swapped_note(test: Mapping[BoundaryKey, torch.Tensor], truth: Mapping[BoundaryKey, torch.Tensor],
                 found: Divergence) -> str:
    """A note for a diverging value that is, in every micro-batch that diverges, the reference's value of
    another name at the same stage and point: two values swapped, by the engine or by its recording."""
    names = sorted({key[3] for key in truth if key[0] == found.stage and key[2] == found.point} - {found.value})
    for other in names:
        pairs = [((found.stage, mb, found.point, found.value), (found.stage, mb, found.point, other))
                 for mb in found.microbatches]
        if pairs and all(mine in test and theirs in truth and not diverges(test[mine], truth[theirs])[0]
                         for mine, theirs in pairs):
            return (f"; what was recorded as {found.value!r} is the reference's {other!r}: the engine swapped them, "
                    f"or recorded them out of pipecheck's order (print(job.recorder({found.stage})) lists it)")
    return ""
