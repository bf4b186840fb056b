"""A schedule as data: :class:`Action` and :class:`Schedule` (re-exported by ``pipecheck.schedules``).

    s = Schedule.from_lists(2, 2, None, [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    s.to_lists()        # the same compact strings back
    print(s.table())    # the simulated timeline, one row per rank

An action is written ``{stage}{kind}{microbatch}`` as in torch.distributed.
pipelining: ``1B3`` is the backward of micro-batch 3 through stage 1. Kinds:
``F`` forward, ``B`` full backward, and the two halves of a split backward
(zero-bubble schedules): ``I`` the input gradients, sent on to the producer
stages at once, and ``W`` the weight gradients of the same micro-batch, run
later to fill what would be a bubble.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecheck._schedule.sim import Dependencies, checked_timeline, problem_list, render, simulate
from pipecheck.errors import ScheduleError

KINDS = ("F", "B", "I", "W")
_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    """One unit of work on ``microbatch`` through ``stage``: ``kind`` "F" (forward), "B" (backward),
    or "I" / "W" (the input-gradient and weight-gradient halves of a backward)."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f'Action kind must be "F", "B", "I" or "W" (kind={self.kind!r})')

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form ``{stage}{F|B|I|W}{microbatch}``, e.g. ``"0F1"``."""
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '{{stage}}{{F|B|I|W}}{{microbatch}}' such as '0F1'"
            )
        return cls(match.group(2).upper(), int(match.group(1)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank lists of :class:`Action`, in execution order.

    ``stage_to_rank[s]`` is the rank that holds stage ``s``; ``actions[r]`` is
    what rank ``r`` runs. Lists are converted to tuples. Construction does not
    validate: call :func:`pipecheck.schedules.validate` (or :meth:`validate`).
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

    @property
    def splits_backward(self) -> bool:
        """True when some backward is split into I and W actions (a zero-bubble schedule)."""
        return any(action.kind in ("I", "W") for row in self.actions for action in row)

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
        """Same as :func:`pipecheck.schedules.validate`."""
        checked_timeline(self, dependencies)

    def table(self, dependencies: Dependencies | None = None) -> str:
        """The simulated timeline as a grid; a deadlock is drawn with ``<-- ERROR HERE``."""
        return render(self, simulate(self, dependencies))

    def __str__(self) -> str:
        return self.table()


def check_positive(**values: int) -> None:
    """ScheduleError naming every size that is not a positive int."""
    bad = [f"{k}={v!r}" for k, v in values.items() if type(v) is not int or v < 1]
    if bad:
        raise ScheduleError(f"schedule sizes must be positive integers ({', '.join(bad)})")


def ranks_for(n_stages: int, stages_per_rank: int) -> int:
    """The ranks that hold ``n_stages`` stages, ``stages_per_rank`` each (which must divide it)."""
    if n_stages % stages_per_rank:
        raise ScheduleError(
            "n_stages must be a multiple of stages_per_rank "
            f"(n_stages={n_stages}, stages_per_rank={stages_per_rank}); "
            "change the number of stages or of stages per rank"
        )
    return n_stages // stages_per_rank


def round_robin(n_stages: int, n_ranks: int) -> tuple[int, ...]:
    """Loop placement: stage ``s`` on rank ``s % n_ranks``."""
    return tuple(stage % n_ranks for stage in range(n_stages))


def v_shape(n_ranks: int) -> tuple[int, ...]:
    """V placement of ``2 * n_ranks`` stages: stages ``r`` and ``2 * n_ranks - 1 - r`` on rank ``r``."""
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))
