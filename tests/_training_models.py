"""Models, losses and engines for the training checks: correct trainers and their planted bugs.

Top-level so that they pickle to a World's ranks. ``Trainer(bug)`` is an engine of a user's kind,
written on public names only (``pc.DetachExecutor``, ``job.split()``, ``pc.losses.Reduction``): with
``bug=None`` it trains correctly; each bug is one that engines shipped.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecheck as pc
from pipecheck.losses import Reduction

VOCAB = 11


class TiedLM(nn.Module):
    """Embedding tied to the output projection, cut in two: the tied weight lives on both stages."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(x)))
        pc.pipe_split()
        return torch.tanh(self.l2(h)) @ self.emb.weight.T


def make_tied_lm() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def make_frozen_lm() -> TiedLM:
    """TiedLM with its first layer frozen (``requires_grad=False``), as in fine-tuning."""
    model = make_tied_lm()
    model.l1.requires_grad_(False)
    return model


class UntiedLM(TiedLM):
    """TiedLM with an output projection of its own."""

    def __init__(self, d: int = 8) -> None:
        super().__init__(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(x)))
        pc.pipe_split()
        return self.head(torch.tanh(self.l2(h)))


def make_untied_lm() -> UntiedLM:
    torch.manual_seed(0)
    return UntiedLM()


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Every token's loss (reduction='none'); ignore_index -100 gives 0 there."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.5)


def adamw(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=1e-2)


def momentum(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def tokens(batch: int = 8, seq: int = 5, seed: int = 0, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels, the first ``pad`` labels of each of the first half of rows ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y[: batch // 2, :pad] = -100
    return x, y


BUGS = ("grads_not_zeroed", "replica_not_stepped", "mean_of_means", "rescaled_each_step", "clip_counts_replicas",
        "dp_replica_not_reduced", "dp_not_averaged", "trains_frozen")


class Trainer:
    """A user's engine: the job's split run stage by stage, each stage's copy of a tied weight its own
    parameter (as on separate ranks), gradients summed across them, one optimizer over every copy."""

    def __init__(self, bug: str | None = None) -> None:
        assert bug is None or bug in BUGS
        self.bug = bug
        self.__name__ = f"trainer[{bug or 'correct'}]"

    def __call__(self, job: pc.Job) -> pc.StepResult:
        raise NotImplementedError("one-call use is not what these tests exercise")

    def train(self, job: pc.Job) -> list[pc.StepResult]:
        d = job.training.data_parallel
        replicas = [self._own_copies(job.split()) for _ in range(d)]  # (pipe, fqn -> stage -> parameter) each
        if self.bug == "trains_frozen":  # an engine that sets requires_grad on every parameter it wraps
            for _, copies in replicas:
                for by_stage in copies.values():
                    for param in by_stage.values():
                        param.requires_grad_(True)
        optimizers = [job.training.optimizer([p for fqn, by_stage in copies.items() for s, p in by_stage.items()
                                              if not (self.bug == "replica_not_stepped" and s > min(by_stage))])
                      if job.training.optimizer else None for _, copies in replicas]
        carried: list[dict[str, torch.Tensor]] = [{} for _ in range(d)]
        results = []
        for batches in job.optimizer_steps():
            grads = [dict(c) if self.bug == "grads_not_zeroed" else {} for c in carried]
            outputs, losses = [], []
            loss_fn, reduction = self._loss(job, batches)
            for batch in batches:
                shards = _shards((batch.args, dict(batch.kwargs), batch.target), d)
                replica_outputs = []
                for r, ((pipe, _), (args, kwargs, target)) in enumerate(zip(replicas, shards)):
                    step = pc.DetachExecutor(pipe).step(args, kwargs, loss_fn=loss_fn, target=target,
                                                        n_microbatches=job.n_microbatches, reduction=reduction)
                    for fqn, grad in step.grads.items():
                        if self.bug == "rescaled_each_step":
                            grad = grad / len(batches)
                        grads[r][fqn] = grads[r][fqn] + grad if fqn in grads[r] else grad
                    replica_outputs.append(step.outputs)
                    losses.append(step.loss)
                outputs.append(pc.merge_microbatches(replica_outputs))
            carried = grads
            total = {fqn: sum((g[fqn] for g in grads[1:]), grads[0][fqn]) for fqn in grads[0]}  # the DP all-reduce
            reduced = [total] + [grads[r] if self.bug == "dp_replica_not_reduced" else total for r in range(1, d)]
            for (_, copies), optimizer, replica_grads in zip(replicas, optimizers, reduced):
                if optimizer is not None:
                    self._step(optimizer, copies, replica_grads, job.training.clip_grad_norm)
            copies = replicas[0][1]
            result = pc.StepResult(
                outputs[0] if len(outputs) == 1 else tuple(outputs), torch.stack(losses).sum(),
                {f: g.clone() for f, g in total.items()},
                params={fqn: by_stage[min(by_stage)].detach().clone() for fqn, by_stage in copies.items()},
                replica_params={fqn: {s: p.detach().clone() for s, p in by_stage.items()}
                                for fqn, by_stage in copies.items() if len(by_stage) > 1})
            for r in range(1, d):
                for fqn, by_stage in replicas[r][1].items():
                    for stage, param in by_stage.items():
                        result.dp_grads.setdefault(fqn, {})[(r, stage)] = reduced[r][fqn].clone()
                        result.dp_params.setdefault(fqn, {})[(r, stage)] = param.detach().clone()
            results.append(result)
        return results

    def _loss(self, job: pc.Job, batches: list[pc.Batch]):  # type: ignore[no-untyped-def]
        training = job.training
        if self.bug == "mean_of_means" and training.loss_reduction == "token_mean":
            # each micro-batch normalised by its own valid tokens, then the mean of those means
            def per_microbatch(out, target):  # type: ignore[no-untyped-def]
                return job.loss_fn(out, target).sum() / (target != training.ignore_index).sum()
            return per_microbatch, Reduction(1.0 / (job.n_microbatches * training.data_parallel * len(batches)),
                                             uneven=True)
        replicas = 1 if self.bug == "dp_not_averaged" else training.data_parallel  # DDP's sum, not its mean
        return job.loss_fn, Reduction.of(training.loss_reduction, [b.target for b in batches],
                                         job.n_microbatches * replicas, training.ignore_index)

    def _own_copies(self, pipe: pc.Pipe) -> tuple[pc.Pipe, dict[str, dict[int, nn.Parameter]]]:
        copies: dict[str, dict[int, nn.Parameter]] = {}
        for stage in pipe.stages:
            for local, fqn in stage.local_to_fqn.items():
                owner, _, name = local.rpartition(".")
                module = stage.module.get_submodule(owner)
                param = module._parameters[name]
                if fqn in copies:  # another stage's copy: a parameter of this stage's own
                    param = nn.Parameter(param.detach().clone())
                    module._parameters[name] = param
                copies.setdefault(fqn, {})[stage.index] = param
        return pipe, copies

    def _step(self, optimizer: torch.optim.Optimizer, copies: dict[str, dict[int, nn.Parameter]],
              grads: dict[str, torch.Tensor], clip: float | None) -> None:
        for fqn, by_stage in copies.items():
            for param in by_stage.values():
                param.grad = grads[fqn].clone() if fqn in grads else None
        if clip is not None:
            counted = [by_stage[min(by_stage)] for by_stage in copies.values()] if self.bug != "clip_counts_replicas" \
                else [p for by_stage in copies.values() for p in by_stage.values()]
            norm = torch.stack([p.grad.norm() for p in counted if p.grad is not None]).norm()
            scale = (clip / (norm + 1e-6)).clamp(max=1.0)
            for by_stage in copies.values():
                for param in by_stage.values():
                    if param.grad is not None:
                        param.grad.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _shards(batch: tuple, d: int) -> list[tuple]:  # type: ignore[type-arg]
    """The batch cut on dim 0 into ``d`` data-parallel shards (every tensor leaf has the batch dimension)."""
    if d == 1:
        return [batch]
    return pc.split_microbatches(batch, d)


class DropoutNet(nn.Module):
    """Dropout on both stages, a channel dropout, and activation checkpointing around one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.d0 = nn.Dropout(0.3)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.4), nn.Tanh())
        self.d1 = nn.Dropout1d(0.2)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.d0(torch.tanh(self.l0(x)))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        pc.pipe_split()
        return self.l2(self.d1(h.unsqueeze(-1)).squeeze(-1))


def make_dropout_net() -> DropoutNet:
    torch.manual_seed(0)
    return DropoutNet()


class FreshRecompute:
    """An engine that recomputes each non-last stage's forward for its backward (activation recomputation)
    and, the bug, draws fresh dropout masks there: its outputs and loss are right, its gradients not."""

    __name__ = "fresh-recompute"
    follows_random_contract = True

    def __call__(self, job: pc.Job) -> pc.StepResult:
        raise NotImplementedError

    def train(self, job: pc.Job) -> list[pc.StepResult]:
        import dataclasses

        # private: the position contexts pipecheck's own runners draw under (pc.randomness.drawing inside)
        from pipecheck._runtime.randomness import schedule_step

        class Recomputing(pc.DetachExecutor):
            def backward_microbatch(self, mb, forwards, *rest):  # type: ignore[no-untyped-def]
                # the bug: the recompute draws from torch's RNG as it is now, not inside pc.randomness.drawing
                forwards = [dataclasses.replace(fwd, outputs=tuple(stage.module(*fwd.inputs)))
                            if stage.index < len(forwards) - 1 else fwd
                            for stage, fwd in zip(self.pipe.stages, forwards)]
                return super().backward_microbatch(mb, forwards, *rest)

        pipe = job.split()
        results = []
        for t, batches in enumerate(job.optimizer_steps()):
            reduction = Reduction.of(job.training.loss_reduction, [b.target for b in batches], job.n_microbatches)
            for a, batch in enumerate(batches):
                with schedule_step(job.training.random_seed or 0, t, a):
                    results.append(Recomputing(pipe).step(batch.args, batch.kwargs, loss_fn=job.loss_fn,
                                                          target=batch.target, n_microbatches=job.n_microbatches,
                                                          reduction=reduction))
        return results


class GainBeforeBatchNorm(nn.Module):
    """A scalar gain before BatchNorm: its true gradient cancels to rounding noise (scale invariance), and
    after the first optimizer step every correct engine's noise there is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.s = nn.Parameter(torch.ones(()))
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.s * self.a(x))
        pc.pipe_split()
        return self.b(torch.tanh(h))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def lbfgs(params):  # type: ignore[no-untyped-def]
    return torch.optim.LBFGS(params)


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.a(x)
        pc.pipe_split()
        return self.b(torch.tanh(h))


class FrontLoaded(nn.Module):
    """Every parameter on stage 0, stage 1 only computes: a gradient norm over stage 0 is the whole model's."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.l1 = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(torch.tanh(self.emb(x)))
        pc.pipe_split()
        return torch.tanh(h) * 2.0


def make_front_loaded() -> FrontLoaded:
    torch.manual_seed(0)
    return FrontLoaded()


def own_token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One micro-batch's mean over its own valid tokens (labels -100 ignored): the token mean of means's
    per-micro-batch loss (a planted bug where the job asks the global token mean)."""
    return token_ce(logits, labels).sum() / (labels != -100).sum()
