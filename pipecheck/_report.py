"""The verdict of a check: one row per compared tensor, a readable table, and hints.

    report = pc.assert_equivalent(model, (x,))
    print(report)            # every tensor, its error and tolerance
    report.failures          # rows that failed (empty on success)

The failure table is the product: it names the tensor, the stage(s) that hold
it, its shape, the worst error, the tolerance, the worst index and how many
elements fail, and a one-line hint when the pattern is recognisable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecheck._errors import plural
from pipecheck._numerics import Row

HEADERS = ("tensor", "stage", "shape", "max abs", "max rel", "tolerance", "worst index", "failing")


def _num(x: float) -> str:
    return f"{x:.2e}" if x == x and x != float("inf") else ("inf" if x == float("inf") else "nan")


def _cells(row: Row) -> tuple[str, ...]:
    shape = "(" + ", ".join(map(str, row.shape)) + ")" if row.shape else "()"
    stages = ",".join(map(str, row.stages)) or "-"
    if row.note and not row.numel:
        return (row.name, stages, shape, "-", "-", row.tolerance, "-", row.note)
    worst = "-" if row.worst_index is None else "(" + ", ".join(map(str, row.worst_index)) + ")"
    failing = f"{row.n_failing}/{row.numel}"
    return (row.name, stages, shape, _num(row.max_abs), _num(row.max_rel), row.tolerance, worst, failing)


def format_table(rows: Sequence[Row], hints: dict[str, str] | None = None) -> str:
    cells = [HEADERS] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = []
    for i, line in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
        elif hints and rows[i - 1].name in hints:
            lines.append(f"  hint: {hints[rows[i - 1].name]}")
    return "\n".join(lines)


@dataclass
class Report:
    """Every compared tensor of one check, the settings used, and timings in seconds."""

    runner: str
    rows: list[Row]
    hints: dict[str, str] = field(default_factory=dict)
    tolerance: str = "auto"
    dtype: str = "float32"
    n_microbatches: int = 1
    num_stages: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was not compared, and why
    tracer: str = ""  # which tracer made the split: "fx" or "export"

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def headline(self) -> str:
        split_by = f" split by {self.tracer}" if self.tracer else ""
        settings = (f"tolerance {self.tolerance}, {self.dtype}, {plural(self.num_stages, 'stage')}{split_by}, "
                    f"{plural(self.n_microbatches, 'micro-batch')}")
        if self.ok:
            return f"pipecheck: runner {self.runner!r} matches eager ({len(self.rows)} tensors; {settings})"
        return (f"pipecheck: runner {self.runner!r} does not match eager "
                f"({len(self.failures)} of {len(self.rows)} tensors fail; {settings})")

    def failure_text(self) -> str:
        return self.headline() + "\n\n" + format_table(self.failures, self.hints) + self._notes()

    def __str__(self) -> str:
        return self.headline() + "\n\n" + format_table(self.rows, self.hints) + self._notes()

    def _notes(self) -> str:
        return "".join(f"\nnote: {note}" for note in self.notes)


def format_plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """A left-aligned text table (or a markdown one) of string cells."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    sep = " | " if markdown else "  "
    lines = []
    for i, line in enumerate(cells):
        text = sep.join(c.ljust(w) for c, w in zip(line, widths))
        lines.append(f"| {text} |" if markdown else text.rstrip())
        if i == 0:
            rule = sep.join("-" * w for w in widths)
            lines.append(f"| {rule} |" if markdown else rule)
    return "\n".join(lines)
