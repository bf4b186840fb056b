"""Hints for a failing check of a model with random ops: which micro-batch's numbers a runner drew.

    hint = wrong_draws_hint(job, t, outputs, start)   # "micro-batch 0 drew micro-batch 1's random numbers ..."

Computed only on failure (a what-if of the reference, one micro-batch forward per candidate), never
changing a verdict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecheck._check.diagnose import matches
from pipecheck._check.train_locate import pipe_at
from pipecheck._core.result import StepResult
from pipecheck._runners.job import Job
from pipecheck._runtime.randomness import microbatch, schedule_step
from pipecheck._runtime.reference import DetachExecutor
from pipecheck._split.inputs import as_args
from pipecheck._split.microbatch import split_microbatches

MAX_MICROBATCHES = 8  # n * n forwards of one micro-batch at most: beyond, no hint


def wrong_draws_hint(job: Job, step: int, outputs: Any, start: StepResult | None) -> str | None:
    """Whether the runner's outputs of optimizer step ``step``'s first schedule step are, micro-batch by
    micro-batch, the reference's forward under another micro-batch's draws. ``start``: eager's state the
    step started from (None: as built)."""
    n, seed = job.n_microbatches, job.training.random_seed
    if seed is None or n < 2 or n > MAX_MICROBATCHES or job.training.data_parallel != 1:
        return None
    batch = job.optimizer_steps()[step][0]
    pipe = pipe_at(job, start)
    executor = DetachExecutor(pipe)
    chunks = split_microbatches(pipe.bind_inputs(as_args(batch.args), dict(batch.kwargs)), n)
    leaves = [leaf for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
    tested = [split_microbatches(leaf, n) for leaf in leaves]

    def forward(j: int, drawn_as: int) -> list[torch.Tensor]:
        with torch.no_grad(), pipe.buffers_restored(), schedule_step(seed, step, 0), microbatch(drawn_as):
            last = executor.forward_microbatch(chunks[j])[-1]
        return [leaf for leaf in pytree.tree_leaves(last.outputs) if isinstance(leaf, torch.Tensor)]

    def same(j: int, got: list[torch.Tensor]) -> bool:
        return len(got) == len(tested) and all(matches(test[j], value) for test, value in zip(tested, got))

    drew: dict[int, int] = {}
    for j in range(n):
        if same(j, forward(j, j)):
            continue
        found = next((k for k in range(n) if k != j and same(j, forward(j, k))), None)
        if found is None:
            return None  # not a micro-batch mix-up
        drew[j] = found
    if not drew:
        return None
    said = ", ".join(f"micro-batch {j} drew micro-batch {k}'s" for j, k in sorted(drew.items()))
    return (f"{said} random numbers: its outputs are the reference's forward of it under that micro-batch's draws "
            "(pipecheck's randomness contract). The engine passes another micro-batch's number to "
            "pc.randomness.drawing, or numbers micro-batches otherwise than in the batch's order")
