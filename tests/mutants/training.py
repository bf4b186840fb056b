"""A correct training runner, and mutants of it that plant ONE bug a training check must locate.

    runner = TRAINING_MUTANTS["token_mean_of_means"]
    pc.assert_equivalent(make_untied_lm, (x,), runner=runner, loss_fn=token_ce, target=y, steps=2,
                         optimizer=sgd, loss_reduction="token_mean", n_microbatches=4)
    # EquivalenceError: step 0, within it stage 1 received the gradient of 'output' in the backward,
    # with the per-micro-batch weights the gradients are fitted with

:class:`TrainingRunner` keeps the job's split (``job.split()``, so a check's re-run records its boundary
values) and one optimizer from step to step. Each schedule step runs every micro-batch's forward, stage
by stage, then every micro-batch's backward, last stage first, with pipecheck's ``stage_forward`` and
``stage_backward``. What an engine decides is one method (each micro-batch's loss; what a stage gets
for a value it receives; the gradient a producer gets back); a mutant overrides one of them, and its
correct twin is the base runner on the same job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from _training_models import own_token_mean

import pipecheck as pc
from pipecheck import Job, Stage, StepResult, merge_microbatches, split_microbatches

# private: the distributed runtime's runner, wrapped; planted bugs change one decision of the runtime's
# own stage steps
from pipecheck._runners.registry import runner_named
from pipecheck._runtime.stage_step import (
    LeafGrads,
    StageForward,
    add_leaf_grads,
    stage_backward,
    stage_forward,
)
from pipecheck.losses import MicrobatchLoss, Reduction


class TrainingRunner:
    """The correct training runner (no bug). Subclasses override one step."""

    name: ClassVar[str] = "training_base"
    bug: ClassVar[str] = "none: the correct training runner"

    @property
    def __name__(self) -> str:  # how assert_equivalent names the runner in its report
        return f"mutant:{self.name}"

    def __call__(self, job: Job) -> StepResult:
        raise NotImplementedError("a training runner: the check calls train(job)")

    # --- the decisions an engine owns; a mutant overrides one ----------------------------------------

    def loss(self, job: Job, batches: list[pc.Batch]) -> tuple[Any, Reduction]:
        """Each micro-batch's loss function and the weight its loss gets, from the job's convention."""
        training = job.training
        return job.loss_fn, Reduction.of(training.loss_reduction, [b.target for b in batches], job.n_microbatches,
                                         training.ignore_index)

    def receive(self, stage: Stage, values: list[Any], mb: int) -> StageForward:
        """Stage ``stage``'s forward of micro-batch ``mb`` on what it received (detached: its own graph)."""
        return stage_forward(stage, values)

    def sent_back(self, stage: Stage, fwd: StageForward, in_grads: list[LeafGrads], mb: int
                  ) -> list[LeafGrads | None]:
        """The gradients the stage's producers get back for its inputs (what its backward computed; None:
        nothing)."""
        return in_grads

    def merge(self, outputs: list[Any]) -> Any:
        """A schedule step's micro-batch outputs merged into its batch's, in micro-batch order."""
        return merge_microbatches(outputs)

    # --- the loop ---------------------------------------------------------------------------------------

    def train(self, job: Job) -> list[StepResult]:
        pipe = job.split()  # kept from step to step; records its boundary values when the check asks
        params: dict[str, torch.nn.Parameter] = {}
        for stage in pipe.stages:
            for local, param in stage.module.named_parameters(remove_duplicate=False):
                if param.requires_grad and local in stage.local_to_fqn:
                    params.setdefault(stage.local_to_fqn[local], param)
        optimizer = job.training.optimizer(list(params.values())) if job.training.optimizer else None
        results = []
        for batches in job.optimizer_steps():
            loss_fn, reduction = self.loss(job, batches)
            grads: dict[str, torch.Tensor] = {}
            outputs, losses = [], []
            for batch in batches:
                out, loss, step_grads = self._schedule_step(job, pipe.stages, batch, loss_fn, reduction)
                for fqn, grad in step_grads.items():
                    grads[fqn] = grads[fqn] + grad if fqn in grads else grad
                outputs.append(out)
                losses.append(loss)
            if optimizer is not None:
                for fqn, param in params.items():
                    param.grad = grads[fqn].clone() if fqn in grads else None
                if job.training.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(list(params.values()), job.training.clip_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            results.append(StepResult(
                outputs[0] if len(outputs) == 1 else tuple(outputs), torch.stack(losses).sum(),
                {fqn: grad.clone() for fqn, grad in grads.items()}, buffers=pipe.buffers_after_step(),
                params={fqn: p.detach().clone() for stage in pipe.stages
                        for local, p in stage.module.named_parameters(remove_duplicate=False)
                        for fqn in [stage.local_to_fqn.get(local)] if fqn is not None}))
        return results

    def _schedule_step(self, job: Job, stages: list[Stage], batch: pc.Batch, loss_fn: Any, reduction: Reduction
                       ) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
        n = job.n_microbatches
        pipe_inputs = split_microbatches(job.structure().bind_inputs(batch.args, batch.kwargs), n,
                                         uneven=reduction.uneven)
        loss_of = MicrobatchLoss(loss_fn, batch.target, n, reduction)
        forwards: dict[tuple[int, int], StageForward] = {}
        outputs, losses = [], []
        for mb in range(n):
            produced: dict[tuple[int | None, str], Any] = {(None, k): v for k, v in pipe_inputs[mb].items()}
            for stage in stages:
                fwd = self.receive(stage, [produced[(src.stage, src.name)] for src in stage.inputs], mb)
                forwards[(stage.index, mb)] = fwd
                produced.update(((stage.index, name), v) for name, v in zip(stage.outputs, fwd.outputs))
            out = pytree.tree_unflatten(list(forwards[(len(stages) - 1, mb)].outputs), job.structure().out_spec)
            outputs.append(pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out))
            losses.append(loss_of(mb, out))
        grads: dict[str, torch.Tensor] = {}
        for mb in range(n):
            pending: dict[tuple[int, str], LeafGrads | None] = {}
            for stage in reversed(stages):
                fwd = forwards.pop((stage.index, mb))
                last = stage.index == len(stages) - 1
                out_grads = [pending.pop((stage.index, name), None) for name in stage.outputs]
                in_grads, p_grads = stage_backward(stage, fwd, out_grads, losses[mb] if last else None,
                                                   reduction.weight)
                for fqn, grad in p_grads.items():
                    grads[fqn] = grads[fqn] + grad if fqn in grads else grad
                for src, sent in zip(stage.inputs, self.sent_back(stage, fwd, in_grads, mb)):
                    if src.stage is not None and sent is not None:  # None: nothing sent back
                        pending[(src.stage, src.name)] = add_leaf_grads(pending.get((src.stage, src.name)), sent)
        loss = torch.stack([value.detach() for value in losses]).sum() * reduction.weight
        return self.merge(outputs), loss, grads


class TokenMeanOfMeans(TrainingRunner):
    """The engine promised the global token mean (loss_reduction="token_mean": every valid token of the
    optimizer step counts once) and computes each micro-batch's mean over its own valid tokens, divided
    by the micro-batch count: micro-batches with few valid tokens weigh more."""

    name = "token_mean_of_means"
    bug = "each micro-batch's mean over its own valid tokens, divided by n, where the job asks the global token mean"

    def loss(self, job: Job, batches: list[pc.Batch]) -> tuple[Any, Reduction]:
        ignore = job.training.ignore_index
        token_losses = job.loss_fn
        assert token_losses is not None

        def own_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return token_losses(out, target).sum() / (target != ignore).sum()

        return own_mean, Reduction(1.0 / (job.n_microbatches * len(batches)), uneven=True)


class PersistentRecvBuffer(TrainingRunner):
    """Stage 1 receives each micro-batch's activations into a receive buffer the engine allocates once
    and keeps from optimizer step to optimizer step; the stage's forward reads the buffer itself, and a
    gradient hook registered on it at every forward sends its gradient back to stage 0. The hooks are
    never removed: on the second optimizer step the first step's hook fires again, so stage 0 gets every
    gradient twice (step 0 matches; step 1 does not)."""

    name = "persistent_recv_buffer"
    bug = "stage 1's persistent receive buffer keeps the gradient hook of every step: it fires again on the next"
    STAGE: ClassVar[int] = 1

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed  # the twin: each hook removed once it has fired
        self.buffers: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.outbox: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        self.hooks: dict[tuple[int, int], list[Any]] = {}

    @property
    def __name__(self) -> str:
        return f"{'twin' if self.fixed else 'mutant'}:{self.name}"

    def train(self, job: Job) -> list[StepResult]:
        self.buffers, self.outbox, self.hooks = {}, {}, {}  # a fresh engine per training run
        return super().train(job)

    def receive(self, stage: Stage, values: list[Any], mb: int) -> StageForward:
        if stage.index != self.STAGE:
            return super().receive(stage, values, mb)
        key = (stage.index, mb)
        if key not in self.buffers:  # allocated once, on the first optimizer step
            self.buffers[key] = [torch.zeros_like(v).requires_grad_(v.requires_grad) for v in values]
        held = self.buffers[key]
        self.outbox[key] = []
        for i, (buffer, value) in enumerate(zip(held, values)):
            with torch.no_grad():
                buffer.copy_(value)
            if buffer.requires_grad:  # the bug: one more hook each step, none removed
                self.hooks.setdefault(key, []).append(
                    buffer.register_hook(lambda grad, key=key, i=i: self.outbox[key].append((i, grad))))
        return StageForward(list(held), tuple(stage.module(*held)))

    def sent_back(self, stage: Stage, fwd: StageForward, in_grads: list[LeafGrads], mb: int
                  ) -> list[LeafGrads | None]:
        if stage.index != self.STAGE:
            return in_grads
        sent: list[LeafGrads | None] = [[None] for _ in in_grads]
        for i, grad in self.outbox.pop((stage.index, mb), []):  # what the hooks posted
            sent[i] = [grad if sent[i][0] is None else sent[i][0] + grad]
        if self.fixed:
            for handle in self.hooks.pop((stage.index, mb), []):
                handle.remove()
        return sent


class DistributedTokenMeanOfMeans:
    """pipecheck's distributed runtime trained on each micro-batch's own token mean, weighted 1/n (the mean
    of micro-batch losses), where the job asks the global token mean: the token mean of means, on a World.
    ``fixed``: the twin, the runtime on the job as given."""

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed
        self.__name__ = "distributed" if fixed else "mutant:distributed_token_mean_of_means"
        self.runtime = runner_named("distributed").load()  # type: ignore[union-attr]

    def __call__(self, job: Job) -> StepResult:
        raise NotImplementedError("a training runner: the check calls train(job)")

    def train(self, job: Job) -> list[StepResult]:
        if not self.fixed:
            job = dataclasses.replace(job, loss_fn=own_token_mean,
                                      training=dataclasses.replace(job.training, loss_reduction="mean"))
        return self.runtime.train(job)


TRAINING_MUTANTS: dict[str, TrainingRunner] = {t.name: t() for t in (TokenMeanOfMeans, PersistentRecvBuffer)}
