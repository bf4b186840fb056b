"""The command line: ``python -m pipecheck zoo`` and ``python -m pipecheck check``.

    python -m pipecheck zoo                                  # every zoo model x every runner
    python -m pipecheck check my_pkg.models:make_model --inputs my_pkg.models:make_inputs --stages 4
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "float64": "float64"}


def available_runners() -> list[str]:
    from pipecheck._runners import BUILTIN

    return list(BUILTIN)


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name])


def _load(spec: str, what: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"error: {what} {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SystemExit(f"error: cannot import {module_name!r} for {what}: {err}. "
                         "Fix: install it, or run from the directory that contains it.") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"error: {module_name!r} has no attribute {attr!r} ({what})") from None


def _cell(run: Callable[[], Any]) -> tuple[str, bool]:
    import pipecheck as pc

    try:
        report = run()
    except pc.EquivalenceError as err:
        report = err.report
        assert isinstance(report, pc.Report)
        row = report.failures[0]
        hint = report.hints.get(row.name)
        return f"FAIL {row.name}" + (f" ({hint.split(':')[0]})" if hint else ""), False
    except pc.ScheduleError as err:  # a layout the schedule cannot run, refused before any rank starts
        return f"n/a: {_refusal(err)}", True
    except pc.PipecheckError as err:
        first = str(err).strip().splitlines()[0]
        return f"ERROR {type(err).__name__}: {first[:70]}", False
    worst = max((r.max_abs for r in report.rows if r.numel), default=0.0)
    return f"pass (max abs {worst:.1e})", True


def _refusal(err: Exception) -> str:
    """The rule a refused layout breaks, in a few words (the message's first problem)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    problem = next((line[2:] for line in lines if line.startswith("- ")), lines[0] if lines else "")
    return problem.split(";")[0][:80]


def stages_per_rank_for(runner: str, schedule: str, default: int) -> int:
    """The stages per rank ``schedule`` runs on ``runner`` (2 for the V schedules), else ``default``."""
    from pipecheck._torch_schedules import ALIASES, TORCH_SCHEDULES
    from pipecheck.schedules import stages_per_rank_of

    if runner == "torch":
        key = ALIASES.get(schedule.strip().lower().replace("-", "_"))
        required = TORCH_SCHEDULES[key].stages_per_rank if key else None
    else:
        required = stages_per_rank_of(schedule)
    return default if required is None else required


def cmd_zoo(args: argparse.Namespace) -> int:
    import pipecheck as pc
    from pipecheck._report import format_plain_table
    from pipecheck.fixtures import ZOO

    runners = args.runners.split(",") if args.runners else available_runners()
    schedules = args.schedules.split(",") if args.schedules else [args.schedule]
    columns = [(runner, schedule) for runner in runners for schedule in schedules]
    if args.columns:
        columns = [(column.partition(":")[0], column.partition(":")[2] or args.schedule)
                   for column in args.columns.split(",")]
        runners, schedules = list(dict.fromkeys(r for r, _ in columns)), list(dict.fromkeys(s for _, s in columns))
    rows = []
    failed_ours = 0
    started = time.perf_counter()
    for entry in ZOO:
        if args.models and entry.name not in args.models.split(","):
            continue
        style = entry.cut_styles[0]
        call_args, call_kwargs = entry.inputs()
        cells = [entry.name, str(entry.num_stages), style]
        for runner, schedule in columns:
            run = functools.partial(
                pc.assert_equivalent, entry.factory(style), call_args, call_kwargs, runner=runner,
                loss_fn=entry.loss_fn, target=entry.target(), n_microbatches=args.n_microbatches,
                schedule=schedule, stages_per_rank=stages_per_rank_for(runner, schedule, args.stages_per_rank),
                dtype=_dtype(args.dtype), timeout=args.timeout, **entry.cut(style))
            text, ok = _cell(run)
            failed_ours += (not ok) and runner != "torch"
            cells.append(text)
        rows.append(cells)
        if args.verbose:
            print(" | ".join(cells), file=sys.stderr)
    names = [runner if len(schedules) == 1 else schedule if len(runners) == 1 else f"{runner} {schedule}"
             for runner, schedule in columns]
    headers = ["model", "stages", "cut", *names]
    what = f"schedule {schedules[0]}" if len(schedules) == 1 else f"schedules {', '.join(schedules)}"
    across = f"{len(columns)} columns" if args.columns or len(schedules) > 1 else f"{len(runners)} runners"
    summary = (f"{len(rows)} models x {across}, {args.dtype}, {args.n_microbatches} micro-batches, "
               f"{what}, in {time.perf_counter() - started:.1f}s")
    print(format_plain_table(headers, rows, markdown=args.markdown))
    print(f"\n{summary}")
    if args.write_markdown:
        table = format_plain_table(headers, rows, markdown=True)
        command = " ".join(["python -m pipecheck", *args.argv])
        write_marked_block(args.write_markdown, f"{table}\n\n_{summary}; generated by `{command}`._", args.block)
    return 1 if failed_ours else 0


BEGIN, END = "<!-- pipecheck-zoo:begin -->", "<!-- pipecheck-zoo:end -->"


def markers(block: str | None) -> tuple[str, str]:
    """The begin/end markers of the zoo table ``block`` (None: the main one)."""
    name = f"pipecheck-zoo-{block}" if block else "pipecheck-zoo"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_marked_block(path: str, body: str, block: str | None = None) -> None:
    """Replace the text between the zoo markers of ``block`` in ``path`` (a README) with ``body``."""
    from pathlib import Path

    begin, end = markers(block)
    text = Path(path).read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"error: {path} has no {begin} ... {end} block to write the zoo table into")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    Path(path).write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    import pipecheck as pc

    factory = _load(args.model, "model")
    if args.inputs:
        made = _load(args.inputs, "inputs")()
        call_args, call_kwargs = made if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict) \
            else (made if isinstance(made, tuple) else (made,), {})
    elif args.input_shape:
        shape = [int(d) for d in args.input_shape.split(",")]
        call_args, call_kwargs = (torch.randn(*shape, generator=torch.Generator().manual_seed(args.seed)),), {}
    else:
        raise SystemExit("error: give --inputs pkg.mod:make_inputs or --input-shape B,D")
    cut: dict[str, Any] = {}
    if args.split_spec:
        cut["split_spec"] = dict(item.split("=", 1) for item in args.split_spec)
    elif args.stages:
        cut["policy"] = pc.policies.balanced_params(args.stages)
    try:
        report = pc.assert_equivalent(factory, call_args, call_kwargs, runner=args.runner,
                                      n_microbatches=args.n_microbatches, schedule=args.schedule,
                                      dtype=_dtype(args.dtype), tracer=args.tracer, timeout=args.timeout,
                                      stages_per_rank=args.stages_per_rank, seed=args.seed, **cut)
    except pc.EquivalenceError as err:
        print(err)
        return 1
    except pc.PipecheckError as err:
        print(f"pipecheck: {type(err).__name__}: {err}")
        return 2
    print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipecheck",
                                     description="Check that a pipelined model computes what the eager model does.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n-microbatches", type=int, default=4)
        p.add_argument("--schedule", default="1f1b",
                       help="gpipe | 1f1b | interleaved | zb | zbv; runner torch also: interleaved_zb | dualpipev")
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
        p.add_argument("--timeout", type=float, default=120.0, help="seconds per distributed job")

    zoo = sub.add_parser("zoo", help="run every zoo model through every runner and print a table")
    zoo.add_argument("--runners", help=f"comma-separated, default: all available ({', '.join(available_runners())})")
    zoo.add_argument("--models", help="comma-separated zoo model names (default: all)")
    zoo.add_argument("--markdown", action="store_true", help="print a markdown table")
    zoo.add_argument("--write-markdown", metavar="FILE",
                     help=f"also write the table (markdown) between {BEGIN} and {END} in FILE, e.g. README.md")
    zoo.add_argument("--schedules", help="comma-separated: one column per runner and schedule (V schedules zbv and "
                     "dualpipev run 2 stages per rank); default: --schedule")
    zoo.add_argument("--columns", metavar="RUNNER:SCHEDULE,...",
                     help="the table's columns, e.g. distributed:zb,torch:zbv (instead of --runners x --schedules)")
    zoo.add_argument("--stages-per-rank", type=int, default=1, help="for schedules that take any number (default 1)")
    zoo.add_argument("--block", help="with --write-markdown: write between <!-- pipecheck-zoo-BLOCK:begin/end --> "
                     "instead of the main zoo markers")
    zoo.add_argument("-v", "--verbose", action="store_true")
    common(zoo)
    zoo.set_defaults(func=cmd_zoo)

    check = sub.add_parser("check", help="check one model: pkg.module:factory")
    check.add_argument("model", help="zero-argument factory returning the nn.Module, as pkg.module:function")
    check.add_argument("--inputs", help="function returning (args, kwargs) or args, as pkg.module:function")
    check.add_argument("--input-shape", help="one random float input of this shape, e.g. 8,16")
    check.add_argument("--stages", type=int, help="cut into N stages with balanced_params (if no pipe_split)")
    check.add_argument("--split-spec", nargs="*", metavar="FQN=BEGINNING|END")
    check.add_argument("--runner", default="distributed", choices=available_runners())
    check.add_argument("--tracer", default="auto", choices=("auto", "fx", "export"))
    check.add_argument("--stages-per-rank", type=int, default=1)
    check.add_argument("--seed", type=int, default=0)
    common(check)
    check.set_defaults(func=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return int(args.func(args))
