"""Pipeline schedules as printable, validated data.

Usage::

    s = make_schedule("1f1b", n_stages=4, n_microbatches=8)
    validate(s)          # raises ScheduleError listing every problem at once
    print(s.table())     # one row per rank, one column per clock cycle

A schedule is pure data: for each rank, the list of actions it runs in order.
An action is written ``{stage}{F|B|I|W}{microbatch}`` as in torch.distributed.
pipelining: ``1B3`` is the backward of micro-batch 3 through stage 1; the
zero-bubble schedules ("zb", "zbv") split a backward into ``1I3`` (the input
gradients, sent upstream at once) and a later ``1W3`` (the weight gradients).
The runtime that executes a schedule lives elsewhere; this module only builds,
parses, prints and checks schedules (the data types are in
``pipecheck._schedule.data``, the generators in ``pipecheck._schedule.generators``).

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
:func:`simulated_bubble_fraction`; the simulator is ``pipecheck._schedule.sim``):
each action takes one unit; a rank runs its list strictly in order; an action
starts at the first step after all of its dependencies finished (sends are
asynchronous and free). ``F(s, m)`` depends on ``F(p, m)`` for every producer
stage ``p`` of ``s``; ``B(s, m)`` (or ``I(s, m)``) depends on ``F(s, m)`` and on
the ``B`` (or ``I``) of micro-batch ``m`` of every consumer stage ``c`` of
``s``; ``W(s, m)`` depends on ``I(s, m)``. Producers default to the chain
``s - 1 -> s``; pass ``dependencies`` for pipelines with skip connections
(e.g. ``{1: {0}, 2: {1}, 3: {0, 2}}``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipecheck._schedule.data import Action, Schedule, check_positive, ranks_for
from pipecheck._schedule.generators import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zbv,
    zero_bubble_h1,
)
from pipecheck._schedule.names import SCHEDULES, schedule_named
from pipecheck._schedule.sim import (
    Dependencies,
    bubble,
    chain_dependencies,
    checked_timeline,
    simulate,
)
from pipecheck.errors import ScheduleError

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
    "stages_per_rank_of",
    "validate",
    "zbv",
    "zero_bubble_h1",
]

SCHEDULE_NAMES = tuple(key for key, entry in SCHEDULES.items() if entry.pipecheck)
"""The names :func:`make_schedule` builds (pipecheck's runtime runs them), simplest first."""


def stages_per_rank_of(name: str) -> int | None:
    """The stages per rank a schedule name requires (2 for "zbv"), or None when it takes any."""
    entry = schedule_named(name)
    return entry.stages_per_rank if entry is not None else None


def make_schedule(
    name: str, n_stages: int, n_microbatches: int, stages_per_rank: int = 1
) -> Schedule:
    """Build a schedule by name: "gpipe", "1f1b", "interleaved" (alias "interleaved_1f1b"),
    "zb" (ZB-H1, alias "zb_h1") or "zbv".

    Names are case-insensitive ("-" and "_" alike), and torch's names for the same schedules
    are accepted too ("Schedule1F1B", "ZBVZeroBubble": one table of names for every runner,
    ``pipecheck._schedule.names``). ``stages_per_rank > 1`` is supported by
    "gpipe" (looped) and "interleaved"; "1f1b" and "zb" run one stage per rank,
    "zbv" exactly two, in a V (stage ``r`` and ``n_stages - 1 - r`` on rank ``r``).
    A layout a schedule cannot run is a ScheduleError saying which would fit.
    """
    entry = schedule_named(name)
    key = entry.key if entry is not None and entry.pipecheck else None
    if key is None:
        torch_only = entry is not None
        raise ScheduleError(
            f"unknown schedule {name!r}; valid names: 'gpipe', '1f1b', 'interleaved' "
            "(alias 'interleaved_1f1b'), 'zb' (ZB-H1), 'zbv', case-insensitive, or torch's names for them "
            "('Schedule1F1B', ...)"
            + (f". {name!r} is a torch.distributed.pipelining schedule: run it with runner='torch'"
               if torch_only else "")
        )
    check_positive(n_stages=n_stages, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank)
    required = stages_per_rank_of(key)
    if required is not None and stages_per_rank != required:
        raise ScheduleError(_layout_message(key, stages_per_rank))
    if key == "gpipe":
        return gpipe(n_stages, n_microbatches, stages_per_rank=stages_per_rank)
    if key == "1f1b":
        return one_f_one_b(n_stages, n_microbatches)
    if key == "zb":
        return zero_bubble_h1(n_stages, n_microbatches)
    if key == "zbv":
        if n_stages % 2:
            fits = " or ".join(str(n) for n in (n_stages - 1, n_stages + 1) if n > 0)
            raise ScheduleError(f"'zbv' needs an even number of stages (two per rank, in a V), but "
                                f"n_stages={n_stages}; cut the model into {fits} stages, or use 'zb'")
        return zbv(n_stages // 2, n_microbatches)
    return interleaved_1f1b(ranks_for(n_stages, stages_per_rank), stages_per_rank, n_microbatches)


def _layout_message(key: str, stages_per_rank: int) -> str:
    if key == "zbv":
        return (f"the 'zbv' schedule places exactly two stages on each rank, in a V (stage r and "
                f"n_stages - 1 - r on rank r), but stages_per_rank={stages_per_rank}; pass stages_per_rank=2, "
                "or use 'zb' for one stage per rank")
    other = "'interleaved'" if key == "1f1b" else "'zbv' (two per rank) or 'interleaved'"
    return (f"the {key!r} schedule runs one stage per rank (stages_per_rank={stages_per_rank}); "
            f"use {other} for several stages per rank, or stages_per_rank=1")


# --------------------------------------------------------------------------- checks


def validate(schedule: Schedule, dependencies: Dependencies | None = None) -> None:
    """Raise :class:`ScheduleError` listing every problem of ``schedule``, or return None.

    Checks: each (stage, micro-batch) has exactly one F and either one B or
    one I and one W, on the rank that owns the stage, F before B or I, I
    before W; actions name existing stages and micro-batches; ``dependencies``
    name existing stages; and, once all that holds, that the simulation
    finishes (no deadlock). A deadlock is reported as the timeline grid with
    ``<-- ERROR HERE`` on each stuck rank.
    """
    checked_timeline(schedule, dependencies)


def simulated_bubble_fraction(schedule: Schedule, dependencies: Dependencies | None = None, *,
                              durations: Mapping[str, int] | None = None) -> float:
    """Idle rank-steps / all rank-steps of the simulated timeline; validates first.

    Every action takes one step unless ``durations`` says otherwise, e.g.
    ``{"B": 2}``: a full backward as long as its I and W halves together, the
    zero-bubble paper's cost model. Under unit times GPipe and 1F1B give the
    textbook ``(p - 1) / (m + p - 1)`` for ``p`` stages and ``m`` micro-batches.
    (A run's measured bubble is in its timeline: ``trace_path=``.)
    """
    checked_timeline(schedule, dependencies)
    return bubble(schedule, simulate(schedule, dependencies, durations), durations)
