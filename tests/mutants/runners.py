"""A correct in-process pipeline runner, and mutants of it that each plant ONE realistic bug.

    runner = MUTANTS["tied_one_stage"]
    pc.assert_equivalent(entry.factory(), args, kwargs, runner=runner, n_microbatches=4, ...)
    # EquivalenceError naming "grad tok_emb.weight", hint "tied parameter not synchronised: ..."

:class:`BaseRunner` runs a Pipe in GPipe order on one process: every stage's
forwards (stage by stage, micro-batch by micro-batch), then every backward in
reverse, with pipecheck's building blocks (``stage_forward``/``stage_backward``,
``split``/``merge_microbatches``). Each decision a pipeline engine owns is one
method (which micro-batches run, what a send delivers, how consumers'
gradients combine, how gradients scale, accumulate and sync across tied
replicas, how outputs merge); a mutant overrides exactly one of them.

Each mutant declares the zoo models it applies to, the tensors the check must
name for each, and the hint expected on the first of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from pipecheck.fixtures import ZOO, get

import pipecheck as pc
from pipecheck import Job, Pipe, Source, Stage, StepResult, merge_microbatches, split_microbatches

# private: planted bugs are the reference runner with one of its steps changed
from pipecheck._runtime.reference import sum_stage_grads
from pipecheck._runtime.stage_step import (
    LeafGrads,
    StageForward,
    add_leaf_grads,
    add_param_grads,
    stage_backward,
    stage_forward,
)
from pipecheck.losses import check_scalar_loss, default_microbatch_target, projection_loss

ALL = tuple(entry.name for entry in ZOO)
SKIPS = ("skip_one", "long_skip", "encoder_decoder")  # a value consumed by a stage beyond the next one
TIED = ("tiny_gpt", "alias_reuse", "titan_lm")
KWARGS = ("kwarg_last", "kwarg_default")

# The first parameter of every zoo model (its gradient is wrong under a bug that hits every gradient).
FIRST_GRAD = {
    "mlp": "grad layers.0.fc.weight",
    "skip_one": "grad a.fc.weight",
    "long_skip": "grad blocks.0.fc.weight",
    "tiny_gpt": "grad tok_emb.weight",
    "alias_reuse": "grad proj.weight",
    "kwarg_last": "grad blocks.0.fc.weight",
    "kwarg_default": "grad blocks.0.fc.weight",
    "buffers": "grad blocks.0.fc.weight",
    "dict_outputs": "grad blocks.0.fc.weight",
    "nested_spec": "grad encoder.layers.0.fc.weight",
    "encoder_decoder": "grad encoder.layers.0.fc.weight",
    "running_stats": "grad fc0.weight",
    "titan_lm": "grad tok_embeddings.weight",
}
# The first output leaf of every zoo model.
OUTPUT = {name: "output['logits']" if name == "dict_outputs" else "output" for name in ALL}

Key = tuple[int, str, int]  # (producer stage, value name, micro-batch)


class BaseRunner:
    """The correct runner (no bug). Subclasses override one step."""

    name: ClassVar[str] = "base"
    bug: ClassVar[str] = "none: the correct runner"
    applies_to: ClassVar[tuple[str, ...]] = ALL
    hint: ClassVar[str | None] = None  # expected in the hint of the first expected tensor
    located: ClassVar[str] = ""  # expected in the report's first-divergence line, on every model it applies to

    def expect(self, model: str) -> tuple[str, ...]:
        """Tensors the check must name as failing on ``model`` (empty: the check must pass)."""
        return ()

    def expected_hint(self, model: str) -> str | None:
        """Text the hint on the first expected tensor must contain (None: any hint, or none)."""
        return self.hint

    @property
    def __name__(self) -> str:  # how assert_equivalent names the runner in its report
        return f"mutant:{self.name}"

    # --- the steps an engine owns; a mutant overrides one --------------------------------------

    def stages(self, pipe: Pipe) -> list[Stage]:
        """The stage modules as each rank would hold them."""
        return list(pipe.stages)

    def microbatches(self, n: int) -> list[int]:
        """The micro-batches the schedule runs."""
        return list(range(n))

    def source_microbatch(self, src: int, dst: int, mb: int, n: int) -> int:
        """Which micro-batch's value of stage ``src`` stage ``dst`` reads for micro-batch ``mb``."""
        return mb

    def send(self, value: Any, src: int, name: str, dst: int, mb: int) -> Any:
        """What stage ``dst`` receives when stage ``src`` sends ``value``."""
        return value

    def model_input(self, job: Job, name: str, value: Any, dst: int) -> Any:
        """The model input ``name`` as it reaches stage ``dst``."""
        return value

    def combine_output_grads(self, by_consumer: list[tuple[int, LeafGrads]]) -> LeafGrads | None:
        """The gradient of one stage output from all its consumers (summed, last consumer first)."""
        total: LeafGrads | None = None
        for _, grads in sorted(by_consumer, key=lambda item: -item[0]):
            total = add_leaf_grads(total, grads)
        return total

    def loss_scale(self, n: int) -> float:
        """Each micro-batch's loss is divided by n: the gradient of the mean loss."""
        return 1.0 / n

    def accumulate(self, total: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's parameter gradients to a stage's running gradients."""
        add_param_grads(total, grads)

    def full_grads(self, pipe: Pipe, per_stage: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient: a tied parameter's replicas are summed (all-reduce)."""
        return sum_stage_grads(per_stage)

    def merge(self, outputs: list[Any]) -> Any:
        """Micro-batch outputs merged into the full batch, in micro-batch order."""
        return merge_microbatches(outputs)

    def before_forward(self, stage: Stage, mb: int) -> None:
        """Anything done to a stage's state before its forward of micro-batch ``mb`` (nothing)."""

    # --- the step itself -------------------------------------------------------------------------

    def __call__(self, job: Job) -> StepResult:
        pipe = job.split()
        stages = self.stages(pipe)
        n = job.n_microbatches
        mbs = self.microbatches(n)
        inputs = split_microbatches(pipe.bind_inputs(job.args, job.kwargs), n)
        produced: dict[Key, Any] = {}
        forwards: dict[tuple[int, int], StageForward] = {}
        for stage in stages:
            for mb in mbs:
                self.before_forward(stage, mb)
                values = [self._receive(job, src, stage.index, mb, n, inputs, produced) for src in stage.inputs]
                fwd = stage_forward(stage, values)
                forwards[(stage.index, mb)] = fwd
                produced.update(((stage.index, name, mb), v) for name, v in zip(stage.outputs, fwd.outputs, strict=False))  # last stage: ()
        last = pipe.num_stages - 1
        outputs = {mb: pytree.tree_unflatten(list(forwards[(last, mb)].outputs), pipe.out_spec) for mb in mbs}
        losses = {mb: self._loss(job, outputs[mb], mb) for mb in mbs}
        per_stage, input_grads = self._backward(stages, forwards, losses, mbs, n)
        return StepResult(
            outputs=self.merge([pytree.tree_map(_detached, outputs[mb]) for mb in mbs]),
            loss=torch.stack([losses[mb].detach() for mb in mbs]).mean(),
            grads=self.full_grads(pipe, per_stage),
            input_grads=input_grads,
            buffers=pipe.buffers_after_step(),
            stage_grads=per_stage,
        )

    def _receive(self, job: Job, src: Source, dst: int, mb: int, n: int, inputs: list[dict[str, Any]],
                 produced: dict[Key, Any]) -> Any:
        if src.stage is None:
            return self.model_input(job, src.name, inputs[mb][src.name], dst)
        value = produced[(src.stage, src.name, self.source_microbatch(src.stage, dst, mb, n))]
        return self.send(value, src.stage, src.name, dst, mb)

    def _loss(self, job: Job, output: Any, mb: int) -> torch.Tensor:
        loss_fn = job.loss_fn or projection_loss
        if job.loss_fn is None:
            target = default_microbatch_target(output, mb)
        elif job.target is not None:
            target = split_microbatches(job.target, job.n_microbatches, "target")[mb]
        else:
            target = None
        return check_scalar_loss(loss_fn(output, target), loss_fn)

    def _backward(self, stages: list[Stage], forwards: dict[tuple[int, int], StageForward],
                  losses: dict[int, torch.Tensor], mbs: list[int], n: int
                  ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        pending: dict[Key, list[tuple[int, LeafGrads]]] = {}
        per_stage: list[dict[str, torch.Tensor]] = [{} for _ in stages]
        model_input_grads: dict[tuple[str, int], LeafGrads] = {}
        for stage in reversed(stages):
            last = stage.index == len(stages) - 1
            for mb in mbs:
                fwd = forwards[(stage.index, mb)]
                out_grads = [self.combine_output_grads(pending.pop((stage.index, name, mb), []))
                             for name in stage.outputs]
                in_grads, p_grads = stage_backward(stage, fwd, out_grads, losses[mb] if last else None,
                                                   self.loss_scale(n))
                self.accumulate(per_stage[stage.index], p_grads)
                for src, grads in zip(stage.inputs, in_grads, strict=True):
                    if src.stage is None:
                        key = (src.name, mb)
                        model_input_grads[key] = add_leaf_grads(model_input_grads.get(key), grads)
                    else:
                        pending.setdefault((src.stage, src.name, mb), []).append((stage.index, grads))
        return per_stage, _merge_input_grads(model_input_grads, mbs)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _merge_input_grads(grads: Mapping[tuple[str, int], LeafGrads], mbs: list[int]) -> dict[str, torch.Tensor]:
    merged = {}
    for name in dict.fromkeys(name for name, _ in grads):
        chunks = [grads.get((name, mb)) for mb in mbs]
        if all(c is not None and len(c) == 1 and c[0] is not None for c in chunks):
            merged[name] = merge_microbatches([c[0] for c in chunks])  # type: ignore[index]
    return merged


# --- the mutants ------------------------------------------------------------------------------------


class TiedOneStage(BaseRunner):
    name = "tied_one_stage"
    located = 'how the engine handles gradients after computing them'
    bug = "tied parameter's gradient taken from its first stage only (no all-reduce)"
    applies_to = TIED
    hint = "tied parameter not synchronised"

    def expect(self, model: str) -> tuple[str, ...]:
        return {"tiny_gpt": ("grad tok_emb.weight",),
                "alias_reuse": ("grad proj.weight", "grad shared.fc.weight", "grad shared.norm.bias"),
                "titan_lm": ("grad tok_embeddings.weight",)}[model]

    def full_grads(self, pipe: Pipe, per_stage: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        for stage_grads in per_stage:
            for fqn, grad in stage_grads.items():
                grads.setdefault(fqn, grad)
        return grads


class TiedSummedTwice(BaseRunner):
    name = "tied_summed_twice"
    located = 'how the engine handles gradients after computing them'
    bug = "tied replicas all-reduced, then the all-reduced copies summed again"
    applies_to = TIED

    def expect(self, model: str) -> tuple[str, ...]:
        return {"tiny_gpt": ("grad tok_emb.weight",), "alias_reuse": ("grad proj.weight",),
                "titan_lm": ("grad tok_embeddings.weight",)}[model]

    def full_grads(self, pipe: Pipe, per_stage: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        reduced = sum_stage_grads(per_stage)
        return sum_stage_grads([{fqn: reduced[fqn] for fqn in stage} for stage in per_stage])


class SkipGradDropped(BaseRunner):
    name = "skip_grad_dropped"
    located = 'received the gradient of'
    bug = "an output's gradient taken from the next stage only; the skip connection's is dropped"
    applies_to = SKIPS
    hint = "skip-connection gradient dropped"

    def expect(self, model: str) -> tuple[str, ...]:
        return (FIRST_GRAD[model],)

    def expected_hint(self, model: str) -> str | None:
        # encoder_decoder: two skip edges (stage 0 -> 2 and 0 -> 3) are dropped at once; the check's
        # what-if runs drop one edge each, so they recognise no single cause.
        return None if model == "encoder_decoder" else self.hint

    def combine_output_grads(self, by_consumer: list[tuple[int, LeafGrads]]) -> LeafGrads | None:
        return min(by_consumer, key=lambda item: item[0])[1] if by_consumer else None


class SkipWrongMicrobatch(BaseRunner):
    name = "skip_wrong_microbatch"
    located = '(from stage 0) in the forward'
    bug = "a skip connection's value read from the next micro-batch (a FIFO popped once too often)"
    applies_to = SKIPS

    def expect(self, model: str) -> tuple[str, ...]:
        return (OUTPUT[model], FIRST_GRAD[model])

    def source_microbatch(self, src: int, dst: int, mb: int, n: int) -> int:
        return (mb + 1) % n if dst - src > 1 else mb


class MergeReversed(BaseRunner):
    name = "merge_reversed"
    located = "merges the micro-batches' outputs"
    bug = "micro-batch outputs merged in reverse order"
    hint = "outputs permuted across micro-batches"

    def expect(self, model: str) -> tuple[str, ...]:
        return (OUTPUT[model],)

    def merge(self, outputs: list[Any]) -> Any:
        return merge_microbatches(list(reversed(outputs)))


class GradNotScaled(BaseRunner):
    name = "grad_not_scaled"
    located = "every gradient crossing a stage is 4 times the reference's: the loss is scaled by 4"
    bug = "micro-batch losses not divided by n_microbatches"
    hint = "gradient scaling"

    def expect(self, model: str) -> tuple[str, ...]:
        return (FIRST_GRAD[model],)

    def loss_scale(self, n: int) -> float:
        return 1.0


class GradScaledTwice(BaseRunner):
    name = "grad_scaled_twice"
    located = "every gradient crossing a stage is 0.25 times the reference's"
    bug = "gradients divided by n_microbatches twice (loss and gradients both scaled)"
    hint = "gradient scaling"

    def expect(self, model: str) -> tuple[str, ...]:
        return (FIRST_GRAD[model],)

    def loss_scale(self, n: int) -> float:
        return 1.0 / (n * n)


class KwargDefaultLater(BaseRunner):
    name = "kwarg_default_later"
    located = '(a model input) in the forward'
    bug = "a keyword input reaches later stages as its default (None -> zeros), not the passed value"
    applies_to = KWARGS

    def expect(self, model: str) -> tuple[str, ...]:
        return (OUTPUT[model], "grad blocks.0.fc.weight")

    def model_input(self, job: Job, name: str, value: Any, dst: int) -> Any:
        if dst > 0 and name in job.kwargs and isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        return value


class BufferNotCarried(BaseRunner):
    """A buffer used by several stages is loaded into the first of them only; the later stages
    hold a zero-initialised copy (their state was never sent)."""

    name = "buffer_not_carried"
    located = "stage 2 sent 'output' in the forward"
    bug = "a buffer shared by several stages is carried to its first stage only; later stages see zeros"
    applies_to = ("buffers",)

    def expect(self, model: str) -> tuple[str, ...]:
        return (OUTPUT[model], "grad blocks.2.fc.weight")

    def stages(self, pipe: Pipe) -> list[Stage]:
        carried: set[int] = set()
        for stage in pipe.stages:  # the pipe is this step's own: its stage modules may be edited
            held = list(stage.module.named_buffers(remove_duplicate=False))
            for local, buffer in held:
                if id(buffer) in carried:
                    owner, _, attr = local.rpartition(".")
                    stage.module.get_submodule(owner)._buffers[attr] = torch.zeros_like(buffer)
            carried.update(id(buffer) for _, buffer in held)
        return list(pipe.stages)


class BufferUpdateNotCarried(BaseRunner):
    """Every micro-batch's forward starts from the buffers as they were before the step (each
    micro-batch run on a fresh copy of the stage's state): only the last one's update survives."""

    name = "buffer_update_not_carried"
    located = 'the state the engine keeps across micro-batches'
    bug = "buffers a forward updates (BatchNorm statistics, a running average) reset for every micro-batch"
    applies_to = ("running_stats",)
    hint = "holds micro-batch 3's update alone"

    def __init__(self) -> None:
        self.initial: dict[int, dict[str, torch.Tensor]] = {}

    def expect(self, model: str) -> tuple[str, ...]:
        return ("buffer bn.running_mean", "buffer bn.running_var", "buffer bn.num_batches_tracked",
                "buffer mean_seen")

    def before_forward(self, stage: Stage, mb: int) -> None:
        held = dict(stage.module.named_buffers())
        if mb == 0:
            self.initial[stage.index] = {local: b.detach().clone() for local, b in held.items()}
        for local, value in self.initial[stage.index].items():  # a fresh copy: earlier ones stay saved
            owner, _, attr = local.rpartition(".")
            stage.module.get_submodule(owner)._buffers[attr] = value.clone()


class GradOverwritten(BaseRunner):
    name = "grad_overwritten"
    hint = "only the last micro-batch's gradient survives"
    located = 'how the engine handles gradients after computing them'
    bug = "a stage's parameter gradients overwritten by each micro-batch instead of accumulated"

    def expect(self, model: str) -> tuple[str, ...]:
        return (FIRST_GRAD[model],)

    def accumulate(self, total: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        total.update(grads)


class LastMicrobatchDropped(BaseRunner):
    name = "last_microbatch_dropped"
    located = 'micro-batch 3 never reached it'
    bug = "the schedule's loop stops one micro-batch early"

    def expect(self, model: str) -> tuple[str, ...]:
        return (OUTPUT[model], "loss", FIRST_GRAD[model])

    def microbatches(self, n: int) -> list[int]:
        return list(range(n - 1))


# A parameter of stage 1 of every zoo model: where a bug in how stage 1 keeps or pairs what it
# received first shows.
STAGE_1_PARAM: dict[str, str] = {
    "mlp": "grad layers.1.fc.weight",
    "skip_one": "grad b.fc.weight",
    "long_skip": "grad blocks.1.fc.weight",
    "tiny_gpt": "grad blocks.0.fc.weight",
    "alias_reuse": "grad mid.fc.weight",
    "kwarg_last": "grad blocks.1.fc.weight",
    "kwarg_default": "grad blocks.1.fc.weight",
    "buffers": "grad blocks.1.fc.weight",
    "dict_outputs": "grad blocks.1.fc.weight",
    "nested_spec": "grad encoder.layers.1.fc.weight",
    "encoder_decoder": "grad decoder.0.self_fc.weight",
    "running_stats": "grad fc1.weight",
    "titan_lm": "grad layers.1.fc.weight",
}


class AliasedRecvBuffer(BaseRunner):
    """Each boundary's receive buffer is reused for the next micro-batch, and the stage keeps
    (for its backward) the buffer itself, not a copy: by backward time it holds the last
    micro-batch. The copy goes through ``.data``, as a raw recv does, so autograd's in-place
    check never sees it."""

    name = "aliased_recv_buffer"
    located = "changed before that micro-batch's backward"
    bug = "a received activation kept by reference to a reused receive buffer (overwritten in place)"
    # Not buffers: each boundary value there feeds only ops whose backward never reads it again
    # (``h * scale``, ``h + c``), so the clobbered buffer is harmless and the step is correct.
    applies_to = tuple(name for name in ALL if name != "buffers")
    EXPECT: ClassVar[dict[str, str]] = {
        **STAGE_1_PARAM,
        "kwarg_default": "grad blocks.2.fc.weight",  # stage 1 reads h only as h * sigmoid(gate)
    }

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, str, int], torch.Tensor] = {}

    def expect(self, model: str) -> tuple[str, ...]:
        return (self.EXPECT[model],)

    def __call__(self, job: Job) -> StepResult:
        self.buffers = {}
        return super().__call__(job)

    def send(self, value: Any, src: int, name: str, dst: int, mb: int) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        key = (src, name, dst)
        if key not in self.buffers:
            self.buffers[key] = torch.empty_like(value).requires_grad_(value.requires_grad)
        self.buffers[key].data.copy_(value.detach())
        return self.buffers[key]


class Bf16Boundary(BaseRunner):
    name = "bf16_boundary"
    located = 'stage 1 received'
    bug = "activations sent in bfloat16 and cast back (an fp32 run)"

    def expect(self, model: str) -> tuple[str, ...]:
        return (OUTPUT[model],)

    def send(self, value: Any, src: int, name: str, dst: int, mb: int) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(torch.bfloat16).to(value.dtype)
        return value


# The zero-bubble runner and its mutants build on BaseRunner (defined above, so this import works).
from .zero_bubble import ZERO_BUBBLE_MUTANT_TYPES, ZeroBubbleRunner  # noqa: E402

MUTANT_TYPES: tuple[type[BaseRunner], ...] = (
    TiedOneStage, TiedSummedTwice, SkipGradDropped, SkipWrongMicrobatch, MergeReversed, GradNotScaled,
    GradScaledTwice, KwargDefaultLater, BufferNotCarried, BufferUpdateNotCarried, GradOverwritten,
    LastMicrobatchDropped,
    AliasedRecvBuffer, Bf16Boundary,
    *ZERO_BUBBLE_MUTANT_TYPES,
)
BASES: tuple[BaseRunner, ...] = (BaseRunner(), ZeroBubbleRunner())  # the correct runners
MUTANTS: dict[str, BaseRunner] = {t.name: t() for t in MUTANT_TYPES}
N_MICROBATCHES = 4


def cases() -> list[tuple[BaseRunner, str]]:
    """Every (mutant, zoo model) pair the suite checks."""
    return [(mutant, model) for mutant in MUTANTS.values() for model in mutant.applies_to]


def check(runner: BaseRunner, model: str) -> Any:
    """``assert_equivalent`` of one zoo model (first cut style) through ``runner``."""
    entry = get(model)
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    return pc.assert_equivalent(entry.factory(style), args, kwargs, runner=runner, loss_fn=entry.loss_fn,
                                target=entry.target(), n_microbatches=N_MICROBATCHES, **entry.cut(style))

