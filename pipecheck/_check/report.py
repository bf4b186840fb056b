"""The verdict of a check: one row per compared tensor, a readable table, and hints.

    report = pc.assert_equivalent(model, (x,))
    print(report)            # the headline and every row, or at most 40 lines of them
    print(report.table())    # every row
    report.failures          # rows that failed (empty on success)

The failure table is the product: it names the tensor, the stage(s) that hold
it, its shape, the worst error, the tolerance, the worst index and how many
elements fail, and a hint when the pattern is recognisable. A hint is stated
once, under the first row it covers, naming the rows when it covers several
(one bug in the gradient scaling fails every gradient row with one cause).
A report longer than :data:`MAX_LINES` is cut to what a person reads first:
the count of failing rows by kind and by stage, outputs and loss, a row for
each hint, the worst row of each stage, then the worst of the rest; a last
line says how many rows were left out and how to see them all.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipecheck.errors import plural

if TYPE_CHECKING:  # only named: the command line reads MAX_LINES without importing torch
    from pipecheck._check.numerics import Row
    from pipecheck._runtime.boundaries import Divergence

HEADERS = ("tensor", "stage", "shape", "max abs", "max rel", "tolerance", "worst index", "failing")
FLOAT16_SMALLEST_NORMAL = 2.0 ** -14  # below it float16 is subnormal: a gradient there is rounding steps
MAX_LINES = 40  # a report read whole at 2 a.m., and a test failure that does not scroll away


def percent(fraction: float) -> str:
    """``0.1`` -> ``"10%"``, ``2.8e-6`` -> ``"0.00028%"``."""
    if fraction == float("inf"):
        return "any size"
    value = 100 * fraction
    return f"{value:.0f}%" if value >= 10 else f"{value:.2g}%"


def percent_ceiling(fraction: float) -> str:
    """``fraction`` rounded up to a power of ten, in percent, and never below 0.001% (about 100 float32
    epsilons): ``2.8e-6`` -> ``"0.001%"``, ``0.03`` -> ``"10%"``. A claim stable across the small changes
    that inputs and torch releases make to rounding errors, and never more than the check can see."""
    if fraction == float("inf"):
        return "any size"
    exponent = math.ceil(math.log10(100 * max(fraction, 1e-5)) - 1e-9)
    return f"{10.0 ** exponent:.{max(0, -exponent)}f}%"


def percent_up(fraction: float) -> str:
    """``fraction`` rounded up to one significant digit, in percent: ``0.033`` -> ``"4%"``,
    ``0.0011`` -> ``"0.2%"``. A power stated as the check sees it, never better."""
    if fraction == float("inf"):
        return "any size"
    value = 100 * fraction
    if value <= 0:
        return "0%"
    exponent = math.floor(math.log10(value))
    digit = math.ceil(value / 10.0 ** exponent - 1e-9)
    if digit == 10:  # 0.95% rounds up to 1%, not "1.0%"
        digit, exponent = 1, exponent + 1
    return f"{digit * 10.0 ** exponent:.{max(0, -exponent)}f}%"


def _num(x: float) -> str:
    return f"{x:.2e}" if x == x and x != float("inf") else ("inf" if x == float("inf") else "nan")


def _cells(row: Row) -> tuple[str, ...]:
    shape = "(" + ", ".join(map(str, row.shape)) + ")" if row.shape else "()"
    stages = ",".join(map(str, row.stages)) or "-"
    if row.note and not row.numel:
        return (row.name, stages, shape, "-", "-", row.tolerance, "-", row.note)
    worst = "-" if row.worst_index is None else "(" + ", ".join(map(str, row.worst_index)) + ")"
    failing = f"{row.n_failing}/{row.numel}"
    if row.failing_microbatches:
        failing += f" in mb {','.join(map(str, row.failing_microbatches))}"
    if row.norm_error is not None and row.norm_bound is not None and row.norm_error > row.norm_bound:
        failing += f", norm off {row.norm_error:.1e} > {row.norm_bound:.1e}"  # a spread-out error
    return (row.name, stages, shape, _num(row.max_abs), _num(row.max_rel), row.tolerance, worst, failing)


def _span(names: Sequence[str], order: Sequence[str]) -> str:
    """The rows a hint covers, in few words: all of them when 3 or fewer, the first and last when
    they follow each other in ``order``, else the first three and how many more."""
    if len(names) <= 3:
        return ", ".join(names)
    start = order.index(names[0])
    if list(order[start:start + len(names)]) == list(names):
        return f"{names[0]} ... {names[-1]}"
    return f"{', '.join(names[:3])} and {len(names) - 3} more"


def _hint_lines(shown: Sequence[Row], hints: Mapping[str, str], every: Sequence[Row]) -> dict[str, str]:
    """The hint line under each shown row that gets one: each hint once, under the first shown row it
    covers, with the rows of ``every`` it covers named when there are several."""
    order = [row.name for row in every]
    covers: dict[str, list[str]] = {}
    for name in order:
        if name in hints:
            covers.setdefault(hints[name], []).append(name)
    lines: dict[str, str] = {}
    for row in shown:
        hint = hints.get(row.name)
        if hint is None or hint not in covers:
            continue
        names = covers.pop(hint)  # stated once
        lines[row.name] = (f"  hint: {hint}" if len(names) == 1
                           else f"  hint ({len(names)} rows: {_span(names, order)}): {hint}")
    return lines


def format_table(rows: Sequence[Row], hints: Mapping[str, str] | None = None,
                 every: Sequence[Row] | None = None) -> str:
    """``rows`` as a table; a hint shared by several rows of ``every`` (default ``rows``) is stated once.
    ``rows`` taken from ``every`` keep its order, and rows of ``every`` left out between them are
    counted on a line of their own (those after the last are for the caller to count)."""
    every = rows if every is None else every
    hint_lines = _hint_lines(rows, hints or {}, every)
    position = {row.name: i for i, row in enumerate(every)}
    cells = [HEADERS] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = []
    previous = -1
    for i, line in enumerate(cells):
        if i:
            skipped = position[rows[i - 1].name] - previous - 1
            previous = position[rows[i - 1].name]
            if skipped:
                lines.append(f"... {plural(skipped, 'row')} left out here")
        lines.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
        elif rows[i - 1].name in hint_lines:
            lines.append(hint_lines[rows[i - 1].name])
    return "\n".join(lines)


def _displayed(x: float) -> float:
    """``x`` as the table shows it (3 digits), so float noise does not reorder rows that read the same;
    NaN counts as the worst."""
    return float("inf") if math.isnan(x) else float(f"{x:.2e}")


def pick_rows(failures: Sequence[Row], hints: Mapping[str, str], budget: int) -> list[Row]:
    """The failing rows worth ``budget`` lines (a row takes one, a hint stated under it one more), in
    report order. Picked first: outputs and loss (what the forward gave: a gradient downstream of a wrong
    value is wrong too), then the first row of each hint, then the worst row of each stage (a pipeline bug
    is often one stage's), then the worst of the rest (max rel, then the share of elements failing); rows
    whose errors read the same keep report order."""
    position = {row.name: i for i, row in enumerate(failures)}

    def worst(row: Row) -> tuple[float, float, int]:  # max abs would favour large tensors, not wrong ones
        return (-_displayed(row.max_rel), -row.n_failing / max(row.numel, 1), position[row.name])

    first_of_hint: dict[str, Row] = {}
    worst_of_stage: dict[tuple[int, ...], Row] = {}
    for row in failures:
        if row.name in hints:
            first_of_hint.setdefault(hints[row.name], row)
        if row.stages not in worst_of_stage or worst(row) < worst(worst_of_stage[row.stages]):
            worst_of_stage[row.stages] = row
    tiers = ([row for row in failures if row.kind in ("outputs", "loss")], list(first_of_hint.values()),
             sorted(worst_of_stage.values(), key=lambda row: position[row.name]), sorted(failures, key=worst))
    chosen: set[str] = set()
    stated: set[str] = set()
    used = 0
    for tier in tiers:
        for row in tier:
            hint = hints.get(row.name)
            cost = 1 + (hint is not None and hint not in stated)
            if row.name in chosen or used + cost > budget:
                continue
            chosen.add(row.name)
            used += cost
            if hint is not None:
                stated.add(hint)
    return [row for row in failures if row.name in chosen]


def _counts(rows: Sequence[Row], key: str) -> str:
    """``outputs 0 of 1, loss 0 of 1, grads 52 of 52`` (key "kind") or ``0: 14 of 14, 1: 12 of 12``
    (key "stage": a row held by several stages counts on each)."""
    total: Counter[str | int] = Counter()
    failing: Counter[str | int] = Counter()
    for row in rows:
        for group in ((row.kind,) if key == "kind" else row.stages):
            total[group] += 1
            failing[group] += not row.ok
    if key == "kind":
        from pipecheck._check.numerics import KINDS

        return ", ".join(f"{kind} {failing[kind]} of {total[kind]}" for kind in KINDS if total[kind])
    return ", ".join(f"{stage}: {failing[stage]} of {total[stage]}" for stage in sorted(total, key=int))


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
    # On failure: the earliest boundary value (stage, micro-batch, forward or backward) where the runner
    # and the reference differ, when the runner's stages could record them; ``located`` says it in words.
    first_divergence: Divergence | None = None
    located: str = ""
    training: str = ""  # a check that trained: its loop ("3 steps of SGD, loss mean"); "": one step
    precision: str = ""  # pc.Precision beyond a dtype: "gradients accumulated in float32", "autocast bfloat16"

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    @property
    def power(self) -> float | None:
        """The largest error, as a fraction of its tensor's largest true value, that some compared tensor
        could hide: the check sees every error above it on every tensor (numerically zero tensors aside,
        which see only gross errors). None: no tensor was compared under a tolerance."""
        powers = [r.power for r in self.rows if r.power is not None and not r.numerically_zero]
        return max(powers) if powers else None

    @property
    def norm_power(self) -> float | None:
        """Anchored on eager (a low-precision check): the smallest error, as a fraction of its tensor's
        norm, that every compared tensor sees as a norm (numerically zero tensors aside). None: not
        anchored on eager."""
        bounds = [r.norm_bound for r in self.rows if r.norm_bound is not None and not r.numerically_zero]
        return max(bounds) if bounds else None

    @property
    def blind(self) -> list[Row]:
        """Rows that could hide an error of POWER_LIMIT (10%) of their tensor's scale."""
        return [r for r in self.rows if r.blind]

    def _settings(self) -> str:
        split_by = f" split by {self.tracer}" if self.tracer else ""
        dtype = f"{self.dtype} ({self.precision})" if self.precision else self.dtype
        return (f"tolerance {self.tolerance}, {dtype}, {plural(self.num_stages, 'stage')}{split_by}, "
                f"{plural(self.n_microbatches, 'micro-batch')}" + (f", {self.training}" if self.training else ""))

    def headline(self) -> str:
        if self.ok:
            power, norm = self.power, self.norm_power
            zero = sum(r.numerically_zero for r in self.rows)
            but = f" but {zero} numerically zero" if zero else ""
            sees = "" if power is None else (
                f"; can see errors >= {percent_ceiling(power)} on every row{but}" if norm is None
                else f"; can see errors >= {percent_up(power)} on every element, >= {percent_up(norm)} as a norm{but}")
            return f"pipecheck: runner {self.runner!r} matches eager ({len(self.rows)} tensors{sees}; {self._settings()})"
        return (f"pipecheck: runner {self.runner!r} does not match eager "
                f"({len(self.failures)} of {len(self.rows)} tensors fail; {self._settings()})")

    def power_text(self, max_lines: int = MAX_LINES) -> str:
        """Why a matching check certifies nothing (the PowerError's message): the tensors that could hide
        a gross error, how far eager float32 itself is from float64 on each, and the ways out."""
        from pipecheck._check.numerics import POWER_LIMIT

        blind = sorted(self.blind, key=lambda r: -(r.power or 0.0))
        head = (f"runner {self.runner!r} matched eager, but that certifies nothing: "
                f"{len(blind)} of {len(self.rows)} tensors could hide an error of {percent(POWER_LIMIT)} or more "
                f"({self._settings()})\n"
                + (f"Anchored on eager {self.dtype}, each tolerance is as wide as summing the same numbers in another "
                   "order moves them, and on these tensors that is rounding noise as large as a wrong gradient.\n\n"
                   if self.tolerance.startswith("auto, anchored on eager") else
                   f"The {self.dtype} eager run is itself far from the float64 truth on them, and tolerance 'auto' "
                   "grows with that error, until a wrong gradient fits.\n\n"))
        fix = (f"Fix: make the {self.dtype} run well-conditioned (larger micro-batches, or eval mode: BatchNorm over "
               "a few values per channel is ill-conditioned), check in float64 (dtype=torch.float64, or --dtype "
               "float64 on the command line: eager, runner and truth in float64), or accept what it can see with "
               "an explicit tolerance=pc.Tolerance(rtol=..., atol=...).")
        if self.dtype == "float16" and any(r.scale < FLOAT16_SMALLEST_NORMAL for r in blind):
            fix += (f" In float16, values below {FLOAT16_SMALLEST_NORMAL:.1e} (its smallest normal number) lose bits to "
                    "underflow: scale the loss as float16 training does (a loss_fn returning loss * 1024), or check "
                    "in bfloat16.")
        shown = blind[:max(1, max_lines - 9)]
        cells = [(r.name, ",".join(map(str, r.stages)) or "-", percent(r.power or 0.0),
                  "-" if r.eager_off is None else percent(r.eager_off)) for r in shown]
        table = format_plain_table(("tensor", "stage", "can see errors >=", f"eager {self.dtype} off float64 by"),
                                   cells)
        more = f"\n... {len(blind) - len(shown)} more: err.report.blind lists them" if len(blind) > len(shown) else ""
        return head + table + more + "\n" + fix + self._notes()

    def table(self) -> str:
        """Every row, passing and failing, with its hint: the whole of what ``str(report)`` may cut."""
        return format_table(self.rows, self.hints)

    def text(self, max_lines: int | None = MAX_LINES, see_all: str | None = None) -> str:
        """``str(report)``: the headline and every row when that fits in ``max_lines`` (None: always);
        else the failing rows cut as :meth:`failure_text` cuts them, or on a match the first rows.
        ``see_all``: what the last line says shows every row (default: ``report.table()``)."""
        whole = self.headline() + "\n\n" + self.table() + self._notes()
        if max_lines is None or len(whole.splitlines()) <= max_lines:
            return whole
        if not self.ok:
            return self.failure_text(max_lines, see_all)
        shown = self.rows[:max(1, max_lines - 5 - self._notes().count("\n"))]  # headline, blank, header, last
        left_out = (f"... {len(self.rows) - len(shown)} of {len(self.rows)} rows left out (all match): "
                    f"{see_all or 'print(report.table()) shows every row'}")
        return self.headline() + "\n\n" + format_table(shown) + "\n" + left_out + self._notes()

    def failure_text(self, max_lines: int | None = MAX_LINES, see_all: str | None = None) -> str:
        """The headline and the failing rows (the EquivalenceError's message), in at most ``max_lines``
        lines (None: every failing row). When rows are left out it says how many fail of each kind and
        on each stage, and ``see_all``: how to see every row (default: ``err.report.table()``)."""
        failures = self.failures
        whole = self.headline() + self._located() + "\n\n" + format_table(failures, self.hints) + self._notes()
        if max_lines is None or len(whole.splitlines()) <= max_lines:
            return whole
        # headline, two count lines, blank, table header (2), the line on what was left out, the notes;
        # the budget is for rows and hints: lines counting rows left out between them may take some back
        budget = max_lines - 7 - self._notes().count("\n") - self._located().count("\n")
        while True:
            text = self._cut_failures(pick_rows(failures, self.hints, max(budget, 2)), see_all)
            if len(text.splitlines()) <= max_lines or budget <= 2:
                return text
            budget -= 1

    def _cut_failures(self, shown: Sequence[Row], see_all: str | None) -> str:
        failures = self.failures
        hints_left_out = len({self.hints[r.name] for r in failures if r.name in self.hints}
                             - {self.hints[r.name] for r in shown if r.name in self.hints})
        left_out = f"... {len(failures) - len(shown)} of {len(failures)} failing rows"
        if hints_left_out:
            left_out += f" and {plural(hints_left_out, 'hint')}"
        left_out += f" left out: {see_all or 'print(err.report.table()) shows every row'}"
        return (self.headline() + self._located() + f"\nfailing rows by kind:  {_counts(self.rows, 'kind')}"
                f"\nfailing rows by stage: {_counts(self.rows, 'stage')}\n\n"
                + format_table(shown, self.hints, failures) + "\n" + left_out + self._notes())

    def __str__(self) -> str:
        return self.text()

    def _located(self) -> str:
        return f"\n{self.located}" if self.located and not self.ok else ""

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
