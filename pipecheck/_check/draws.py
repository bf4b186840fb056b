"""Eager and its float64 truth draw what a pipeline that follows pipecheck's randomness contract draws.

    draws = record_draws(job, batches)         # the split's stages run forward by the contract, draws kept
    with Replay(draws):                        # every random op of the eager model (and its float64 copy)
        train_eager(model, batches, ...)       #   returns the stages' draw at the same place, in order

Under the contract (:mod:`pipecheck.randomness`) every stage's forward of a micro-batch draws from
torch's generators seeded for that stage and micro-batch. The eager model runs the same ops in the
same order (a stage is a contiguous stretch of the traced forward), so its k-th random op of a
micro-batch is the stages' k-th: :class:`Replay` hands it that draw (checked by op and shape), cast to
the eager op's dtype. A recompute in backward (activation checkpointing) finds its place by the CPU
generator's state, which :class:`Replay` sets to a marker after every draw and which torch's
checkpoint restores; a recompute that does not restore it is refused, naming the cause.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pipecheck._runtime.randomness import (
    NATIVE_DROPOUT,
    draws_random,
    listening,
    position,
    schedule_step,
)
from pipecheck._runtime.randomness import microbatch as microbatch_block
from pipecheck._runtime.reference import DetachExecutor
from pipecheck._split.inputs import Inputs, as_args
from pipecheck._split.microbatch import shard_batch, split_microbatches
from pipecheck._split.model_factory import is_default_generator
from pipecheck.errors import InputError

Position = tuple[int, int, int]  # (optimizer step, schedule step, micro-batch across replicas)

# Ops whose tensor outputs are the draw itself (their values replayed as recorded); native_dropout's
# first output is computed from its replayed mask. Any other random op (a fused attention kernel that
# draws its dropout mask inside, on CUDA) is refused: its draw cannot be replayed into float64.
_REPLAYABLE = {f"aten::{name}" for name in (
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "normal_", "uniform_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
    "multinomial", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet", "native_dropout")}


@dataclass
class Draw:
    op: str
    stage: int | None
    outputs: list[torch.Tensor | None]  # 0/1 draws kept as bool


@dataclass
class Draws:
    """Every random op's draw of the stages' forwards, by position, in order."""

    seed: int
    by_position: dict[Position, list[Draw]] = field(default_factory=dict)


def _own_generator(args: Any, kwargs: Any) -> bool:
    """Whether an op draws from a generator other than torch's default (given explicitly: the same)."""
    return any(isinstance(leaf, torch.Generator) and not is_default_generator(leaf)
               for leaf in pytree.tree_leaves((args, kwargs)))


def _compact(value: torch.Tensor, op: str) -> torch.Tensor:
    """A draw as kept until eager replays it: on the CPU (the device's memory is the check's), 0/1 as bool."""
    if value.dtype != torch.bool and op.startswith("aten::bernoulli"):
        value = value.detach().to(torch.bool)  # 0 or 1 by construction: a quarter of the memory
    return value.detach().to("cpu", copy=True)


def _unreplayable(name: str, stage: int | None) -> InputError:
    """The refusal of a random op whose draw is not its output (its mask stays inside the kernel)."""
    attention = "attention" in name
    where = ("inside a fused attention kernel (flash or memory-efficient attention with dropout, on CUDA)"
             if attention else "inside the op, whose output is not the draw")
    fix = ("attention dropout through the math kernel (torch.nn.attention.sdpa_kernel(SDPBackend.MATH) around the "
           "check, or a HF model with attn_implementation='eager')" if attention else
           "the randomness as its own op (dropout, bernoulli_, rand) where the model allows it (an nn.LSTM's "
           "dropout= as nn.Dropout between single-layer LSTMs; nn.RReLU as a LeakyReLU with a slope drawn by "
           "torch.rand)")
    return InputError(f"the model's op {name} (stage {stage}) draws its random numbers {where}, which pipecheck "
                      f"cannot replay into eager and its float64 truth. Fix: {fix}; model.eval() checks the "
                      "deterministic model only.")


_SHAPE_ONLY = {"aten::rand_like", "aten::randn_like", "aten::randint_like", NATIVE_DROPOUT}


def _value_dependent(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether a random op's draw depends on tensor values the model computes (``bernoulli(probs)``,
    ``normal(mean, std)``, ``multinomial``), not only on shapes: an in-place op's own tensor, and a
    dropout's input (its mask is drawn apart), do not count."""
    if func._schema.name in _SHAPE_ONLY:
        return False
    first = func._schema.arguments[0] if func._schema.arguments else None
    in_place = first is not None and first.alias_info is not None and first.alias_info.is_write
    tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    return len(tensors) > (1 if in_place else 0)


class _Recorder(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, draws: Draws, stage: list[int | None], parameters_move: bool) -> None:
        super().__init__()
        self.draws, self.stage, self.parameters_move = draws, stage, parameters_move

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if draws_random(func, args, kwargs):
            here = position()
            if here is not None:
                name = func._schema.name
                if _own_generator(args, kwargs):
                    raise InputError(f"the model's op {name} draws from a torch.Generator of its own, which "
                                     "pipecheck's randomness contract cannot replay (it seeds torch's default "
                                     "generators per stage and micro-batch). Fix: draw from torch's default "
                                     "generator (no generator= argument), or check the model without that op.")
                if name not in _REPLAYABLE:
                    raise _unreplayable(name, self.stage[0])
                if self.parameters_move and _value_dependent(func, args, kwargs):
                    raise InputError(
                        f"the model's op {name} (stage {self.stage[0]}) draws from values the model computes (a "
                        "probability, a mean), which change as the optimizer moves the parameters; pipecheck "
                        "records the stages' draws once, from the parameters the check starts from, so it cannot "
                        "replay them into eager's later steps. Fix: a one-step check (steps=1, or no optimizer), "
                        "or a draw that depends on shapes only (torch.rand_like(p) < p for bernoulli(p)).")
                leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
                self.draws.by_position.setdefault(here, []).append(
                    Draw(name, self.stage[0], [_compact(leaf, name) for leaf in leaves]))
        return out


def record_draws(job: Any, batches: Sequence[Inputs], seed: int) -> Draws:
    """The draws of the job's stages, forward only, on every micro-batch of every schedule step (each
    replica's, numbered across replicas), as a runner following the contract draws them."""
    draws = Draws(seed)
    pipe = job.structure()  # run forward only, its buffers put back: no copy of the parameters
    noted: list[int | None] = [None]
    hooks = [stage.module.register_forward_pre_hook(lambda *_, index=stage.index: noted.__setitem__(0, index))
             for stage in pipe.stages]
    executor = DetachExecutor(pipe)
    d, n, g = job.training.data_parallel, job.n_microbatches, job.training.accumulation_steps
    uneven = job.training.loss_reduction != "mean"
    device = next((p.device for s in pipe.stages for p in s.module.parameters()), torch.device("cpu"))
    try:
        moving = job.training.optimizer is not None and job.training.steps > 1
        with torch.no_grad(), pipe.buffers_restored(), _Recorder(draws, noted, moving):
            for i, batch in enumerate(batches):
                batch = batch.unspoiled()
                for r, (args, kwargs) in enumerate(shard_batch((batch.args, dict(batch.kwargs)), d, uneven)):
                    bound = pipe.bind_inputs(as_args(args), kwargs)
                    with schedule_step(seed, i // g, i % g, r * n):
                        for j, values in enumerate(split_microbatches(bound, n, uneven=uneven)):
                            with microbatch_block(j), job.precision.forward(device):
                                executor.forward_microbatch(values)
    finally:
        for hook in hooks:
            hook.remove()
    return draws


def _fingerprint() -> bytes:
    return hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).digest()


class Replay(TorchDispatchMode):
    """While active, every random op of a micro-batch (inside the position contexts of
    :mod:`pipecheck._runtime.randomness`) returns the recorded draw at its place."""

    supports_higher_order_operators = True

    def __init__(self, draws: Draws) -> None:
        super().__init__()
        self.draws = draws
        self.cursor: dict[Position, int] = {}
        self.markers: dict[bytes, tuple[Position, int]] = {}
        self._entered: list[tuple[torch.Tensor, Any]] = []
        self.probing = False

    def __enter__(self) -> Replay:
        listener = listening(self._started)
        listener.__enter__()
        self._entered.append((torch.random.get_rng_state(), listener))
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        saved, listener = self._entered.pop()
        listener.__exit__(*exc)
        torch.random.set_rng_state(saved)  # torch's RNG as found: the markers were only ever ours

    @contextmanager
    def probe(self, model: nn.Module) -> Iterator[None]:
        """The block probes ``model`` for randomness the contract does not cover: each forward's k-th random
        op of torch's default generators draws the same numbers, whatever the seed (the probe's micro-batch
        need not be one the stages drew)."""
        hook = model.register_forward_pre_hook(self._restart)
        self.probing = True
        try:
            yield
        finally:
            self.probing = False
            hook.remove()

    def _restart(self, *_: Any) -> None:
        here = position()
        if here is not None:
            self.cursor[here] = 0

    def _started(self, _: int | None) -> None:
        here = position()
        if here is not None:
            self._mark(here, 0)

    def _mark(self, here: Position, k: int) -> None:
        self.cursor[here] = k
        key = f"pipecheck-replay/{self.draws.seed}/{here}/{k}".encode()
        torch.random.default_generator.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
                                                   & (2**63 - 1))
        self.markers.setdefault(_fingerprint(), (here, k))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not draws_random(func, args, kwargs) or _own_generator(args, kwargs):  # pipecheck's projection draws from its own
            return func(*args, **kwargs)
        here = position()
        name = func._schema.name
        if here is None:
            raise InputError(f"the model draws random numbers ({name}) outside a micro-batch's forward (in its loss "
                             "function?), which pipecheck's randomness contract does not cover. Fix: a loss "
                             "without random ops.")
        k = self.cursor.get(here, 0)
        if self.probing:  # the determinism probe: the k-th draw of every probing forward is the same
            devices = sorted({leaf.device.index or 0 for leaf in pytree.tree_leaves((args, kwargs))
                              if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda"})
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(k)  # CPU and every CUDA device's generator
                out = func(*args, **kwargs)
            self.cursor[here] = k + 1
            return out
        if torch._C._current_graph_task_id() != -1:  # in backward: a recompute finds its place by the RNG state
            found = self.markers.get(_fingerprint())
            if found is None or found[0] != here or found[1] >= len(self.draws.by_position.get(here, [])):
                raise InputError(
                    f"the model recomputes random ops in backward ({name}, micro-batch {here[2]}) without "
                    "restoring torch's RNG state, so its own gradients come from other random numbers than "
                    "its forward used (torch.utils.checkpoint.checkpoint(..., preserve_rng_state=False) "
                    "around dropout?). No engine can match that. Fix: preserve_rng_state=True (the default).")
            k = found[1]
        recorded = self.draws.by_position.get(here, [])
        if k >= len(recorded) or recorded[k].op != name:
            what = f"{recorded[k].op}" if k < len(recorded) else "no more random ops"
            raise InputError(
                f"the eager model's random op #{k + 1} of micro-batch {here[2]} (step {here[0]}) is {name}, where "
                f"the split's stages drew {what}: pipecheck cannot line eager's random numbers up with the "
                "stages'. Fix: random ops that do not depend on the data's values, or model.eval() to check the "
                "deterministic model (that leaves the engine's handling of randomness unchecked).")
        draw = recorded[k]
        out = func(*args, **kwargs)  # the op's own outputs (dtype, device), their values replaced
        leaves, spec = pytree.tree_flatten(out)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if len(tensors) != len(draw.outputs) or any(
                leaves[i].shape != saved.shape for i, saved in zip(tensors, draw.outputs) if saved is not None):
            raise InputError(
                f"the eager model's random op {name} in micro-batch {here[2]} draws a shape other than the split's "
                f"stage {draw.stage} drew there ({[tuple(leaves[i].shape) for i in tensors]} against "
                f"{[tuple(s.shape) for s in draw.outputs if s is not None]}). Fix: model.eval() to check the "
                "deterministic model (that leaves the engine's handling of randomness unchecked).")
        with torch.no_grad():
            for i, saved in zip(tensors, draw.outputs):
                if saved is not None:
                    leaves[i].copy_(saved)
            if name == NATIVE_DROPOUT:  # (input * mask / (1 - p), mask)
                p = float(args[1])
                leaves[0].copy_(args[0] * leaves[1] * (1.0 / (1.0 - p)) if p < 1 else args[0] * 0)
        self._mark(here, k + 1)
        return pytree.tree_unflatten(leaves, spec)


class LossDraws(TorchDispatchMode):
    """A loss function that draws from torch's default generators is refused: eager and a runner would
    draw other numbers for it, outside every stage (pipecheck's own projection draws from its own)."""

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if draws_random(func, args, kwargs) and not _own_generator(args, kwargs):
            raise InputError(f"the loss function draws random numbers ({func._schema.name}), which no stage "
                             "draws: eager and a runner draw other numbers for it, so no check can compare them. "
                             "Fix: a loss without random ops (dropout belongs in the model, whose random ops "
                             "pipecheck's randomness contract covers).")
        return func(*args, **kwargs)
