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
:func:`bubble_fraction`): each action takes one unit; a rank runs its list
strictly in order; an action starts at the first step after all of its
dependencies finished (sends are asynchronous and free). ``F(s, m)`` depends
on ``F(p, m)`` for every producer stage ``p`` of ``s``; ``B(s, m)`` depends on
``F(s, m)`` and on ``B(c, m)`` for every consumer stage ``c`` of ``s``.
Producers default to the chain ``s - 1 -> s``; pass ``dependencies`` for
pipelines with skip connections (e.g. ``{1: {0}, 2: {1}, 3: {0, 2}}``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pipecheck._errors import ScheduleError

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "bubble_fraction",
    "chain_dependencies",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "validate",
]

Dependencies = Mapping[int, Collection[int]]

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
            raise ScheduleError(_problem_list(f"cannot build schedule {name!r}", problems))
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
        return _render(self, _simulate(self, _producer_map(self, dependencies)))

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


def chain_dependencies(n_stages: int) -> dict[int, set[int]]:
    """The default producer map ``{s: {s - 1}}``; extend it for skips: ``{**chain, 3: {0, 2}}``."""
    return {stage: {stage - 1} for stage in range(1, n_stages)}


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


# --------------------------------------------------------------------------- validation


def validate(schedule: Schedule, dependencies: Dependencies | None = None) -> None:
    """Raise :class:`ScheduleError` listing every problem of ``schedule``, or return None.

    Checks: each (stage, micro-batch) has exactly one F and one B, on the rank
    that owns the stage, F before B; actions name existing stages and
    micro-batches; ``dependencies`` name existing stages; and, once all that
    holds, that the simulation finishes (no deadlock). A deadlock is reported
    as the timeline grid with ``<-- ERROR HERE`` on each stuck rank.
    """
    _checked_timeline(schedule, dependencies)


def bubble_fraction(schedule: Schedule, dependencies: Dependencies | None = None) -> float:
    """Idle rank-steps / all rank-steps of the simulated timeline (validates first).

    Under unit times GPipe and 1F1B give the textbook ``(p - 1) / (m + p - 1)``
    for ``p`` stages and ``m`` micro-batches.
    """
    return _bubble(schedule, _checked_timeline(schedule, dependencies))


def _checked_timeline(schedule: Schedule, dependencies: Dependencies | None) -> _Timeline:
    problems = _structure_problems(schedule) + _dependency_problems(schedule, dependencies)
    if problems:
        raise ScheduleError(
            _problem_list(f"schedule {schedule.name!r} is invalid", problems)
            + "\n(the deadlock check runs once these are fixed)"
        )
    timeline = _simulate(schedule, _producer_map(schedule, dependencies))
    if timeline.stuck:
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks: at step {timeline.n_steps} no rank can run "
            "its next action\n" + _render(schedule, timeline, with_head=False)
        )
    return timeline


def _structure_problems(schedule: Schedule) -> list[str]:
    n_stages, n_mbs, n_ranks = schedule.n_stages, schedule.n_microbatches, schedule.n_ranks
    problems = [
        f"{label} must be a positive integer ({label}={value!r})"
        for label, value in (("n_stages", n_stages), ("n_microbatches", n_mbs))
        if type(value) is not int or value < 1
    ]
    if len(schedule.stage_to_rank) != n_stages:
        problems.append(
            f"stage_to_rank has {len(schedule.stage_to_rank)} entries but n_stages={n_stages}; "
            "give one rank per stage"
        )
    for stage, rank in enumerate(schedule.stage_to_rank):
        if not 0 <= rank < n_ranks:
            problems.append(
                f"stage_to_rank puts stage {stage} on rank {rank}, but there are {n_ranks} ranks "
                f"(0..{n_ranks - 1})"
            )
    places: dict[Action, list[tuple[int, int]]] = {}
    for rank, row in enumerate(schedule.actions):
        for position, action in enumerate(row):
            where = f"rank {rank}, position {position}: {action}"
            if not 0 <= action.stage < n_stages:
                problems.append(
                    f"{where} refers to stage {action.stage}, but stages are 0..{n_stages - 1}"
                )
            elif not 0 <= action.microbatch < n_mbs:
                problems.append(
                    f"{where} refers to micro-batch {action.microbatch}, "
                    f"but micro-batches are 0..{n_mbs - 1}"
                )
            else:
                owner = (
                    schedule.stage_to_rank[action.stage]
                    if action.stage < len(schedule.stage_to_rank)
                    else None
                )
                if owner is not None and owner != rank:
                    problems.append(
                        f"{where} runs stage {action.stage}, which stage_to_rank puts on rank {owner}"
                    )
                places.setdefault(action, []).append((rank, position))
    return problems + _count_and_order_problems(schedule, places)


def _count_and_order_problems(
    schedule: Schedule, places: Mapping[Action, list[tuple[int, int]]]
) -> list[str]:
    problems: list[str] = []
    missing = [
        str(Action(kind, stage, mb))
        for stage in range(schedule.n_stages)
        for mb in range(schedule.n_microbatches)
        for kind in ("F", "B")
        if Action(kind, stage, mb) not in places
    ]
    if missing:
        problems.append(
            f"missing {len(missing)} action(s): {' '.join(missing)} "
            "(every stage runs one F and one B per micro-batch)"
        )
    for action, where_all in places.items():
        if len(where_all) > 1:
            at = ", ".join(f"rank {r} position {p}" for r, p in where_all)
            problems.append(f"{action} appears {len(where_all)} times ({at}); keep exactly one")
    for action, where_all in places.items():
        forward = places.get(Action("F", action.stage, action.microbatch), [])
        if action.kind == "B" and len(where_all) == 1 and len(forward) == 1:
            (rank, b_pos), (f_rank, f_pos) = where_all[0], forward[0]
            if rank == f_rank and b_pos < f_pos:
                problems.append(
                    f"rank {rank} runs {action} (position {b_pos}) before its forward "
                    f"{action.stage}F{action.microbatch} (position {f_pos}); move the F earlier"
                )
    return problems


def _dependency_problems(schedule: Schedule, dependencies: Dependencies | None) -> list[str]:
    problems: list[str] = []
    valid = range(schedule.n_stages)
    for stage, producers in (dependencies or {}).items():
        if stage not in valid:
            problems.append(
                f"dependencies name stage {stage}, but stages are 0..{schedule.n_stages - 1}"
            )
        for producer in sorted(producers):
            if producer not in valid or producer == stage:
                problems.append(
                    f"dependencies give stage {stage} the producer {producer}; producers must be "
                    f"other stages in 0..{schedule.n_stages - 1}"
                )
    return problems


def _problem_list(title: str, problems: list[str]) -> str:
    return f"{title} ({len(problems)} problem(s)):\n" + "\n".join(f"  - {p}" for p in problems)


# --------------------------------------------------------------------------- simulation


@dataclass
class _Timeline:
    starts: list[list[int]]  # starts[r][i]: step at which actions[r][i] ran (only those that ran)
    n_steps: int
    stuck: dict[int, list[Action]]  # rank -> unmet dependencies of its next action (deadlock only)


def _producer_map(
    schedule: Schedule, dependencies: Dependencies | None
) -> dict[int, frozenset[int]]:
    source = chain_dependencies(schedule.n_stages) if dependencies is None else dependencies
    return {stage: frozenset(producers) for stage, producers in source.items()}


def _needs(
    action: Action, producers: Mapping[int, frozenset[int]], consumers: Mapping[int, list[int]]
) -> list[Action]:
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [Action("F", p, m) for p in sorted(producers.get(s, ()))]
    return [Action("F", s, m)] + [Action("B", c, m) for c in consumers.get(s, [])]


def _simulate(schedule: Schedule, producers: Mapping[int, frozenset[int]]) -> _Timeline:
    consumers: dict[int, list[int]] = {}
    for stage, sources in sorted(producers.items()):
        for producer in sources:
            consumers.setdefault(producer, []).append(stage)
    for targets in consumers.values():
        targets.sort()
    rows = schedule.actions
    starts: list[list[int]] = [[] for _ in rows]
    done: set[Action] = set()
    step = 0
    while any(len(starts[r]) < len(row) for r, row in enumerate(rows)):
        ran: list[Action] = []
        unmet: dict[int, list[Action]] = {}
        for rank, row in enumerate(rows):
            if len(starts[rank]) == len(row):
                continue
            action = row[len(starts[rank])]
            waiting = [need for need in _needs(action, producers, consumers) if need not in done]
            if waiting:
                unmet[rank] = waiting
            else:
                starts[rank].append(step)
                ran.append(action)
        if not ran:
            return _Timeline(starts, step, unmet)
        done.update(ran)  # results become visible at the next step
        step += 1
    return _Timeline(starts, step, {})


def _bubble(schedule: Schedule, timeline: _Timeline) -> float:
    total = timeline.n_steps * schedule.n_ranks
    busy = sum(len(row) for row in schedule.actions)
    return (total - busy) / total if total else 0.0


def _render(schedule: Schedule, timeline: _Timeline, with_head: bool = True) -> str:
    rows = schedule.actions
    width = max(
        [len(str(a)) for row in rows for a in row] + [len(str(max(timeline.n_steps - 1, 0)))]
    )
    labels = [f"rank {rank}" for rank in range(len(rows))]
    label_width = max([len(label) for label in labels] + [len("step")])
    steps = " ".join(str(t).rjust(width) for t in range(timeline.n_steps))
    header = f"{'step'.ljust(label_width)} | {steps}"
    lines = [(header + " | pending" if timeline.stuck else header).rstrip()]
    for rank, row in enumerate(rows):
        cells = [".".center(width)] * timeline.n_steps
        for action, step in zip(row, timeline.starts[rank], strict=False):
            cells[step] = str(action).rjust(width)
        line = f"{labels[rank].ljust(label_width)} | {' '.join(cells)}"
        if timeline.stuck:
            pending = row[len(timeline.starts[rank]) :]
            line += " | " + (" ".join(map(str, pending)) if pending else "(done)")
            if rank in timeline.stuck:
                line += "   <-- ERROR HERE"
        lines.append(line.rstrip())
    head = (
        f"{schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, "
        f"{schedule.n_microbatches} micro-batches, "
    )
    if not timeline.stuck:
        head += f"{timeline.n_steps} steps, bubble {_bubble(schedule, timeline):.1%}"
        return "\n".join([head] + lines)
    head += f"DEADLOCK at step {timeline.n_steps}"
    notes = [_explain(schedule, timeline, rank) for rank in sorted(timeline.stuck)]
    return "\n".join(([head] if with_head else []) + lines + notes)


def _explain(schedule: Schedule, timeline: _Timeline, rank: int) -> str:
    row = schedule.actions[rank]
    action = row[len(timeline.starts[rank])]
    reasons = []
    pending = [acts[len(timeline.starts[r]) :] for r, acts in enumerate(schedule.actions)]
    for need in timeline.stuck[rank]:
        holder = next((r for r, rest in enumerate(pending) if need in rest), None)
        if holder is None:
            reasons.append(f"{need}, which no rank runs")
        elif holder == rank:
            reasons.append(f"{need}, which rank {rank} itself only runs later")
        else:
            blocker = schedule.actions[holder][len(timeline.starts[holder])]
            if blocker == need:
                reasons.append(f"{need}, at which rank {holder} is itself stuck")
            else:
                reasons.append(f"{need}, which rank {holder} will only run after {blocker}")
    return f"  rank {rank} waits at {action} for " + "; and for ".join(reasons)
