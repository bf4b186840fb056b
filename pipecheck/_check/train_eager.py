"""The eager side of a training check: the model trained step by step, in its dtype and in float64.

    batches = prepared_batches(model, job_batches, dtype, device)
    eager = train_eager(model, batches, training, loss_fn, n_microbatches)            # list[StepResult]
    truth = train_eager(model64, batches64, training, loss_fn, n_microbatches)        # float64, same loop

Every optimizer step runs ``accumulation_steps`` schedule steps; each runs its batch micro-batch by
micro-batch (as a pipeline sees it), weighs every micro-batch's loss as the loss convention says
(:class:`pipecheck.losses.Reduction`) and adds its gradients. The step's result holds the gradients
before the optimizer; then clipping (``torch.nn.utils.clip_grad_norm_``) and the optimizer update the
model, and the result holds every parameter after. Without ``loss_fn`` each batch's target is the
seeded projection of its outputs, filled in on the batch (every runner gets it).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from pipecheck._check.draws import LossDraws
from pipecheck._check.eager import _call, _detached, _gradients
from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch, Training
from pipecheck._runtime.optimizer import build_optimizer
from pipecheck._runtime.randomness import microbatch, schedule_step
from pipecheck._split.inputs import Inputs, _copied, cast_inputs, cast_module, prepare_inputs
from pipecheck._split.microbatch import merge_microbatches, shard_batch, split_microbatches
from pipecheck.errors import InputError
from pipecheck.losses import LossFn, MicrobatchLoss, Reduction, projection_loss, projection_target


def prepared_batches(model: nn.Module, batches: Sequence[Batch], dtype: torch.dtype | None,
                     device: str | None) -> list[Inputs]:
    """Each batch bound to ``model.forward``, cast and copied (the caller's tensors only ever read)."""
    return [prepare_inputs(model, batch.args, batch.kwargs, batch.target, dtype=dtype, device=device)
            for batch in batches]


Summation = Callable[[list[torch.Tensor]], torch.Tensor]
"""How an optimizer step's micro-batch gradients (or weighted losses) add up, e.g. last first."""


def train_eager(model: nn.Module, batches: list[Inputs], training: Training, loss_fn: LossFn | None,
                n_microbatches: int, targets: list[Any] | None = None,
                perturb: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None,
                summation: Summation | None = None) -> tuple[list[StepResult], list[Any]]:
    """``training.steps`` optimizer steps of ``model`` itself (trained in place: pass a copy).

    ``n_microbatches`` per data-parallel replica: each batch is cut into ``training.data_parallel``
    shards, each shard into its micro-batches, as the runners cut it (replica r's j-th micro-batch is
    the (r * n + j)-th). ``targets``: each batch's target (the fp32 run's, cast); None: the batches' own,
    the projection's weights where there is no ``loss_fn``. ``perturb(step, name, grad)``: added to each
    gradient the optimizer gets (not to the one reported). ``summation``: each micro-batch's backward runs
    on its own, and each parameter's gradients over the optimizer step's micro-batches (across schedule
    steps and replicas), and each schedule step's weighted micro-batch losses, add up as it says (a
    legitimate re-ordering of the same training). Returns one result per optimizer step and the targets
    used."""
    seed = training.random_seed
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(training.optimizer, [p for _, p in params]) if training.optimizer else None
    g = training.accumulation_steps
    replica_buffers = ReplicaBuffers(model, training.data_parallel)
    used = list(targets) if targets is not None else [None] * len(batches)
    results = []
    for t in range(training.steps):
        group = range(t * g, (t + 1) * g)
        sums: list[torch.Tensor | None] = [None] * len(params)
        each: list[list[torch.Tensor]] = [[] for _ in params]  # with a summation: every micro-batch's gradient
        outputs, losses = [], []
        forwards = {}
        uneven = training.loss_reduction != "mean"
        d = training.data_parallel
        for i in group:
            with schedule_step(seed, t, i - t * g) if seed is not None else nullcontext():
                forwards[i] = _forward(model, batches[i].unspoiled(), n_microbatches, replica_buffers, uneven)
        for i in group:
            if used[i] is None:
                used[i] = batches[i].target if loss_fn is not None else projection_target(
                    merge_microbatches(_detached(forwards[i])))
        reduction = Reduction.of(training.loss_reduction, [used[i] for i in group], n_microbatches * d,
                                 training.ignore_index)
        for i in group:
            mb_outputs = forwards.pop(i)
            losses_of = [MicrobatchLoss(loss_fn or projection_loss, shard, n_microbatches, reduction)
                         for shard in shard_batch(used[i], d, uneven, "target")]
            with LossDraws():
                mb_losses = [losses_of[mb // n_microbatches](mb % n_microbatches, out)
                             for mb, out in enumerate(mb_outputs)]
            total = torch.stack(mb_losses).sum() * reduction.weight if summation is None \
                else summation([loss * reduction.weight for loss in mb_losses])
            # With dropout drawn by pipecheck's contract, each micro-batch's backward runs as its own (a
            # recompute of activation checkpointing then draws the forward's masks); else one backward.
            backwards = [(mb, loss * reduction.weight) for mb, loss in enumerate(mb_losses)] \
                if seed is not None or summation is not None else [(0, total)]
            for mb, loss in backwards:
                if not (params and loss.requires_grad):
                    continue
                with (schedule_step(seed, t, i - t * g) if seed is not None else nullcontext()), \
                        microbatch(mb, backward=True):
                    got = _gradients(model, loss, [p for _, p in params])
                for k, grad in enumerate(got):
                    total_k = sums[k]
                    if grad is not None and summation is not None:
                        each[k].append(grad)
                    elif grad is not None:
                        sums[k] = grad if total_k is None else total_k + grad
            outputs.append(merge_microbatches(_detached(mb_outputs)))
            losses.append(total.detach())
            del mb_outputs, mb_losses, total, backwards
        if summation is not None:
            sums = [summation(grads) if grads else None for grads in each]
        grads = {name: grad for (name, _), grad in zip(params, sums) if grad is not None}
        if optimizer is not None:
            for (name, param), grad in zip(params, sums):
                param.grad = None if grad is None else grad.detach().clone()
                if perturb is not None and param.grad is not None:
                    param.grad += perturb(t, name, param.grad)
            if training.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([p for _, p in params], training.clip_grad_norm)
            try:
                optimizer.step()
            except TypeError as err:  # LBFGS: a step that needs a closure
                raise InputError(f"optimizer {type(optimizer).__name__}.step() failed ({err}): pipecheck steps "
                                 "each optimizer once per optimizer step, without a closure. Fix: an optimizer "
                                 "whose step takes none (SGD, Adam, AdamW, ...).") from None
            optimizer.zero_grad(set_to_none=True)
        results.append(StepResult(
            outputs[0] if g == 1 else tuple(outputs), torch.stack(losses).sum(), grads,
            buffers={name: b.detach().clone() for name, b in model.named_buffers()},
            params={name: p.detach().clone() for name, p in model.named_parameters()} if optimizer is not None
            else {}))  # frozen ones too: an engine must leave them as they were
    return results, used


def _forward(model: nn.Module, inputs: Inputs, n_microbatches: int, buffers: ReplicaBuffers, uneven: bool
             ) -> list[Any]:
    """One batch's micro-batches run forward (their graphs kept for the backward): each data-parallel
    shard's in turn, on its replica's buffers, numbered across the shards."""
    bound = inputs.signature.bind(*inputs.args, **inputs.kwargs)
    outputs = []
    for r, shard in enumerate(shard_batch(dict(bound.arguments), buffers.replicas, uneven)):
        with buffers.of(r):
            for j, chunk in enumerate(split_microbatches(shard, n_microbatches, uneven=uneven)):
                with microbatch(r * n_microbatches + j):
                    outputs.append(_call(model, inspect.BoundArguments(bound.signature, chunk), n_microbatches,
                                         whole=bound))
    return outputs


class ReplicaBuffers:
    """Each data-parallel replica's own buffers, as each replica of an engine holds them: a forward that
    updates a buffer (BatchNorm's running statistics, a running mean its output reads) updates its
    replica's only. Replica 0's are the model's own; the others start as copies of them."""

    def __init__(self, model: nn.Module, replicas: int) -> None:
        self.replicas = replicas
        self.slots = [(module, name) for module in model.modules() for name, b in module._buffers.items()
                      if b is not None] if replicas > 1 else []
        self.states: list[dict[int, torch.Tensor]] = [{}]
        for _ in range(1, replicas):
            copies: dict[int, torch.Tensor] = {}  # by the original's id: a buffer two modules share stays shared
            for module, name in self.slots:
                original = module._buffers[name]
                assert original is not None
                copies.setdefault(id(original), original.detach().clone())
            self.states.append(copies)
        self.held = [id(module._buffers[name]) for module, name in self.slots]  # each slot's key in a state

    @contextlib.contextmanager
    def of(self, replica: int) -> Iterator[None]:
        """Replica ``replica``'s buffers in the model while the block runs (the block may replace them)."""
        if replica == 0 or not self.slots:
            yield
            return
        own = [module._buffers[name] for module, name in self.slots]
        for (module, name), key in zip(self.slots, self.held):
            module._buffers[name] = self.states[replica][key]
        try:
            yield
        finally:
            for i, (module, name) in enumerate(self.slots):
                value = module._buffers[name]
                assert value is not None
                self.states[replica][self.held[i]] = value  # a buffer two modules share: the last one wins
                module._buffers[name] = own[i]


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` as it is now (its parameters, buffers and train/eval mode)."""
    return cast_module(copy.deepcopy(model), torch.float64)


def cast_batches(batches: list[Inputs], targets: list[Any], dtype: torch.dtype) -> tuple[list[Inputs], list[Any]]:
    """The batches and targets with their floating tensors in ``dtype`` (copies)."""
    cast = []
    for inputs in batches:
        fresh = inputs.unspoiled()  # never the copy eager wrote into; a copy each run can take again
        source = cast_inputs((fresh.args, fresh.kwargs, fresh.target), dtype, None, copy=True)
        cast.append(_copied(source, inputs.signature, dtype, None))
    return cast, [cast_inputs(target, dtype, None, copy=True) for target in targets]
