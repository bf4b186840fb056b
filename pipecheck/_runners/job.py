"""A check's job, as every runner receives it, and the Runner protocol.

    def my_runner(job: pc.Job) -> pc.StepResult:
        model = job.build_model()            # fresh, seeded, in the job's dtype/device
        ...                                  # run it through your pipeline engine
        return pc.StepResult(outputs, loss, grads_by_original_fqn)

    pc.assert_equivalent(model, (x,), runner=my_runner)

A runner is any callable ``runner(job) -> StepResult``. ``job.model`` is a
picklable zero-argument factory, which is what travels to worker processes.
``job.pipe`` is the check's own split, for reading its structure;
``job.split()`` gives a private copy to run. A runner may also have a method
``check_split(pipe)``: the check calls it as soon as the model is split, before
any eager work, and it raises ``pc.InputError`` for a split it cannot run.

An engine that runs its own modules, or runs in processes of its own, names its stage values for the
check's localisation with ``job.recorder(stage)`` (``pipecheck._runtime.stage_recorder``): by position,
in pipecheck's terms, on any process; ``boundaries=job.recorded(recorders)`` returns them.

A check that trains (``steps``, ``optimizer``, ``accumulation_steps``, ``loss_reduction``) needs a
runner that keeps its engine across steps: one with a method ``train(job) -> list[StepResult]``,
one result per optimizer step, its ``grads`` before the optimizer and its ``params`` after it::

    class MyRunner:
        def __call__(self, job): ...                       # one step, as above
        def train(self, job):
            engine = build_engine(job.build_model(), job.training.optimizer)   # set up once
            return [engine.train_step(batches) for batches in job.optimizer_steps()]
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from pipecheck._core.precision import Precision
from pipecheck._core.result import StepResult
from pipecheck._core.training import Batch, Training
from pipecheck._runtime.boundaries import Boundaries, BoundaryKey, instrument
from pipecheck._runtime.stage_recorder import StageRecorder
from pipecheck._split.pipe import Pipe, split
from pipecheck.errors import RecordingError
from pipecheck.losses import LossFn
from pipecheck.policies import Policy

if TYPE_CHECKING:
    from pipecheck._world.world import World

@dataclass
class Job:
    """Everything a runner needs for one step of one model.

    ``world`` is a World to run on (None: the runner picks a shared one of
    ``world_size`` ranks); ``trace_path`` asks for a Chrome-trace timeline.
    """

    model: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    split_spec: Mapping[str, Any] | None = None
    policy: Policy | None = None
    tracer: str = "auto"  # "auto": fx, or export where fx cannot trace
    loss_fn: LossFn | None = None
    target: Any = None
    n_microbatches: int = 1
    schedule: str | Any = "1f1b"  # a name, or a pipecheck.schedules.Schedule
    world_size: int | None = None
    stages_per_rank: int = 1
    device: str = "cpu"
    timeout: float | None = None
    world: World | None = None
    trace_path: str | None = None
    pipe: Pipe | None = field(default=None, repr=False)  # the check's split of ``model``, if made
    # Set when the check re-runs a failing job to find where it diverges: every split() then records its
    # stage modules' boundary values here (an engine that runs other modules records with recorder(stage),
    # or calls boundaries.record).
    boundaries: Boundaries | None = field(default=None, repr=False)
    # How the check trains (several optimizer steps, accumulation, the loss convention) and the batch of
    # each schedule step (empty: every schedule step runs ``args``, ``kwargs``, ``target``).
    training: Training = field(default_factory=Training)
    batches: tuple[Batch, ...] = ()
    # How the check computes (pc.Precision): the runner must run its forwards under ``precision.autocast``
    # and sum each parameter's micro-batch gradients in ``precision.grad_accumulation``, as it promises.
    precision: Precision = field(default_factory=Precision)
    # The job's model cut once by structure() when it has no ``pipe``: private, so a copy made with
    # dataclasses.replace (other inputs, another cut) splits again.
    _split: Pipe | None = field(default=None, init=False, repr=False, compare=False)

    def build_model(self) -> nn.Module:
        return self.model()

    def split(self) -> Pipe:
        """The job's model cut as the job asks: a private copy, safe to run (running changes buffers).
        While ``boundaries`` is set, its stage modules record their boundary values there."""
        pipe = copy.deepcopy(self.structure())
        if self.boundaries is not None:
            instrument(pipe, self.boundaries)
        return pipe

    def structure(self) -> Pipe:
        """The job's split for reading its stages, edges and tied groups (not for running): the
        check's own, or the job's model cut once, on first use."""
        if self.pipe is not None:
            return self.pipe
        if self._split is None:
            self._split = split(self.model, self.args, self.kwargs, split_spec=self.split_spec, policy=self.policy,
                                tracer=self.tracer)
        return self._split

    def recorder(self, stage: int) -> StageRecorder:
        """A recorder of stage ``stage``'s boundary values, named by position as ``structure()`` has them:
        ``rec.inputs(mb, *values)``, ``rec.outputs``, ``rec.input_grads``, ``rec.output_grads`` or
        ``rec.watch(module)``, on any process (it pickles); ``print(rec)`` lists the positions. A training
        check's micro-batches are numbered across its run: schedule step i's replica r's j-th is
        ``(i * d + r) * n + j`` (``watch`` counts forwards so). It records
        only while ``boundaries`` is set (the check's second run); return what it holds with
        :meth:`recorded`."""
        run = self.n_microbatches * self.training.data_parallel * self.training.schedule_steps  # numbered across it
        return StageRecorder.for_stage(self.structure(), stage, run, self.boundaries)

    def recorded(self, recorders: Iterable[StageRecorder]) -> dict[BoundaryKey, torch.Tensor]:
        """What ``recorders`` (sent back from the engine's processes) recorded, as ``StepResult.boundaries``."""
        found: dict[BoundaryKey, torch.Tensor] = {}
        for recorder in recorders:
            if not isinstance(recorder, StageRecorder):
                raise RecordingError(f"job.recorded() takes the StageRecorders the engine's processes sent back; got "
                                     f"{type(recorder).__name__}. Fix: return each job.recorder(stage) from the process "
                                     "that recorded with it, and pass them all.")
            found.update(recorder.exported())
        return found

    def frozen_params(self) -> frozenset[str]:
        """The FQNs of the model's parameters that need no gradient (``requires_grad=False``)."""
        return frozenset(fqn for stage in self.structure().stages for local, param in
                         stage.module.named_parameters(remove_duplicate=False) if not param.requires_grad
                         for fqn in [stage.local_to_fqn.get(local)] if fqn is not None)

    def with_batch(self, batch: Batch) -> Job:
        """This job on one batch's inputs and target (an engine that plans on its first batch)."""
        return dataclasses.replace(self, args=batch.args, kwargs=dict(batch.kwargs), target=batch.target)

    def schedule_batches(self) -> list[Batch]:
        """The batch of every schedule step of the training loop, in order."""
        if self.batches:
            return list(self.batches)
        return [Batch(self.args, self.kwargs, self.target)] * self.training.schedule_steps

    def optimizer_steps(self) -> list[list[Batch]]:
        """The batches of each optimizer step: ``accumulation_steps`` schedule steps each."""
        batches, g = self.schedule_batches(), self.training.accumulation_steps
        return [batches[i:i + g] for i in range(0, len(batches), g)]

    @property
    def random_seed(self) -> int | None:
        """The seed of pipecheck's randomness contract (:mod:`pipecheck.randomness`) when the model draws
        random numbers in this check, None when it draws none: a runner that follows the contract draws
        stage s's micro-batch m with ``pc.randomness.drawing(job.random_seed, stage=s, microbatch=m, ...)``."""
        return self.training.random_seed

    @functools.cached_property
    def bound(self) -> dict[str, Any]:
        """The job's inputs by the names of the model's ``forward`` parameters (``pc.Replicated`` kept)."""
        return self.structure().bind_inputs(self.args, self.kwargs)


@runtime_checkable
class Runner(Protocol):
    """Any callable that runs one training step of ``job`` through a pipeline engine."""

    def __call__(self, job: Job, /) -> StepResult: ...
