"""Check and draw a schedule by simulating it: every action takes one clock cycle.

    problems = structure_problems(schedule)          # each (stage, mb) F once and B once (or I and W)
    timeline = simulate(schedule, producers)         # when each action runs; who is stuck, if any
    print(render(schedule, timeline))                # the grid, "<-- ERROR HERE" on stuck ranks

Timing model: each action takes one unit (or ``durations[kind]`` units); a
rank runs its list strictly in order; an action starts at the first step
after all of its dependencies finished (sends are asynchronous and free).
``F(s, m)`` depends on ``F(p, m)`` for every producer stage ``p`` of ``s``;
``B(s, m)`` depends on ``F(s, m)`` and on the gradient of micro-batch ``m``
from every consumer stage ``c`` of ``s``: ``B(c, m)``, or ``I(c, m)`` where the
schedule splits that backward. ``I(s, m)`` depends on what ``B(s, m)`` would;
``W(s, m)`` on ``I(s, m)`` (the weight gradients need the output gradients
that I received).

This module reads any object shaped like :class:`pipecheck.schedules.Schedule`
(``n_stages``, ``n_microbatches``, ``stage_to_rank``, ``actions``, ``name``) whose
actions have ``kind``, ``stage`` and ``microbatch``; it imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from pipecheck.errors import ScheduleError, plural

Dependencies = Mapping[int, Collection[int]]
Key = tuple[str, int, int]  # (kind, stage, micro-batch): an action as data
KINDS = ("F", "B", "I", "W")  # forward, backward, and a backward's input-gradient and weight-gradient halves


class ActionLike(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def microbatch(self) -> int: ...


class ScheduleLike(Protocol):
    @property
    def n_stages(self) -> int: ...
    @property
    def n_microbatches(self) -> int: ...
    @property
    def stage_to_rank(self) -> tuple[int, ...]: ...
    @property
    def actions(self) -> tuple[tuple[ActionLike, ...], ...]: ...
    @property
    def name(self) -> str: ...


def key(action: ActionLike) -> Key:
    return (action.kind, action.stage, action.microbatch)


def label(k: Key) -> str:
    """``(kind, stage, mb)`` written as an action: ``("B", 1, 3)`` -> ``"1B3"``."""
    return f"{k[1]}{k[0]}{k[2]}"


def chain_dependencies(n_stages: int) -> dict[int, set[int]]:
    """The default producer map ``{s: {s - 1}}``; extend it for skips: ``{**chain, 3: {0, 2}}``."""
    return {stage: {stage - 1} for stage in range(1, n_stages)}


# --------------------------------------------------------------------------- validation


def checked_timeline(schedule: ScheduleLike, dependencies: Dependencies | None) -> Timeline:
    """The simulated timeline; a ScheduleError listing every problem, or drawing the deadlock."""
    problems = structure_problems(schedule) + _dependency_problems(schedule, dependencies)
    if problems:
        raise ScheduleError(
            problem_list(f"schedule {schedule.name!r} is invalid", problems)
            + "\n(the deadlock check runs once these are fixed)"
        )
    timeline = simulate(schedule, dependencies)
    if timeline.stuck:
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks: at step {timeline.n_steps} no rank can run "
            "its next action\n" + render(schedule, timeline, with_head=False)
        )
    return timeline


def _n_ranks(schedule: ScheduleLike) -> int:
    return len(schedule.actions)


def structure_problems(schedule: ScheduleLike) -> list[str]:
    """Every way the action lists break the rules (each (stage, mb) one F and either one B or one I
    and one W, on the rank holding the stage, F first, I before W), in one list."""
    n_stages, n_mbs, n_ranks = schedule.n_stages, schedule.n_microbatches, _n_ranks(schedule)
    problems = [
        f"{name} must be a positive integer ({name}={value!r})"
        for name, value in (("n_stages", n_stages), ("n_microbatches", n_mbs))
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
    places: dict[Key, list[tuple[int, int]]] = {}
    for rank, row in enumerate(schedule.actions):
        for position, action in enumerate(row):
            where = f"rank {rank}, position {position}: {action}"
            if action.kind not in KINDS:
                problems.append(f"{where} has kind {action.kind!r}; kinds are {', '.join(KINDS)}")
            elif not 0 <= action.stage < n_stages:
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
                places.setdefault(key(action), []).append((rank, position))
    return problems + _count_and_order_problems(schedule, places)


def _missing(stage: int, mb: int, places: Mapping[Key, list[tuple[int, int]]]) -> list[str]:
    """The actions (stage, mb) lacks: its F, and a B, or whichever half of a split backward is absent."""
    missing = [] if ("F", stage, mb) in places else [label(("F", stage, mb))]
    halves = [kind for kind in ("I", "W") if (kind, stage, mb) in places]
    if ("B", stage, mb) not in places:
        wanted = [kind for kind in ("I", "W") if kind not in halves] if halves else ["B"]
        missing += [label((kind, stage, mb)) for kind in wanted]
    return missing


def _count_and_order_problems(
    schedule: ScheduleLike, places: Mapping[Key, list[tuple[int, int]]]
) -> list[str]:
    problems: list[str] = []
    split = any(kind in ("I", "W") for kind, _, _ in places)
    missing = [name for stage in range(schedule.n_stages) for mb in range(schedule.n_microbatches)
               for name in _missing(stage, mb, places)]
    if missing:
        rule = "one F and either one B or one I and one W" if split else "one F and one B"
        problems.append(
            f"missing {len(missing)} action(s): {' '.join(missing)} "
            f"(every stage runs {rule} per micro-batch)"
        )
    for k, where_all in places.items():
        if len(where_all) > 1:
            at = ", ".join(f"rank {r} position {p}" for r, p in where_all)
            problems.append(f"{label(k)} appears {len(where_all)} times ({at}); keep exactly one")
    for (kind, stage, mb), where_all in places.items():
        if kind == "B" and any((half, stage, mb) in places for half in ("I", "W")):
            problems.append(
                f"{label((kind, stage, mb))} and a split backward ({label(('I', stage, mb))}/"
                f"{label(('W', stage, mb))}) both appear; a micro-batch's backward is one B, or one I "
                "then one W"
            )
        before = {"B": "F", "I": "F", "W": "I"}.get(kind)
        earlier = places.get((before, stage, mb), []) if before else []
        if before is not None and len(where_all) == 1 and len(earlier) == 1:
            (rank, pos), (e_rank, e_pos) = where_all[0], earlier[0]
            if rank == e_rank and pos < e_pos:
                what = "forward" if before == "F" else "input gradient"
                problems.append(
                    f"rank {rank} runs {label((kind, stage, mb))} (position {pos}) before its {what} "
                    f"{label((before, stage, mb))} (position {e_pos}); move the {before} earlier"
                )
    return problems


def _dependency_problems(schedule: ScheduleLike, dependencies: Dependencies | None) -> list[str]:
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


def problem_list(title: str, problems: list[str]) -> str:
    return f"{title} ({len(problems)} problem(s)):\n" + "\n".join(f"  - {p}" for p in problems)


# --------------------------------------------------------------------------- simulation


@dataclass
class Timeline:
    """When each action ran under unit times; on a deadlock, what each stuck rank waits for."""

    starts: list[list[int]]  # starts[r][i]: step at which actions[r][i] ran (only those that ran)
    n_steps: int
    stuck: dict[int, list[Key]]  # rank -> unmet dependencies of its next action (deadlock only)


def _producer_map(n_stages: int, dependencies: Dependencies | None) -> dict[int, frozenset[int]]:
    source = chain_dependencies(n_stages) if dependencies is None else dependencies
    return {stage: frozenset(producers) for stage, producers in source.items()}


def _needs(k: Key, producers: Mapping[int, frozenset[int]], consumers: Mapping[int, list[int]],
           split: frozenset[tuple[int, int]]) -> list[Key]:
    """What action ``k`` waits for; ``split`` holds the (stage, mb) whose backward is I + W."""
    kind, s, m = k
    if kind == "F":
        return [("F", p, m) for p in sorted(producers.get(s, ()))]
    if kind == "W":
        return [("I", s, m)]
    return [("F", s, m)] + [("I" if (c, m) in split else "B", c, m) for c in consumers.get(s, [])]


def simulate(schedule: ScheduleLike, dependencies: Dependencies | None = None,
             durations: Mapping[str, int] | None = None) -> Timeline:
    """Run the action lists (producers default to the chain ``s - 1 -> s``); each action takes
    ``durations.get(kind, 1)`` steps."""
    producers = _producer_map(schedule.n_stages, dependencies)
    consumers: dict[int, list[int]] = {}
    for stage, sources in sorted(producers.items()):
        for producer in sources:
            consumers.setdefault(producer, []).append(stage)
    for targets in consumers.values():
        targets.sort()
    rows = [[key(a) for a in row] for row in schedule.actions]
    split = frozenset((s, m) for row in rows for kind, s, m in row if kind == "I")
    cost = {kind: 1 for kind in KINDS} | dict(durations or {})
    starts: list[list[int]] = [[] for _ in rows]
    finish: dict[Key, int] = {}  # the step from which an action's results are visible
    free = [0] * len(rows)  # the step from which each rank can start its next action
    step = 0
    while any(len(starts[r]) < len(row) for r, row in enumerate(rows)):
        unmet: dict[int, list[Key]] = {}
        for rank, row in enumerate(rows):
            if len(starts[rank]) == len(row) or free[rank] > step:
                continue
            action = row[len(starts[rank])]
            waiting = [need for need in _needs(action, producers, consumers, split)
                       if finish.get(need, step + 1) > step]
            if waiting:
                unmet[rank] = waiting
            else:
                starts[rank].append(step)
                free[rank] = finish[action] = step + cost[action[0]]
        if len(unmet) == sum(len(starts[r]) < len(row) for r, row in enumerate(rows)) \
                and all(at <= step for at in free):
            return Timeline(starts, step, unmet)  # nobody ran, nobody is busy: a deadlock
        step += 1
    return Timeline(starts, max(finish.values(), default=0), {})


def bubble(schedule: ScheduleLike, timeline: Timeline, durations: Mapping[str, int] | None = None) -> float:
    """Idle rank-steps / all rank-steps of ``timeline`` (simulated with ``durations``)."""
    total = timeline.n_steps * _n_ranks(schedule)
    cost = dict(durations or {})
    busy = sum(cost.get(action.kind, 1) for row in schedule.actions for action in row)
    return (total - busy) / total if total else 0.0


def render(schedule: ScheduleLike, timeline: Timeline, with_head: bool = True) -> str:
    """The timeline as a grid, one row per rank; on a deadlock the pending actions, ``<-- ERROR HERE``
    on each stuck rank and why it waits."""
    rows = schedule.actions
    width = max(
        [len(str(a)) for row in rows for a in row] + [len(str(max(timeline.n_steps - 1, 0)))]
    )
    labels = [f"rank {rank}" for rank in range(len(rows))]
    label_width = max([len(text) for text in labels] + [len("step")])
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
        f"{schedule.name}: {plural(schedule.n_stages, 'stage')} on {plural(_n_ranks(schedule), 'rank')}, "
        f"{plural(schedule.n_microbatches, 'micro-batch')}, "
    )
    if not timeline.stuck:
        head += f"{timeline.n_steps} steps, bubble {bubble(schedule, timeline):.1%}"
        return "\n".join([head] + lines)
    head += f"DEADLOCK at step {timeline.n_steps}"
    notes = [_explain(schedule, timeline, rank) for rank in sorted(timeline.stuck)]
    return "\n".join(([head] if with_head else []) + lines + notes)


def _explain(schedule: ScheduleLike, timeline: Timeline, rank: int) -> str:
    row = schedule.actions[rank]
    action = row[len(timeline.starts[rank])]
    reasons = []
    pending = [[key(a) for a in acts[len(timeline.starts[r]) :]] for r, acts in enumerate(schedule.actions)]
    for need in timeline.stuck[rank]:
        holder = next((r for r, rest in enumerate(pending) if need in rest), None)
        if holder is None:
            reasons.append(f"{label(need)}, which no rank runs")
        elif holder == rank:
            reasons.append(f"{label(need)}, which rank {rank} itself only runs later")
        else:
            blocker = schedule.actions[holder][len(timeline.starts[holder])]
            if key(blocker) == need:
                reasons.append(f"{label(need)}, at which rank {holder} is itself stuck")
            else:
                reasons.append(f"{label(need)}, which rank {holder} will only run after {blocker}")
    return f"  rank {rank} waits at {action} for " + "; and for ".join(reasons)
