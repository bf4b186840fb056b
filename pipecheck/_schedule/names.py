"""Every schedule name pipecheck knows, in one table: whose engines run it and how stages sit on ranks.

    entry = schedule_named("ScheduleZBVZeroBubble")   # any spelling -> its row (None if unknown)
    entry.key, entry.pipecheck, entry.torch_class(1), entry.torchtitan, entry.placement
    name_key(" Interleaved-1F1B ")                    # "interleaved_1f1b": how every name is compared

pipecheck's runtime (``pipecheck.schedules.make_schedule``), runner="torch", runner="torchtitan"
and the command line all read this table; none imports torch (the command line checks names
before paying for it).
"""

from __future__ import annotations

from dataclasses import dataclass


def name_key(name: object) -> str:
    """A schedule name as the table compares it: case, surrounding spaces and "-" vs "_" ignored."""
    return name.strip().lower().replace("-", "_") if isinstance(name, str) else ""


@dataclass(frozen=True)
class ScheduleName:
    """One schedule: its key, every spelling that names it, and what each engine calls it."""

    key: str
    spellings: tuple[str, ...]  # besides the key, as name_key gives them: torch's short and class names
    pipecheck: bool  # pipecheck's runtime builds it
    torch_single: str | None  # torch's class for one stage per rank (a PipelineScheduleSingle), if it differs
    torch_multi: str | None  # torch's class taking a list of stages
    torchtitan: str  # torchtitan's schedule name
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": stages r and 2p - 1 - r on rank r
    stages_per_rank: int | None = None  # required, or None for any
    torch_rule: str = ""  # torch's micro-batch rule: "stages": m >= stages; "rounds": m a multiple of max(1, m // p)

    def torch_class(self, stages_per_rank: int) -> str | None:
        """torch's class for this schedule with ``stages_per_rank`` stages on each rank."""
        return self.torch_single if stages_per_rank == 1 and self.torch_single else self.torch_multi


SCHEDULES: dict[str, ScheduleName] = {
    entry.key: entry for entry in (
        ScheduleName("gpipe", ("schedulegpipe",), True, "ScheduleGPipe", "ScheduleLoopedBFS", "GPipe"),
        ScheduleName("looped_bfs", ("loopedbfs", "scheduleloopedbfs"), False, None, "ScheduleLoopedBFS",
                     "LoopedBFS"),
        ScheduleName("1f1b", ("schedule1f1b",), True, "Schedule1F1B", None, "1F1B", stages_per_rank=1,
                     torch_rule="stages"),
        ScheduleName("interleaved", ("interleaved_1f1b", "interleaved1f1b", "scheduleinterleaved1f1b"), True, None,
                     "ScheduleInterleaved1F1B", "Interleaved1F1B", torch_rule="rounds"),
        ScheduleName("zb", ("zb_h1", "zbh1"), True, None, "ScheduleInterleavedZeroBubble", "InterleavedZeroBubble",
                     stages_per_rank=1, torch_rule="rounds"),
        ScheduleName("interleaved_zb", ("interleavedzerobubble", "scheduleinterleavedzerobubble"), False, None,
                     "ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", torch_rule="rounds"),
        ScheduleName("zbv", ("zb_v", "zbvzerobubble", "schedulezbvzerobubble"), True, None, "ScheduleZBVZeroBubble",
                     "ZBVZeroBubble", placement="v", stages_per_rank=2),
        ScheduleName("dualpipev", ("scheduledualpipev",), False, None, "ScheduleDualPipeV", "DualPipeV",
                     placement="v", stages_per_rank=2, torch_rule="stages"),
    )
}

_BY_SPELLING = {spelling: entry for entry in SCHEDULES.values() for spelling in (entry.key, *entry.spellings)}


def schedule_named(name: object) -> ScheduleName | None:
    """The table's row for any spelling of a schedule's name, or None."""
    return _BY_SPELLING.get(name_key(name))
