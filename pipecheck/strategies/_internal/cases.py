"""The ``pipeline_cases()`` strategy: whole pipeline checks, ready to run.

::

    @given(pst.pipeline_cases(dtypes=(torch.float32, torch.float64)))
    def test_reference_matches_eager(case):
        case.check()          # pc.assert_equivalent(...); a failure carries case.repro()

A :class:`PipelineCase` is a model description, a split of it, a micro-batch
count, a schedule and its layout on ranks, a dtype and a runner. ``check``
runs ``pc.assert_equivalent`` and, when it fails, appends to the error the
minimal model as Python source plus the exact call that reproduces it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from pipecheck._check.report import Report
from pipecheck._runners.registry import BUILTIN
from pipecheck._split.markers import SplitPoint
from pipecheck._split.microbatch import Replicated
from pipecheck.errors import NonFiniteError, PipecheckError, WorldStartError
from pipecheck.schedules import SCHEDULE_NAMES, stages_per_rank_of
from pipecheck.strategies._internal import repro as _repro
from pipecheck.strategies._internal.builder import build, make_inputs
from pipecheck.strategies._internal.cuts import (
    SplitSpec,
    _raise_if_any,
    _stage_problems,
    crossings,
    cut_plan,
    draw_cuts,
)
from pipecheck.strategies._internal.description import FEATURES, ModelSpec, features
from pipecheck.strategies._internal.models import models as _models
from pipecheck.strategies._internal.training import LOSS_REDUCTIONS, OPTIMIZERS

RUNNER_NAMES = BUILTIN
SCHEDULES = SCHEDULE_NAMES
"""Schedule names, simplest first: a case shrinks towards the leftmost one allowed."""

DEFAULT_RUNNERS: tuple[Any, ...] = ("reference",)
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32,)
_SIMPLEST_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True, repr=False)
class PipelineCase:
    """One generated pipeline check: what ``pc.assert_equivalent`` is called with.

    ``split_spec`` cuts ``build(spec)`` into ``len(split_spec) + 1`` stages laid
    out ``stages_per_rank`` per rank on ``world_size`` ranks under
    ``schedule``; ``n_microbatches`` divides ``spec.batch``. The inputs are
    ``make_inputs(spec)``, cast to ``dtype`` by the check. ``runner`` is the
    default of :meth:`run` and :meth:`check`. ``world_size`` defaults to
    ``num_stages // stages_per_rank``; a layout that does not fit raises InputError.
    """

    spec: ModelSpec
    split_spec: SplitSpec
    n_microbatches: int = 1
    schedule: str = "gpipe"
    stages_per_rank: int = 1
    world_size: int = None  # type: ignore[assignment]  # None: num_stages // stages_per_rank
    dtype: torch.dtype = torch.float32
    runner: Any = "reference"
    # A training check (pipeline_cases(training=True)): optimizer steps, accumulation, an optimizer of
    # OPTIMIZERS by name (None: none) and the loss convention.
    steps: int = 1
    accumulation_steps: int = 1
    optimizer: str | None = None
    loss_reduction: str = "mean"
    data_parallel: int = 1  # pipeline replicas: the check runs on world_size * data_parallel ranks

    def __post_init__(self) -> None:
        if self.world_size is None:
            object.__setattr__(self, "world_size", self.num_stages // max(1, self.stages_per_rank))
        problems = []
        if self.world_size * self.stages_per_rank != self.num_stages:
            problems.append(f"world_size={self.world_size} ranks of stages_per_rank="
                            f"{self.stages_per_rank} do not hold the {self.num_stages} stages of "
                            f"split_spec; pass world_size * stages_per_rank == {self.num_stages}")
        if not (isinstance(self.n_microbatches, int) and self.n_microbatches >= 1
                and self.spec.batch % (self.n_microbatches * self.data_parallel) == 0):
            times = f" x data_parallel={self.data_parallel!r}" if self.data_parallel != 1 else ""
            problems.append(f"n_microbatches={self.n_microbatches!r}{times} must divide the batch of {self.spec.batch}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer={self.optimizer!r} is not one of {list(OPTIMIZERS)}")
        _raise_if_any("PipelineCase", problems)

    def __hash__(self) -> int:  # the generated one would hash split_spec, a dict
        return hash((self.spec, tuple(self.split_spec.items()), self.n_microbatches,
                     self.schedule, self.stages_per_rank, self.world_size, self.dtype, self.training_arguments()))

    def training_arguments(self) -> tuple[tuple[str, Any], ...]:
        """The training options of ``pc.assert_equivalent`` this case sets (none for a one-step case)."""
        found = {"steps": self.steps, "accumulation_steps": self.accumulation_steps,
                 "optimizer": OPTIMIZERS[self.optimizer] if self.optimizer else None,
                 "loss_reduction": self.loss_reduction, "data_parallel": self.data_parallel}
        defaults = {"steps": 1, "accumulation_steps": 1, "optimizer": None, "loss_reduction": "mean",
                    "data_parallel": 1}
        return tuple((name, value) for name, value in found.items() if value != defaults[name])

    @property
    def num_stages(self) -> int:
        return len(self.split_spec) + 1

    def model_factory(self) -> Callable[[], torch.nn.Module]:
        """A picklable zero-argument factory of the model (what travels to worker ranks)."""
        return functools.partial(build, self.spec)

    def features(self) -> set[str]:
        """The model's features (``features(spec)``) and what the split exercises (``CROSSINGS``)."""
        return features(self.spec) | crossings(self.spec, self.split_spec)

    def call_arguments(self, runner: Any = None, **extra: Any) -> dict[str, Any]:
        """The keyword arguments of ``pc.assert_equivalent`` after the model and inputs."""
        return {
            "split_spec": dict(self.split_spec), "n_microbatches": self.n_microbatches,
            "schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
            "world_size": self.world_size * self.data_parallel, "dtype": self.dtype,
            "runner": self.runner if runner is None else runner, **dict(self.training_arguments()), **extra,
        }

    def run(self, runner: Any = None, **extra: Any) -> Report:
        """``pc.assert_equivalent`` of this case; ``extra`` adds or overrides keyword arguments.

        E.g. ``case.run("distributed", world=world)``.
        """
        from pipecheck._check.equivalence import assert_equivalent

        args, tensors = make_inputs(self.spec)
        kwargs: dict[str, Any] = {name: Replicated(value) if self.spec.input(name).role == "replicated" else value
                  for name, value in tensors.items()}  # no batch dimension: every micro-batch gets it whole
        return assert_equivalent(self.model_factory(), args, kwargs,
                                 **self.call_arguments(runner, **extra))

    def check(self, runner: Any = None, **extra: Any) -> Report:
        """:meth:`run`, and on failure the same error with :meth:`repro` appended.

        Inside a hypothesis test, a case whose eager run itself gives NaN/Inf (a steep generated model
        trained a few steps) is rejected, not failed. A :class:`pipecheck.PipecheckError` (an
        ``EquivalenceError`` included) gets the source in its message; any other exception gets it as a note. A World that
        could not start (e.g. a script without a main guard) is not the case's doing: no source.
        """
        try:
            return self.run(runner, **extra)
        except WorldStartError:
            raise
        except NonFiniteError:
            if currently_in_test_context():  # eager itself blew up (a steep model trained): not a case to judge
                reject()
            raise
        except PipecheckError as err:
            err.args = (f"{err}\n\n{_repro.BANNER}\n\n{self.repro(runner, **extra)}",)
            raise
        except Exception as err:
            if hasattr(err, "add_note"):  # Python >= 3.11
                err.add_note(f"{_repro.BANNER}\n\n{self.repro(runner, **extra)}")
            raise

    def repro(self, runner: Any = None, **extra: Any) -> str:
        """Python source of this check: the model (``to_source``) plus the exact call.

        Paste it into a test file (it defines ``test_pipeline_case``) or run it as
        a script. A ``world=`` passed in is left out: the distributed
        runner makes one of ``world_size`` ranks.
        """
        return _repro.source(self.spec, self.call_arguments(runner, **extra))

    def __repr__(self) -> str:
        cuts = ", ".join(f"{name!r}: SplitPoint.{point.name}" if isinstance(point, SplitPoint)
                         else f"{name!r}: {point!r}" for name, point in self.split_spec.items())
        return (f"PipelineCase(spec={self.spec!r}, split_spec={{{cuts}}}, "
                f"n_microbatches={self.n_microbatches}, schedule={self.schedule!r}, "
                f"stages_per_rank={self.stages_per_rank}, world_size={self.world_size}, "
                f"dtype={self.dtype}, runner={self.runner!r}"
                + "".join(f", {name}={getattr(self, name)!r}" for name, _ in self.training_arguments()) + ")")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis' falsifying examples: one reproducing line


@dataclass(frozen=True)
class _Config:
    models: st.SearchStrategy[ModelSpec]
    runners: tuple[Any, ...]
    dtypes: tuple[torch.dtype, ...]
    schedules: tuple[str, ...]
    min_stages: int
    max_stages: int
    max_world_size: int
    max_stages_per_rank: int
    max_microbatches: int | None


def pipeline_cases(
    *,
    models: st.SearchStrategy[ModelSpec] | None = None,
    runners: Iterable[Any] = DEFAULT_RUNNERS,
    dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
    schedules: Iterable[str] = SCHEDULES,
    min_stages: int = 2,
    max_stages: int = 4,
    max_world_size: int = 4,
    max_stages_per_rank: int = 2,
    max_microbatches: int | None = None,
    training: bool = False,
) -> st.SearchStrategy[PipelineCase]:
    """Random :class:`PipelineCase` values: a model, its cut points and how to run it.

    ``models`` draws the :class:`ModelSpec` (default ``models(min_layers=min_stages)``);
    cuts come from ``cut_points`` (between ``min_stages`` and ``max_stages``
    stages, as many as the model allows); ``runner``, ``dtype`` and
    ``schedule`` from the collections given (runner names of ``RUNNER_NAMES``
    or callables ``runner(job) -> StepResult``). The layout always fits:
    ``world_size = stages / stages_per_rank <= max_world_size``, '1f1b' and
    'zb' run one stage per rank, 'zbv' two (an even number of stages; left out
    when ``max_stages_per_rank`` is 1), interleaved with several stages per
    rank gets a multiple of ``world_size`` micro-batches; ``n_microbatches``
    divides the batch (and is at most ``max_microbatches``). ``training=True`` also draws a
    training loop: 1 to 3 optimizer steps of one of ``OPTIMIZERS`` (or none), 1 or 2 accumulation
    steps, a loss convention of ``LOSS_REDUCTIONS``, 1 or 2 data-parallel replicas (when the batch and
    ``max_world_size`` allow). When every runner given follows pipecheck's randomness contract
    ("reference", "distributed", or a runner with ``follows_random_contract``), the default models may
    have random ops in train mode (``RANDOM_FEATURES``: ``nn.Dropout``, ``F.dropout``, SDPA's
    ``dropout_p``, ``nn.Dropout1d``, stochastic depth, a checkpointed block with dropout), in one-step
    cases and training ones alike; with any other runner they have none.

    Shrinks towards fewer layers (and the model's own shrinking), fewer
    stages and earlier cuts, the first runner given, fp32 (when allowed), the
    simplest schedule (gpipe, 1f1b, interleaved, zb, zbv), one stage per rank and one
    micro-batch.
    """
    # drawn from again at every example: keep copies of one-shot iterators
    runners = tuple(runners) if isinstance(runners, Iterator) else runners
    dtypes = tuple(dtypes) if isinstance(dtypes, Iterator) else dtypes
    schedules = tuple(schedules) if isinstance(schedules, Iterator) else schedules
    # checked here so that a mistake raises at the call, not at the first draw
    if not isinstance(training, bool):
        _raise_if_any("pipeline_cases", [f"training={training!r} must be True or False"])
    _checked(models, runners, dtypes, schedules, min_stages, max_stages, max_world_size,
             max_stages_per_rank, max_microbatches)
    return _pipeline_cases(
        models=models, runners=runners, dtypes=dtypes, schedules=schedules, min_stages=min_stages,
        max_stages=max_stages, max_world_size=max_world_size,
        max_stages_per_rank=max_stages_per_rank, max_microbatches=max_microbatches, training=training)


def _draw_pipeline_cases(
    draw: st.DrawFn,
    *,
    models: st.SearchStrategy[ModelSpec] | None = None,
    runners: Iterable[Any] = DEFAULT_RUNNERS,
    dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
    schedules: Iterable[str] = SCHEDULES,
    min_stages: int = 2,
    max_stages: int = 4,
    max_world_size: int = 4,
    max_stages_per_rank: int = 2,
    max_microbatches: int | None = None,
    training: bool = False,
) -> PipelineCase:
    config = _checked(models, runners, dtypes, schedules, min_stages, max_stages, max_world_size,
                      max_stages_per_rank, max_microbatches)
    runner = _pick(draw, config.runners)
    dtype = _pick(draw, config.dtypes)
    schedule = _pick(draw, config.schedules)
    random = models is None and all(_follows_random_contract(r) for r in config.runners)
    spec = draw(_default_models(max(1, config.min_stages), random=True) if random else config.models)
    plan = cut_plan(spec)
    fixed = stages_per_rank_of(schedule)  # 1f1b and zb: 1 stage per rank; zbv: 2, in a V
    per_rank_cap = fixed or config.max_stages_per_rank
    highest = min(config.max_stages, plan.max_stages, config.max_world_size * per_rank_cap)
    if highest < config.min_stages:
        reject()  # the model is too small to cut into min_stages stages
    if fixed == 2:  # zbv: an even number of stages
        evens = tuple(range(config.min_stages + config.min_stages % 2, highest + 1, 2))
        if not evens:
            reject()
        n_stages = _pick(draw, evens)
    else:
        n_stages = draw(st.integers(config.min_stages, highest))
    split_spec = draw_cuts(draw, plan, n_stages)
    layouts = [per_rank for per_rank in range(1, per_rank_cap + 1)
               if (fixed is None or per_rank == fixed)
               and n_stages % per_rank == 0 and n_stages // per_rank <= config.max_world_size]
    if not layouts:
        reject()  # e.g. 3 stages, at most 2 ranks and 2 stages per rank
    stages_per_rank = _pick(draw, tuple(layouts))
    world_size = n_stages // stages_per_rank
    counts = [count for count in range(1, spec.batch + 1) if spec.batch % count == 0
              and (config.max_microbatches is None or count <= config.max_microbatches)
              and not (schedule == "interleaved" and stages_per_rank > 1 and count % world_size)]
    if not counts:
        reject()  # no micro-batch count divides the batch and fits the schedule
    n_microbatches = _pick(draw, tuple(counts))
    loop: dict[str, Any] = {}
    if training is True:
        replicas = tuple(d for d in (1, 2) if spec.batch % (n_microbatches * d) == 0
                         and world_size * d <= config.max_world_size)
        loop = {"steps": draw(st.integers(1, 3)), "accumulation_steps": draw(st.integers(1, 2)),
                "optimizer": _pick(draw, (None, *OPTIMIZERS)), "loss_reduction": _pick(draw, LOSS_REDUCTIONS),
                "data_parallel": _pick(draw, replicas)}
    return PipelineCase(spec, split_spec, n_microbatches, schedule, stages_per_rank, world_size,
                        dtype, runner, **loop)


_draw_pipeline_cases.__name__ = _draw_pipeline_cases.__qualname__ = "pipeline_cases"  # repr
_pipeline_cases = st.composite(_draw_pipeline_cases)


def _follows_random_contract(runner: Any) -> bool:
    """Whether ``runner`` draws random numbers by pipecheck's randomness contract (a model with random ops
    is refused by the others): "reference" and "distributed", or a runner of one's own that says so."""
    if isinstance(runner, str):  # runner="torch" follows it too, but refuses a model its own split draws apart
        return runner in ("reference", "distributed")
    return bool(getattr(runner, "follows_random_contract", False))


def _pick(draw: st.DrawFn, options: tuple[Any, ...]) -> Any:
    """One of ``options``, shrinking to the first; no choice recorded when there is one."""
    return options[0] if len(options) == 1 else draw(st.sampled_from(options))


@functools.lru_cache(maxsize=16)
def _default_models(min_layers: int, random: bool = False) -> st.SearchStrategy[ModelSpec]:
    """``models(min_layers=...)``; with ``random``, every feature (the random ones of RANDOM_FEATURES too)."""
    return _models(min_layers=min_layers, features=FEATURES if random else None)


def _checked(
    models: object, runners: object, dtypes: object, schedules: object, min_stages: object,
    max_stages: object, max_world_size: object, max_stages_per_rank: object,
    max_microbatches: object,
) -> _Config:
    """The validated arguments of ``pipeline_cases()``; raises InputError listing every problem."""
    problems = _stage_problems(min_stages, max_stages)
    if models is not None and not isinstance(models, st.SearchStrategy):
        problems.append(f"models={models!r} must be a strategy of ModelSpec, e.g. "
                        "models=pst.models(max_layers=4)")
    runner_list = _collection("runners", runners, problems)
    for runner in runner_list:
        if not (runner in RUNNER_NAMES or (callable(runner) and not isinstance(runner, str))):
            problems.append(f"runners has {runner!r}, which is neither one of {list(RUNNER_NAMES)} "
                            "nor a callable runner(job) -> StepResult")
    dtype_list = _collection("dtypes", dtypes, problems)
    for dtype in dtype_list:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            problems.append(f"dtypes has {dtype!r}, which is not a floating torch.dtype "
                            "(e.g. torch.float32, torch.bfloat16)")
    schedule_list = _collection("schedules", schedules, problems)
    for schedule in schedule_list:
        if schedule not in SCHEDULES:
            problems.append(f"schedules has {schedule!r}; choose from {list(SCHEDULES)}")
    if schedule_list and set(schedule_list) <= {"zbv"} and isinstance(max_stages_per_rank, int) \
            and max_stages_per_rank < 2:
        problems.append(f"schedules={schedule_list!r} places 2 stages on each rank (a V), but "
                        f"max_stages_per_rank={max_stages_per_rank}; raise it to 2 or add another schedule")
    for name, value in (("max_world_size", max_world_size),
                        ("max_stages_per_rank", max_stages_per_rank),
                        ("max_microbatches", max_microbatches)):
        if value is None and name == "max_microbatches":
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{name}={value!r} must be an int")
        elif value < 1:
            problems.append(f"{name}={value} must be at least 1")
    if (not problems and isinstance(min_stages, int) and isinstance(max_world_size, int)
            and isinstance(max_stages_per_rank, int)):
        if min_stages > max_world_size * max_stages_per_rank:
            problems.append(
                f"min_stages={min_stages} stages do not fit on max_world_size={max_world_size} ranks "
                f"of max_stages_per_rank={max_stages_per_rank}; raise either, or lower min_stages")
    _raise_if_any("pipeline_cases", problems)
    sizes = cast(tuple[int, int, int, int],
                        (min_stages, max_stages, max_world_size, max_stages_per_rank))
    return _Config(
        models if isinstance(models, st.SearchStrategy) else _default_models(max(1, sizes[0])),
        tuple(runner_list),
        tuple(sorted(dtype_list, key=lambda d: (_SIMPLEST_DTYPES + (d,)).index(d))),
        tuple(schedule for schedule in SCHEDULES if schedule in schedule_list
              and (schedule != "zbv" or sizes[3] >= 2)),
        *sizes,
        cast("int | None", max_microbatches),
    )


def _collection(name: str, value: object, problems: list[str]) -> list[Any]:
    """``value`` as a list when it is a non-empty collection (not a str); else a problem."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        problems.append(f"{name}={value!r} must be a collection, e.g. {name}=[{value!r}]")
        return []
    items = list(value)
    if not items:
        problems.append(f"{name}={items!r} is empty; give at least one")
    return items
