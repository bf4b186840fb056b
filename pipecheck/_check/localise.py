"""Where a failing check first went wrong: its runner's boundary values against the reference's.

    reference = ReferenceByMicrobatch(job)       # shared with the weight-fitting hint
    divergence, line = locate(fresh_job, run, "mutant:skip_wrong_microbatch", {"outputs", "grads"}, reference)
    divergence.stage, divergence.microbatches, divergence.direction   # 2, (0, 1, 2, 3), "forward"

Only after a failure: the job runs once more through the reference (micro-batch by micro-batch) and
once more through the runner, both with ``job.boundaries`` set, so every stage module of
``job.split()`` records what it received and sent. A runner that cuts the model itself (torch's
pipelining, torchtitan, a DeepSpeed layer list) records its own stage modules, and its truth is its own
split run in this process: ``run.reference_boundaries(job) -> (Boundaries, producers)`` where the
runner has it (torch's by name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

import torch

from pipecheck._core.result import StepResult
from pipecheck._runners.job import Job, Runner
from pipecheck._runtime.boundaries import (
    Boundaries,
    Divergence,
    first_divergence,
    overwritten_text,
    producers_of,
    recording,
)
from pipecheck._runtime.reference import DetachExecutor
from pipecheck._runtime.stage_recorder import swapped_note
from pipecheck.errors import RankError, RankFailedError, RecordingError, plural


def not_located(why: str, err: BaseException) -> str:
    """The report's one line when locating failed: why, and the error's first line (cut short)."""
    first = (str(err).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"the divergence was not located: {why} ({type(err).__name__}: {first})"


class ReferenceByMicrobatch:
    """One reference run of a failing job, made on first use: each micro-batch's own share of the
    parameter gradients (what the weight-fitting hint reads) and, recorded on the way, the boundary
    values a runner's are lined up with."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._made: tuple[list[dict[str, torch.Tensor]], Boundaries] | None = None

    def get(self) -> tuple[list[dict[str, torch.Tensor]], Boundaries]:
        if self._made is None:
            job, truth = self.job, Boundaries()
            # the check's own split, its buffers put back after (a run changes only buffers): no copy to make
            with job.structure().buffers_restored() as pipe, recording(pipe, truth):
                shares = DetachExecutor(pipe, precision=job.precision).microbatch_grads(job.args, job.kwargs, loss_fn=job.loss_fn,
                                                               target=job.target, n_microbatches=job.n_microbatches)
            self._made = shares, truth
        return self._made


def locate(fresh_job: Callable[[], Job], run: Runner, runner_name: str, failing_kinds: Collection[str],
           reference: ReferenceByMicrobatch | None = None) -> tuple[Divergence | None, str]:
    """The first divergent boundary value (or None) and a line for the report; ``failing_kinds``:
    which of "outputs", "loss", "buffers", "grads" have failing rows."""
    job = fresh_job()
    own_split = getattr(run, "reference_boundaries", None)
    if own_split is not None:  # the runner cuts and names the values itself: its own split, run here, is the truth
        try:
            truth, producers = own_split(job)
        except Exception as err:
            return None, not_located(f"runner {runner_name!r}'s own split could not be run here", err)
        job = fresh_job()
    else:
        _, truth = (reference or ReferenceByMicrobatch(job)).get()
        producers = producers_of(job.structure())
        job = fresh_job()
    # the reference's shapes: what a StageRecorder checks the engine's values against
    recorded = Boundaries(shapes={key: tuple(value.shape) for key, value in truth.values.items()})
    try:
        result = run(dataclasses.replace(job, boundaries=recorded, trace_path=None))  # the user's trace is the check's
    except Exception as err:  # the verdict stands; only the diagnosis is lost
        return None, _recording_failed(err)
    if isinstance(result, StepResult) and result.boundaries:  # recorded on other processes
        recorded.imported(result.boundaries)
    values = recorded.values
    if not values:
        return None, ("the divergence was not located: the runner recorded no boundary values (run the stage modules "
                      "of job.split(), or record them with job.recorder(stage) and return job.recorded(recorders) "
                      "in StepResult.boundaries)")
    found, scale = first_divergence(values, truth.values, job.n_microbatches, job.structure().num_stages, producers)
    found, line = _said(found, scale, recorded, len(truth.values), failing_kinds,
                        runner_name if own_split is not None else None)
    return found, line + (swapped_note(values, truth.values, found) if found is not None else "")


def _recording_failed(err: BaseException) -> str:
    """The line for a runner that raised on its second run; an engine's recording mistake in full (the
    positions it lists are the fix), on this process or on one of the engine's ranks."""
    if isinstance(err, RecordingError):
        return f"the divergence was not located: the runner's recording does not fit pipecheck's split: {err}"
    cause = getattr(err, "error", None)
    if isinstance(err, RankFailedError) and isinstance(cause, RankError) and cause.exc_type.endswith("RecordingError"):
        return (f"the divergence was not located: rank {cause.rank}'s recording does not fit pipecheck's split: "
                f"{cause.message}")
    return not_located("running the job again to record it failed", err)


def _said(found: Divergence | None, scale: float, recorded: Boundaries, counted: int,
          failing_kinds: Collection[str], own_split: str | None = None) -> tuple[Divergence | None, str]:
    """The report's line; ``own_split``: the runner whose own split, run in this process, was the truth."""
    scaled = (f"; every gradient crossing a stage is {scale:.4g} times the reference's: the loss is scaled by "
              f"{scale:.4g}, which the parameter gradients must undo" if scale != 1.0 else "")
    if found is not None:
        return found, found.text() + (f" (backward compared up to its one factor {scale:.4g})" if scale != 1.0 else "")
    if recorded.overwritten:
        return None, overwritten_text(recorded.overwritten)
    values_said = plural(counted, "value")
    causes = []
    if "outputs" in failing_kinds or "loss" in failing_kinds:
        causes.append("the outputs or the loss are wrong although the last stage computed them right: the bug is in "
                      "how the engine merges the micro-batches' outputs or computes the loss from them")
    if "grads" in failing_kinds:
        causes.append("the bug is in how the engine handles gradients after computing them (accumulation, scaling, "
                      "reduction, tied replicas), not in its dataflow")
    if not causes:
        causes.append("the bug is in the state the engine keeps across micro-batches (buffers), not in its dataflow")
    where = "; and ".join(causes)
    if own_split is not None:  # that split computes what the engine's ranks do, rightly or not
        return None, (f"no boundary value diverges from runner {own_split!r}'s own split run in one process "
                      f"({values_said}, forward and backward{scaled}): either that split itself computes the model "
                      "wrong (a value its forward does not pass along to a later stage, an input a stage does not "
                      f"get: the rows show it against eager), or {where}")
    return None, (f"no boundary value diverges ({values_said} the stages received and sent, forward and backward, "
                  f"match the reference{scaled}): {where}")
