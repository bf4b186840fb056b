"""``pipecheck zoo``: every zoo model through every runner (or runner and schedule), as a table
that can be written into a markdown page (docs/zoo.md) between markers.

    pipecheck zoo --write-markdown docs/zoo.md                 # the main table
    pipecheck zoo --columns distributed:zb,torch:zbv --write-markdown docs/zoo.md --block zero-bubble
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from pipecheck._cli.options import DTYPES, RUNNERS, device_option, dtype_option, runner_option
from pipecheck._runners import registry
from pipecheck.errors import (
    AdapterError,
    EquivalenceError,
    PipecheckError,
    PowerError,
    ScheduleError,
    UsageError,
    first_line,
    plural,
)

# zoo columns whose mismatches never change its exit status: other people's engines (findings, not failures)
NOT_COUNTED = ("torch", *registry.OPTIONAL)
ZOO_STATUS = textwrap.fill(
    "zoo exits 0 when every cell of pipecheck's own runners passes, 1 when one of them is FAIL, 2 when one is "
    "REFUSED (it matched, but some rows could hide an error of 10%), 3 when one is ERROR; the columns of the "
    f"engines under test ({', '.join(NOT_COUNTED)}) show their known failures and never change it, except an "
    "AdapterError (pipecheck's own adapter broken by the installed release) or an internal error, pipecheck's "
    "failures in any column: exit 4 (1 if a cell is also FAIL).", width=100)
TRAINING_COLUMN = "training"  # --training: pipecheck's runtime trained as engines train


def adamw(params: Any) -> Any:
    """The --training column's optimizer (top-level: it travels to the ranks)."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3)


TRAINING: dict[str, Any] = {"steps": 3, "accumulation_steps": 2, "optimizer": adamw, "clip_grad_norm": 1.0, "data_parallel": 2}
"""The --training column: 3 optimizer steps of AdamW with clipping, 2 accumulation steps each, 2 data-parallel
replicas of the pipeline (so a model of p stages runs on 2p ranks)."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One zoo cell: what the table shows, its outcome ("pass", "fail", "refused", "n/a", "error", "adapter":
    pipecheck's own adapter broken, or "internal": a bug in pipecheck, both counted in every column),
    and the whole first line of the failure (the table cuts it)."""

    text: str
    outcome: str
    message: str = ""


COUNTED_EVERYWHERE = ("adapter", "internal")


class Progress:
    """One line on a terminal, rewritten as the zoo goes (``zoo: 7/39 cells, tiny_gpt x torch, 12s``)
    and cleared at the end; nothing at all where ``stream`` is not a terminal (a pipe, a CI log) or
    where ``quiet`` (``-v`` prints each row instead)."""

    def __init__(self, total: int, stream: Any = None, quiet: bool = False) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total = total
        self.started = time.perf_counter()
        isatty = getattr(self.stream, "isatty", None)
        self.live = not quiet and callable(isatty) and bool(isatty())

    def show(self, done: int, model: str, column: str) -> None:
        if self.live:
            elapsed = time.perf_counter() - self.started
            self.stream.write(f"\r\033[Kzoo: {done}/{self.total} cells, {model} x {column}, {elapsed:.0f}s")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()


def zoo_cell(run: Callable[[], Any]) -> Cell:
    """Run one zoo cell; never raises but on Ctrl-C."""
    report: Any
    try:
        report = run()
    except EquivalenceError as err:
        report = err.report
        row = report.failures[0]
        hint = report.hints.get(row.name)
        return Cell(f"FAIL {row.name}" + (f" ({hint.split(':')[0]})" if hint else ""), "fail", first_line(err))
    except PowerError as err:  # it matched, but some rows could hide a gross error: no certificate
        blind = len(getattr(err.report, "blind", ()))
        return Cell(f"REFUSED: {blind} blind (cannot see 10%)", "refused", first_line(err))
    except ScheduleError as err:  # a layout the schedule cannot run, refused before any rank starts
        return Cell(f"n/a: {_refusal(err)}", "n/a", first_line(err))
    except PipecheckError as err:
        first = first_line(err)
        outcome = "adapter" if isinstance(err, AdapterError) else "error"
        return Cell(f"ERROR {type(err).__name__}: {first[:70]}", outcome, first)
    except Exception as err:  # not one of pipecheck's errors: pipecheck's bug, whichever column
        first = f"{type(err).__name__}: {first_line(err)}"
        return Cell(f"INTERNAL ERROR {first[:70]}", "internal", first)
    worst = max((r.max_abs for r in report.rows if r.numel), default=0.0)
    return Cell(f"pass (max abs {worst:.1e})", "pass")


def _refusal(err: Exception) -> str:
    """The rule a refused layout breaks, in a few words (the message's first problem)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    problem = next((line[2:] for line in lines if line.startswith("- ")), lines[0] if lines else "")
    return problem.split(";")[0][:80]


def stages_per_rank_for(runner: str, schedule: str, default: int) -> int:
    """The stages per rank ``schedule`` runs on ``runner`` (2 for the V schedules), else ``default``; every
    runner reads the one table of schedule names (``pipecheck._schedule.names``)."""
    from pipecheck._schedule.names import schedule_named

    entry = schedule_named(schedule)
    required = entry.stages_per_rank if entry is not None else None
    return default if required is None else required


def cmd_zoo(args: argparse.Namespace) -> int:
    schedules = args.schedules.split(",") if args.schedules else [args.schedule]
    if args.columns:
        pairs = [(column.partition(":")[0], column.partition(":")[2] or args.schedule)
                 for column in args.columns.split(",")]
        schedules = list(dict.fromkeys(schedule for _, schedule in pairs))
    else:
        pairs = [(spec, schedule) for spec in (args.runners.split(",") if args.runners else RUNNERS)
                 for schedule in schedules]
    columns = [(*runner_option(spec), schedule) for spec, schedule in pairs]  # (column, runner, schedule)
    if args.training:
        columns.append((TRAINING_COLUMN, "distributed", args.schedule))
    if args.write_markdown:  # a file without the markers fails now, not after the zoo
        write_marked_block(args.write_markdown, None, args.block)
    if args.json:
        _write_json(args.json, None)
    device = device_option(args.device)

    from pipecheck._check.report import format_plain_table
    from pipecheck.fixtures import entries

    try:
        zoo = entries(args.models.split(",") if args.models else ())
    except KeyError as err:
        raise UsageError(f"--models: {err.args[0]}. Fix: choose from those names and tags.") from None
    rows: list[list[str]] = []
    outcomes: set[str] = set()
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    progress = Progress(len(zoo) * len(columns), quiet=args.verbose)
    try:
        _run_zoo(args, zoo, columns, device, rows, outcomes, records, progress)
    finally:
        progress.close()
    summary = _summary(args, rows, columns, schedules, started)
    names = [column if len(schedules) == 1 else schedule if len(set(c for c, _, _ in columns)) == 1
             else f"{column} {schedule}" for column, _, schedule in columns]
    headers = ["model", "stages", "cut", *names]
    import torch

    print(format_plain_table(headers, rows, markdown=args.markdown))
    print(f"\n{summary}")
    if args.write_markdown:
        table = format_plain_table(headers, rows, markdown=True)
        command = " ".join(["python -m pipecheck", *args.argv])
        write_marked_block(args.write_markdown, f"{table}\n\n_{summary}; generated by `{command}`._", args.block)
    status = (1 if "fail" in outcomes else 4 if outcomes & set(COUNTED_EVERYWHERE) else
              3 if "error" in outcomes else 2 if "refused" in outcomes else 0)
    if args.json:
        _write_json(args.json, {"torch": torch.__version__, "status": status, "summary": summary, "cells": records})
    return status


def _run_zoo(args: argparse.Namespace, zoo: list[Any], columns: list[tuple[str, Any, str]], device: Any,
             rows: list[list[str]], outcomes: set[str], records: list[dict[str, Any]], progress: Progress) -> None:
    """Every zoo cell, row by row, into ``rows``, ``outcomes`` and ``records``."""
    import pipecheck as pc

    for entry in zoo:
        style = entry.cut_styles[0]
        call_args, call_kwargs = entry.inputs()
        cells = [entry.name, str(entry.num_stages), style]
        for column, runner, schedule in columns:
            progress.show(len(records), entry.name, column)
            run = functools.partial(
                pc.assert_equivalent, entry.factory(style), call_args, call_kwargs, runner=runner,
                loss_fn=entry.loss_fn, target=entry.target(), n_microbatches=args.n_microbatches,
                schedule=schedule, stages_per_rank=stages_per_rank_for(column, schedule, args.stages_per_rank),
                dtype=dtype_option(args.dtype), device=device, timeout=args.timeout, **entry.cut(style),
                **(TRAINING if column == TRAINING_COLUMN else {}))
            cell = zoo_cell(run)
            built_in = registry.runner_named(column)
            if built_in is None or built_in.name not in NOT_COUNTED or cell.outcome in COUNTED_EVERYWHERE:
                outcomes.add(cell.outcome)
            cells.append(cell.text)
            records.append({"model": entry.name, "column": column, "schedule": schedule,
                            **dataclasses.asdict(cell)})
        rows.append(cells)
        if args.verbose:
            print(" | ".join(cells), file=sys.stderr)


def _summary(args: argparse.Namespace, rows: list[list[str]], columns: list[tuple[str, Any, str]],
             schedules: list[str], started: float) -> str:
    import torch

    what = f"schedule {schedules[0]}" if len(schedules) == 1 else f"schedules {', '.join(schedules)}"
    across = (f"{len(columns)} columns" if args.columns or len(schedules) > 1
              else plural(len(columns), "runner"))
    dtype = DTYPES.get(args.dtype, args.dtype)  # "bf16" said as "bfloat16", as the reports say it
    return (f"{plural(len(rows), 'model')} x {across}, {dtype}, {plural(args.n_microbatches, 'micro-batch')}, "
            f"{what}, torch {torch.__version__}, in {time.perf_counter() - started:.1f}s")


def _write_json(path: str, data: dict[str, Any] | None) -> None:
    """Write ``data`` as JSON to ``path``; None: only check, before the zoo runs, that it could be
    written (its folder exists and is writable), without creating or touching the file."""
    import json
    import os
    from pathlib import Path

    target = Path(path)
    if data is None:
        folder = target.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK) or target.is_dir():
            raise UsageError(f"cannot write --json {path}: {folder} is not a writable folder"
                             f"{' (it is a folder)' if target.is_dir() else ''}. Fix: give a writable path.")
        return
    try:
        target.write_text(json.dumps(data, indent=1) + "\n")
    except OSError as err:
        raise UsageError(f"cannot write --json {path}: {err.strerror}. Fix: give a writable path.") from None


def markers(block: str | None) -> tuple[str, str]:
    """The begin/end markers of the zoo table ``block`` (None: the main one)."""
    name = f"pipecheck-zoo-{block}" if block else "pipecheck-zoo"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_marked_block(path: str, body: str | None, block: str | None = None) -> None:
    """Replace the text between the zoo markers of ``block`` in ``path`` (docs/zoo.md) with ``body``
    (None: only check that they are there)."""
    from pathlib import Path

    begin, end = markers(block)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"cannot read --write-markdown {path}: {err.strerror}. Fix: give an existing "
                         "markdown file, e.g. docs/zoo.md.") from None
    if begin not in text or end not in text:
        raise UsageError(f"{path} has no {begin} ... {end} block to write the zoo table into. Fix: add "
                         "the two markers where the table belongs.")
    if body is not None:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        Path(path).write_text(f"{head}{begin}\n{body}\n{end}{tail}")
