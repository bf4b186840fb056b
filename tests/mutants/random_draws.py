"""A small GPipe engine that keeps pipecheck's randomness contract with public API only, and its planted bugs.

    pc.assert_equivalent(make_dropout_net, (x,), n_microbatches=4, runner=DrawingEngine(recompute=True), steps=2)

Every stage's forward of micro-batch j runs inside ``pc.randomness.drawing(job.random_seed, stage=s,
microbatch=j, step=t, schedule_step=a)``, optionally under activation checkpointing
(``torch.utils.checkpoint``), one autograd graph per micro-batch across the stages. The bugs are the two
that real engines shipped: a recompute that does not restore the RNG state (``preserve_rng_state=False``)
and masks drawn for another micro-batch than the one computed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

import pipecheck as pc


class DrawingEngine:
    """``recompute``: each stage's forward checkpointed (its recompute in backward); ``preserve_rng_state``:
    what the checkpoint is told; ``shift``: micro-batch j draws micro-batch (j + shift) % n's numbers."""

    follows_random_contract = True

    def __init__(self, recompute: bool = False, preserve_rng_state: bool = True, shift: int = 0) -> None:
        self.recompute, self.preserve_rng_state, self.shift = recompute, preserve_rng_state, shift
        self.__name__ = f"drawing-engine(recompute={recompute}, preserve_rng_state={preserve_rng_state}, " \
                        f"shift={shift})"

    def __call__(self, job: pc.Job) -> pc.StepResult:
        return self.train(job)[0]

    def train(self, job: pc.Job) -> list[pc.StepResult]:
        if job.training.optimizer is not None or job.training.data_parallel != 1:
            raise pc.InputError("this test engine runs steps without an optimizer, one replica")
        pipe = job.split()
        results = []
        for t, batches in enumerate(job.optimizer_steps()):
            grads: dict[str, torch.Tensor] = {}
            outputs, losses = [], []
            for a, batch in enumerate(batches):
                out, loss = self._schedule_step(job, pipe, batch, t, a, grads)
                outputs.append(out)
                losses.append(loss)
            results.append(pc.StepResult(outputs[0] if len(outputs) == 1 else tuple(outputs),
                                         torch.stack(losses).sum(), grads))
        return results

    def _schedule_step(self, job: pc.Job, pipe: pc.Pipe, batch: Any, t: int, a: int,
                       grads: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        n = job.n_microbatches
        bound = pipe.bind_inputs(tuple(batch.args), dict(batch.kwargs))
        chunks = pc.split_microbatches(bound, n)
        targets = pc.split_microbatches(batch.target, n, "target")
        outputs, losses = [], []
        for j, (values, target) in enumerate(zip(chunks, targets)):
            produced: dict[tuple[int | None, str], Any] = {(None, k): v for k, v in values.items()}
            out: Any = ()
            for stage in pipe.stages:  # the last stage returns the model's output leaves
                inputs = [produced[(src.stage, src.name)] for src in stage.inputs]
                with pc.randomness.drawing(job.random_seed or 0, stage=stage.index, microbatch=(j + self.shift) % n,
                                           step=t, schedule_step=a):
                    if self.recompute:
                        out = checkpoint(stage.module, *inputs, use_reentrant=False,
                                         preserve_rng_state=self.preserve_rng_state)
                    else:
                        out = stage.module(*inputs)
                produced.update(((stage.index, name), value) for name, value in zip(stage.outputs, out))
            output = pytree.tree_unflatten(list(out), pipe.out_spec)
            loss = job.loss_fn(output, target) / n  # type: ignore[misc]
            params = [(fqn, p) for stage in pipe.stages for local, p in stage.module.named_parameters()
                      for fqn in [stage.local_to_fqn[local]] if p.requires_grad]
            got = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            for (fqn, _), grad in zip(params, got):
                if grad is not None:
                    grads[fqn] = grads[fqn] + grad if fqn in grads else grad
            outputs.append(pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, output))
            losses.append(loss.detach() * n)
        return pc.merge_microbatches(outputs), torch.stack(losses).mean()


def shifted_torch_rank_train(ctx: Any, spec: Any) -> Any:
    """runner='torch''s ranks with one bug planted: torch's forward of micro-batch m draws micro-batch
    (m + 1) % n's numbers (the position handed to pc.randomness.drawing is off by one)."""
    # private: the rank side of runner='torch', its call of pc.randomness.drawing shifted on this rank only
    from pipecheck._runners.torch_pipelining import randomness
    from pipecheck._runners.torch_pipelining.train import torch_rank_train

    drawing, n = randomness.drawing, spec.step.n_microbatches

    def shifted(seed: int, *, stage: int, microbatch: int, **position: int) -> Any:
        return drawing(seed, stage=stage, microbatch=(microbatch + 1) % n, **position)

    randomness.drawing = shifted  # type: ignore[assignment]
    try:
        return torch_rank_train(ctx, spec)
    finally:
        randomness.drawing = drawing  # the World's ranks outlive this check


def shifted_torch_runner() -> Any:
    """runner='torch' whose ranks run :func:`shifted_torch_rank_train`."""
    # private: runner='torch' itself, subclassed to plant the bug on its ranks
    from pipecheck._runners.torch_pipelining.driver import TorchRunner

    class ShiftedTorchDraws(TorchRunner):
        rank_train = staticmethod(shifted_torch_rank_train)

    return ShiftedTorchDraws()
