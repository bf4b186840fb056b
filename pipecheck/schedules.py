"""Pipeline schedules as printable, validated data.

Usage::

    s = make_schedule("1f1b", n_stages=4, n_microbatches=8)
    validate(s)          # raises ScheduleError listing every problem at once
    print(s.table())     # one row per rank, one column per clock cycle

A schedule is pure data: for each rank, the list of actions it runs in order.
An action is written ``{stage}{F|B}{microbatch}`` as in torch.distributed.
pipelining: ``1B3`` is the backward of micro-batch 3 through stage 1. The
runtime that executes a schedule lives elsewhere; this module only builds,
parses, prints and checks schedules.

1F1B on 4 ranks with 4 micro-batches (``print(one_f_one_b(4, 4).table())``);
every action takes one clock cycle and ``.`` is a bubble::

    step   |   0   1   2   3   4   5   6   7   8   9  10  11  12  13
    rank 0 | 0F0 0F1 0F2 0F3  .   .   .  0B0  .  0B1  .  0B2  .  0B3
    rank 1 |  .  1F0 1F1 1F2  .   .  1B0 1F3 1B1  .  1B2  .  1B3  .
    rank 2 |  .   .  2F0 2F1  .  2B0 2F2 2B1 2F3 2B2  .  2B3  .   .
    rank 3 |  .   .   .  3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3  .   .   .

Rank ``r`` warms up with ``n_stages - r - 1`` forwards, then alternates one
forward and one backward, then drains the remaining backwards.

Timing model (used by :meth:`Schedule.table`, :func:`validate` and
:func:`simulated_bubble_fraction`; the simulator is ``pipecheck._schedule_sim``):
each action takes one unit; a rank runs its list strictly in order; an action
starts at the first step after all of its dependencies finished (sends are
asynchronous and free). ``F(s, m)`` depends on ``F(p, m)`` for every producer
stage ``p`` of ``s``; ``B(s, m)`` depends on ``F(s, m)`` and on ``B(c, m)`` for
every consumer stage ``c`` of ``s``. Producers default to the chain
``s - 1 -> s``; pass ``dependencies`` for pipelines with skip connections
(e.g. ``{1: {0}, 2: {1}, 3: {0, 2}}``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecheck._errors import ScheduleError
from pipecheck._schedule_sim import (
    Dependencies,
    bubble,
    chain_dependencies,
    checked_timeline,
    problem_list,
    render,
    simulate,
)

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "chain_dependencies",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "simulated_bubble_fraction",
    "validate",
]

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FB])\s*(\d+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` "F" (forward) or "B" (backward) of ``microbatch`` through ``stage``."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ScheduleError(f'Action kind must be "F" or "B" (kind={self.kind!r})')

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form ``{stage}{F|B}{microbatch}``, e.g. ``"0F1"``."""
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '{{stage}}{{F|B}}{{microbatch}}' such as '0F1'"
            )
        return cls(match.group(2).upper(), int(match.group(1)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank lists of :class:`Action`, in execution order.

    ``stage_to_rank[s]`` is the rank that holds stage ``s``; ``actions[r]`` is
    what rank ``r`` runs. Lists are converted to tuples. Construction does not
    validate: call :func:`validate` (or :meth:`validate`).
    """

    n_stages: int
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    name: str = field(default="custom")

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    @classmethod
    def from_lists(
        cls,
        n_stages: int,
        n_microbatches: int,
        stage_to_rank: Sequence[int] | None,
        actions: Sequence[Sequence[str | Action]],
        name: str = "custom",
    ) -> Schedule:
        """Build a schedule from compact strings, e.g. ``[["0F0", "0B0"], ["1F0", "1B0"]]``.

        ``stage_to_rank=None`` places stage ``s`` on rank ``s % len(actions)``.
        Every unparsable entry is reported in one :class:`ScheduleError`.
        """
        rows: list[list[Action]] = []
        problems: list[str] = []
        for rank, row in enumerate(actions):
            parsed: list[Action] = []
            for position, item in enumerate(row):
                if isinstance(item, Action):
                    parsed.append(item)
                    continue
                try:
                    parsed.append(Action.parse(item))
                except ScheduleError as err:
                    problems.append(f"rank {rank}, position {position}: {err}")
            rows.append(parsed)
        if problems:
            raise ScheduleError(problem_list(f"cannot build schedule {name!r}", problems))
        if stage_to_rank is None:
            stage_to_rank = [stage % max(len(rows), 1) for stage in range(n_stages)]
        return cls(n_stages, n_microbatches, tuple(stage_to_rank), tuple(map(tuple, rows)), name)

    def to_lists(self) -> list[list[str]]:
        """The inverse of :meth:`from_lists`: compact strings per rank."""
        return [[str(action) for action in row] for row in self.actions]

    def validate(self, dependencies: Dependencies | None = None) -> None:
        """Same as :func:`validate`."""
        validate(self, dependencies)

    def table(self, dependencies: Dependencies | None = None) -> str:
        """The simulated timeline as a grid; a deadlock is drawn with ``<-- ERROR HERE``."""
        return render(self, simulate(self, dependencies))

    def __str__(self) -> str:
        return self.table()


# --------------------------------------------------------------------------- generators

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")


def gpipe(n_stages: int, n_microbatches: int, *, stages_per_rank: int = 1) -> Schedule:
    """All forwards, then all backwards, both in micro-batch order 0..m-1 (as torch's ScheduleGPipe).

    With ``stages_per_rank > 1`` stages are laid round-robin (stage ``s`` on
    rank ``s % n_ranks``) and each rank runs its stages one after another
    ("looped BFS"): forwards stage by stage, backwards in reverse stage order.
    """
    _check_positive(
        n_stages=n_stages, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
    )
    n_ranks = _ranks_for(n_stages, stages_per_rank)
    mbs = range(n_microbatches)
    rows = []
    for rank in range(n_ranks):
        own = range(rank, n_stages, n_ranks)
        forwards = [Action("F", stage, mb) for stage in own for mb in mbs]
        backwards = [Action("B", stage, mb) for stage in reversed(own) for mb in mbs]
        rows.append(tuple(forwards + backwards))
    return Schedule(n_stages, n_microbatches, _round_robin(n_stages, n_ranks), tuple(rows), "gpipe")


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush), one stage per rank: warmup, steady one-forward-one-backward, cooldown.

    Rank ``r`` first runs ``min(n_stages - r - 1, n_microbatches)`` forwards.
    """
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches)
    rows = []
    for rank in range(n_stages):
        warmup = min(n_stages - rank - 1, n_microbatches)
        ops = [Action("F", rank, mb) for mb in range(warmup)]
        for i in range(n_microbatches - warmup):
            ops += [Action("F", rank, warmup + i), Action("B", rank, i)]
        ops += [Action("B", rank, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
        rows.append(tuple(ops))
    return Schedule(n_stages, n_microbatches, tuple(range(n_stages)), tuple(rows), "1f1b")


def interleaved_1f1b(n_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: ``stages_per_rank`` virtual stages per rank.

    Stage ``s`` lives on rank ``s % n_ranks``. Micro-batches move through a
    rank's stages in groups of ``n_ranks`` (depth first); rank ``r`` warms up
    with ``2 * (n_ranks - r - 1) + (stages_per_rank - 1) * n_ranks`` forwards.
    With more than one stage per rank, ``n_microbatches`` must be a multiple
    of ``n_ranks`` (Megatron's rule); with one, any count works and the
    warmup is twice 1F1B's (the formula above with ``stages_per_rank=1``).
    """
    _check_positive(n_ranks=n_ranks, stages_per_rank=stages_per_rank, n_microbatches=n_microbatches)
    if stages_per_rank > 1 and n_microbatches % n_ranks:
        lower = n_microbatches - n_microbatches % n_ranks
        fix = f"{lower} or {lower + n_ranks}" if lower else f"{n_ranks}"
        raise ScheduleError(
            "interleaved 1F1B needs n_microbatches to be a multiple of n_ranks "
            f"(n_microbatches={n_microbatches}, n_ranks={n_ranks}, stages_per_rank={stages_per_rank}); "
            f"use {fix} micro-batches, or the 'gpipe' schedule"
        )
    p, v = n_ranks, stages_per_rank
    total = v * n_microbatches  # actions of each kind per rank

    def action(kind: str, k: int, rank: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    rows = []
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        ops = [action("F", k, rank) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [action("F", warmup + i, rank), action("B", i, rank)]
        ops += [action("B", k, rank) for k in range(total - warmup, total)]
        rows.append(tuple(ops))
    n_stages = p * v
    return Schedule(
        n_stages, n_microbatches, _round_robin(n_stages, p), tuple(rows), "interleaved_1f1b"
    )


def make_schedule(
    name: str, n_stages: int, n_microbatches: int, stages_per_rank: int = 1
) -> Schedule:
    """Build a schedule by name: "gpipe", "1f1b" or "interleaved" (alias "interleaved_1f1b").

    Names are case-insensitive. ``stages_per_rank > 1`` is supported by
    "gpipe" (looped) and "interleaved"; "1f1b" refuses it and points to
    "interleaved".
    """
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else ""
    if key not in ("gpipe", "1f1b", "interleaved", "interleaved_1f1b"):
        raise ScheduleError(
            f"unknown schedule {name!r}; valid names: 'gpipe', '1f1b', 'interleaved' "
            "(alias 'interleaved_1f1b'), case-insensitive"
        )
    _check_positive(
        n_stages=n_stages, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
    )
    if key == "gpipe":
        return gpipe(n_stages, n_microbatches, stages_per_rank=stages_per_rank)
    if key == "1f1b":
        if stages_per_rank != 1:
            raise ScheduleError(
                f"the '1f1b' schedule runs one stage per rank (stages_per_rank={stages_per_rank}); "
                "use 'interleaved' for several stages per rank, or stages_per_rank=1"
            )
        return one_f_one_b(n_stages, n_microbatches)
    return interleaved_1f1b(_ranks_for(n_stages, stages_per_rank), stages_per_rank, n_microbatches)


def _check_positive(**values: int) -> None:
    bad = [f"{k}={v!r}" for k, v in values.items() if type(v) is not int or v < 1]
    if bad:
        raise ScheduleError(f"schedule sizes must be positive integers ({', '.join(bad)})")


def _ranks_for(n_stages: int, stages_per_rank: int) -> int:
    if n_stages % stages_per_rank:
        raise ScheduleError(
            "n_stages must be a multiple of stages_per_rank "
            f"(n_stages={n_stages}, stages_per_rank={stages_per_rank}); "
            "change the number of stages or of stages per rank"
        )
    return n_stages // stages_per_rank


def _round_robin(n_stages: int, n_ranks: int) -> tuple[int, ...]:
    return tuple(stage % n_ranks for stage in range(n_stages))


# --------------------------------------------------------------------------- checks


def validate(schedule: Schedule, dependencies: Dependencies | None = None) -> None:
    """Raise :class:`ScheduleError` listing every problem of ``schedule``, or return None.

    Checks: each (stage, micro-batch) has exactly one F and one B, on the rank
    that owns the stage, F before B; actions name existing stages and
    micro-batches; ``dependencies`` name existing stages; and, once all that
    holds, that the simulation finishes (no deadlock). A deadlock is reported
    as the timeline grid with ``<-- ERROR HERE`` on each stuck rank.
    """
    checked_timeline(schedule, dependencies)


def simulated_bubble_fraction(schedule: Schedule, dependencies: Dependencies | None = None) -> float:
    """Idle rank-steps / all rank-steps of the simulated (unit-time) timeline; validates first.

    Under unit times GPipe and 1F1B give the textbook ``(p - 1) / (m + p - 1)``
    for ``p`` stages and ``m`` micro-batches. (A run's measured bubble is in its
    timeline: ``trace_path=``.)
    """
    return bubble(schedule, checked_timeline(schedule, dependencies))
