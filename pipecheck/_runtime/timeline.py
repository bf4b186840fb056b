"""The timeline of a distributed step: events per rank, a Chrome-trace / Perfetto file, bubbles.

    res = pc.run_pipeline(world, model, (x,), trace_path="step.json")   # open in ui.perfetto.dev
    measured_bubble_fraction(res.events)                               # measured idle share

Times are ``time.monotonic_ns()``, one clock for every process on a machine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Event:
    rank: int
    category: str  # "forward" | "backward" | "send" | "recv"
    name: str  # e.g. "2F0", "1B3<-2"
    start_ns: int
    end_ns: int


def chrome_trace(events: Sequence[Event], schedule: Any = None) -> dict[str, Any]:
    """Trace-event JSON: one row (thread) per rank, idle gaps shown as "idle" slices."""
    if not events:
        return {"traceEvents": []}
    origin = min(e.start_ns for e in events)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        compute = sorted((e for e in events if e.rank == rank), key=lambda e: e.start_ns)
        cursor = origin
        for event in compute:
            if event.category in ("forward", "backward") and event.start_ns > cursor:
                trace.append(_slice("idle", "idle", rank, cursor, event.start_ns, origin))
            trace.append(_slice(event.name, event.category, rank, event.start_ns, event.end_ns, origin))
            cursor = max(cursor, event.end_ns)
    meta = {"schedule": getattr(schedule, "name", None), "bubble_fraction": measured_bubble_fraction(events)}
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta}


def _slice(name: str, category: str, rank: int, start: int, end: int, origin: int) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": category, "pid": 0, "tid": rank,
            "ts": (start - origin) / 1000.0, "dur": max(end - start, 0) / 1000.0}


def write_chrome_trace(path: str | Path, events: Sequence[Event], schedule: Any = None) -> None:
    Path(path).write_text(json.dumps(chrome_trace(events, schedule), indent=1))


def measured_bubble_fraction(events: Sequence[Event]) -> float:
    """Idle share of the step: 1 - (forward+backward time) / (ranks x span of the step)."""
    compute = [e for e in events if e.category in ("forward", "backward")]
    if not compute:
        return 0.0
    ranks = {e.rank for e in compute}
    span = max(e.end_ns for e in compute) - min(e.start_ns for e in compute)
    busy = sum(e.end_ns - e.start_ns for e in compute)
    return 1.0 - busy / (len(ranks) * span) if span else 0.0
