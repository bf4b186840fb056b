"""pipecheck's randomness contract: how an engine draws random numbers so that a check can replay them.

    import pipecheck as pc

    def forward(stage, module, inputs, microbatch, job, step=0, schedule_step=0):   # in an engine's process
        with pc.randomness.drawing(job.random_seed, stage=stage, microbatch=microbatch,
                                   step=step, schedule_step=schedule_step):
            return module(*inputs)            # dropout, F.dropout, SDPA's dropout_p, stochastic depth, torch.rand

The contract, for a check of a model with random ops in train mode:

- Stage s's forward of micro-batch m, in schedule step a of optimizer step t, draws its random numbers
  from torch's own generators (the CPU one, and the current CUDA device's), seeded on entry with
  ``seed_of(job.random_seed, step=t, schedule_step=a, stage=s, microbatch=m)``. Micro-batches are
  numbered across data-parallel replicas: replica r's j-th of n is r * n + j. :func:`drawing` does
  exactly this and puts the generators back as it found them on exit.
- A recompute of a stage's forward (activation checkpointing) draws the same numbers as the forward:
  ``torch.utils.checkpoint.checkpoint`` does with its default ``preserve_rng_state=True``; an engine
  that recomputes a whole stage enters :func:`drawing` again with the same position.
- Ops that draw from a generator of the model's own (``generator=`` argument), Python's ``random`` or
  NumPy are outside the contract: such a model is refused, never compared.

pipecheck's eager run and its float64 truth draw exactly what a stage following the contract draws
(pipecheck records the stages' draws and replays them into the eager model), so an engine that keeps
the contract matches, and one that recomputes without restoring the RNG state, or draws micro-batch
m's numbers for another micro-batch, fails where it happens. A runner says it follows the contract with
the attribute ``follows_random_contract = True``; pipecheck's ``"reference"``, ``"distributed"`` and
``"torch"`` runners do (``"torch"`` once torch's own split is seen to draw what pipecheck's split draws).
"""

from __future__ import annotations

from pipecheck._runtime.randomness import drawing, seed_of

__all__ = ["drawing", "seed_of"]
