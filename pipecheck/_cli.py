"""The command line: ``pipecheck zoo`` and ``pipecheck check`` (also ``python -m pipecheck``).

    pipecheck zoo                                                    # every zoo model x every runner
    pipecheck check my_models:make_model --inputs my_models:make_inputs --stages 2

Exit statuses follow pytest's (:data:`EXIT_STATUSES`). Every error is one message on
stderr, ``pipecheck: <kind>: <what>. Fix: <how>``; ``--traceback`` (or
``PIPECHECK_DEBUG=1``) adds Python's traceback above it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from pipecheck import _optional_runners
from pipecheck._errors import (
    EngineError,
    EquivalenceError,
    InputError,
    PipecheckError,
    ScheduleError,
    TaskPickleError,
    UsageError,
    WorldError,
    plural,
)

EXIT_STATUSES = {
    0: "every check matches eager",
    1: "a mismatch: a runner does not compute what the eager model computes",
    2: "usage or input error: a bad option, path, module or value, or an input pipecheck refuses",
    3: "engine or runtime error: the engine under test or pipecheck's worker processes failed to run",
    4: "internal error: a bug in pipecheck",
}
ZOO_STATUS = ("zoo exits 0 when every cell of pipecheck's own runners passes, 1 when one of them is FAIL,\n"
              "3 when one is ERROR; the columns of the engines under test (torch, deepspeed, torchtitan) show\n"
              "their known failures and never change it.")
# pipecheck._runners.BUILTIN, and each optional engine's runner that is installed (found without importing it)
RUNNERS = ("reference", "distributed", "torch", *_optional_runners.available())
NOT_COUNTED = ("torch", *_optional_runners.OPTIONAL)  # zoo columns (other engines) that never change its exit status
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "float64": "float64"}
DEBUG_ENV = "PIPECHECK_DEBUG"


def classify(error: BaseException) -> tuple[int, str]:
    """``(exit status, kind)`` of an error: what a script and a person read first."""
    if isinstance(error, EquivalenceError):
        return 1, "mismatch"
    if isinstance(error, UsageError):
        return 2, "usage error"
    if isinstance(error, TaskPickleError):
        return 2, "input error"
    if isinstance(error, EngineError):
        return 3, "engine error"
    if isinstance(error, WorldError):
        return 3, "runtime error"
    if isinstance(error, PipecheckError):
        return 2, "input error"
    return 4, "internal error"


def error_message(error: BaseException) -> str:
    """``pipecheck: <kind>: <what>. Fix: <how>``: one message for every error."""
    status, kind = classify(error)
    if status == 4:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        return (f"pipecheck: internal error: {type(error).__name__}{': ' + first if first else ''}. This is a "
                "bug in pipecheck, not in your model. Fix: rerun the command with --traceback and report "
                "it, with that output, on pipecheck's issue tracker.")
    return f"pipecheck: {kind}: {str(error).strip()}"


# --- loading the user's code ---------------------------------------------------------------------


def _load(spec: str, what: str) -> Callable[..., Any]:
    """The callable named by ``pkg.module:function``, imported the way ``python -m`` would."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UsageError(f"{what} {spec!r} is not a module:function path. Fix: write it as "
                         "package.module:function, e.g. my_models:make_model.")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the `pipecheck` script imports from here, as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise UsageError(f"importing {module_name!r} for {what} failed: {err}. Fix: install what "
                             f"{module_name!r} imports.") from err
        top = module_name.split(".")[0]
        raise UsageError(f"cannot import {module_name!r} for {what}: {err}. Fix: run pipecheck in the "
                         f"directory that holds {top}.py (or the {top} package), or install it.") from None
    except Exception as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        raise UsageError(f"importing {module_name!r} for {what} raised {type(err).__name__}: {first}. Fix: "
                         f"make `python -c \"import {module_name}\"` work.") from err
    value = getattr(module, attr, None)
    if value is None:
        close = difflib.get_close_matches(attr, [n for n in vars(module) if not n.startswith("_")], n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise UsageError(f"module {module_name!r} has no attribute {attr!r} for {what}{hint}. Fix: name a "
                         f"function defined in {module_name!r}.")
    if not callable(value):
        raise UsageError(f"{what} {spec!r} is a {type(value).__name__}, not a function. Fix: name a function.")
    return value  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class UserFactory:
    """The user's model factory; what it raises is an InputError naming it (it travels to ranks)."""

    fn: Callable[[], Any]
    spec: str

    def __call__(self) -> Any:
        try:
            return self.fn()
        except PipecheckError:
            raise
        except Exception as err:
            first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
            raise InputError(f"the model factory {self.spec} raised {type(err).__name__}: {first}. Fix: make "
                             f"{self.spec.split(':')[-1]}() build the model with no arguments.") from err


def _inputs(args: argparse.Namespace) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args.input_shape:
        try:
            shape = [int(d) for d in args.input_shape.split(",")]
        except ValueError:
            shape = []
        if not shape or min(shape) < 1:
            raise UsageError(f"--input-shape {args.input_shape!r} is not a shape. Fix: give positive sizes "
                             "separated by commas, e.g. --input-shape 8,16.")
        import torch

        return (torch.randn(*shape, generator=torch.Generator().manual_seed(args.seed)),), {}
    make = _load(args.inputs, "--inputs")
    try:
        made = make()
    except PipecheckError:
        raise
    except Exception as err:
        raise InputError(f"--inputs {args.inputs} raised {type(err).__name__}: {err}. Fix: make it "
                         "return the model's inputs with no arguments.") from err
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict):
        return tuple(made[0]) if isinstance(made[0], (tuple, list)) else (made[0],), dict(made[1])
    return (made if isinstance(made, tuple) else (made,)), {}


def _runner(spec: str) -> tuple[str, Any]:
    """``(column name, runner)``: a built-in runner's name, or a user's Runner as pkg.module:function."""
    if ":" in spec:
        return spec.split(":")[-1], _load(spec, "--runner")
    if spec in _optional_runners.OPTIONAL and spec not in RUNNERS:  # a known engine, not installed here
        _optional_runners.OPTIONAL[spec].load()  # raises the InputError that names the pip command
    if spec not in RUNNERS:
        close = difflib.get_close_matches(spec, RUNNERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"runner {spec!r} is not one of {', '.join(RUNNERS)}.{hint} Fix: name a built-in "
                         "runner, or your own Runner as package.module:function.")
    return spec, spec


def _device(name: str) -> str:
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda needs CUDA, but torch.cuda.is_available() is False (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}). Fix: use --device cpu, "
                             "or run on a machine with a GPU and a CUDA build of torch.")
    return name


def _schedule_name(name: str) -> str:
    """A schedule pipecheck's runtime or runner='torch' knows (names only: torch is not imported)."""
    from pipecheck._torch_schedules import ALIASES
    from pipecheck.schedules import SCHEDULE_NAMES

    key = name.strip().lower().replace("-", "_")
    if key not in ALIASES and key not in SCHEDULE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(SCHEDULE_NAMES)}; "
                                         "runner torch also interleaved_zb, dualpipev and torch's class names)")
    return name


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name])


def refusing_single_stage(name: str, runner: Any) -> Callable[[Any], Any]:
    """``runner``, but a split of fewer than 2 stages is refused before it runs."""
    from pipecheck._check import resolve_runner

    _, run = resolve_runner(runner)

    def check_stages(job: Any) -> Any:
        stages = job.structure().num_stages
        if stages < 2:
            raise UsageError(
                f"the model was cut into {plural(stages, 'stage')}, so the check would compare nothing a "
                "pipeline does differently from eager. Fix: cut it with pipe_split() markers in forward, "
                "--stages N (N >= 2) or --split-spec FQN=BEGINNING; or pass --allow-single-stage to check "
                "one stage anyway."
            )
        return run(job)

    check_stages.__name__ = check_stages.__qualname__ = name
    return check_stages


# --- the commands --------------------------------------------------------------------------------


def _cell(run: Callable[[], Any]) -> tuple[str, str]:
    """``(text, outcome)`` of one zoo cell; outcome is "pass", "fail" or "error"."""
    report: Any
    try:
        report = run()
    except EquivalenceError as err:
        report = err.report
        row = report.failures[0]
        hint = report.hints.get(row.name)
        return f"FAIL {row.name}" + (f" ({hint.split(':')[0]})" if hint else ""), "fail"
    except ScheduleError as err:  # a layout the schedule cannot run, refused before any rank starts
        return f"n/a: {_refusal(err)}", "pass"
    except PipecheckError as err:
        first = str(err).strip().splitlines()[0]
        return f"ERROR {type(err).__name__}: {first[:70]}", "error"
    worst = max((r.max_abs for r in report.rows if r.numel), default=0.0)
    return f"pass (max abs {worst:.1e})", "pass"


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
    schedules = args.schedules.split(",") if args.schedules else [args.schedule]
    if args.columns:
        pairs = [(column.partition(":")[0], column.partition(":")[2] or args.schedule)
                 for column in args.columns.split(",")]
        schedules = list(dict.fromkeys(schedule for _, schedule in pairs))
    else:
        pairs = [(spec, schedule) for spec in (args.runners.split(",") if args.runners else RUNNERS)
                 for schedule in schedules]
    columns = [(*_runner(spec), schedule) for spec, schedule in pairs]  # (column, runner, schedule)
    if args.write_markdown:  # a file without the markers fails now, not after the zoo
        write_marked_block(args.write_markdown, None, args.block)
    device = _device(args.device)

    import pipecheck as pc
    from pipecheck._report import format_plain_table
    from pipecheck.fixtures import entries

    try:
        zoo = entries(args.models.split(",") if args.models else ())
    except KeyError as err:
        raise UsageError(f"--models: {err.args[0]}. Fix: choose from those names and tags.") from None
    rows, outcomes = [], set()
    started = time.perf_counter()
    for entry in zoo:
        style = entry.cut_styles[0]
        call_args, call_kwargs = entry.inputs()
        cells = [entry.name, str(entry.num_stages), style]
        for column, runner, schedule in columns:
            run = functools.partial(
                pc.assert_equivalent, entry.factory(style), call_args, call_kwargs, runner=runner,
                loss_fn=entry.loss_fn, target=entry.target(), n_microbatches=args.n_microbatches,
                schedule=schedule, stages_per_rank=stages_per_rank_for(column, schedule, args.stages_per_rank),
                dtype=_dtype(args.dtype), device=device, timeout=args.timeout, **entry.cut(style))
            text, outcome = _cell(run)
            if column not in NOT_COUNTED:
                outcomes.add(outcome)
            cells.append(text)
        rows.append(cells)
        if args.verbose:
            print(" | ".join(cells), file=sys.stderr)
    names = [column if len(schedules) == 1 else schedule if len(set(c for c, _, _ in columns)) == 1
             else f"{column} {schedule}" for column, _, schedule in columns]
    headers = ["model", "stages", "cut", *names]
    what = f"schedule {schedules[0]}" if len(schedules) == 1 else f"schedules {', '.join(schedules)}"
    across = (f"{len(columns)} columns" if args.columns or len(schedules) > 1
              else plural(len(columns), "runner"))
    summary = (f"{plural(len(rows), 'model')} x {across}, {args.dtype}, {plural(args.n_microbatches, 'micro-batch')}, "
               f"{what}, in {time.perf_counter() - started:.1f}s")
    print(format_plain_table(headers, rows, markdown=args.markdown))
    print(f"\n{summary}")
    if args.write_markdown:
        table = format_plain_table(headers, rows, markdown=True)
        command = " ".join(["python -m pipecheck", *args.argv])
        write_marked_block(args.write_markdown, f"{table}\n\n_{summary}; generated by `{command}`._", args.block)
    return 1 if "fail" in outcomes else 3 if "error" in outcomes else 0


BEGIN, END = "<!-- pipecheck-zoo:begin -->", "<!-- pipecheck-zoo:end -->"


def markers(block: str | None) -> tuple[str, str]:
    """The begin/end markers of the zoo table ``block`` (None: the main one)."""
    name = f"pipecheck-zoo-{block}" if block else "pipecheck-zoo"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_marked_block(path: str, body: str | None, block: str | None = None) -> None:
    """Replace the text between the zoo markers of ``block`` in ``path`` (a README) with ``body``
    (None: only check that they are there)."""
    from pathlib import Path

    begin, end = markers(block)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"cannot read --write-markdown {path}: {err.strerror}. Fix: give an existing "
                         "markdown file, e.g. README.md.") from None
    if begin not in text or end not in text:
        raise UsageError(f"{path} has no {begin} ... {end} block to write the zoo table into. Fix: add "
                         "the two markers where the table belongs.")
    if body is not None:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        Path(path).write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def cmd_check(args: argparse.Namespace) -> int:
    import pipecheck as pc

    device = _device(args.device)
    name, runner = _runner(args.runner)
    factory = UserFactory(_load(args.model, "the model factory"), args.model)
    call_args, call_kwargs = _inputs(args)
    cut: dict[str, Any] = {}
    if args.split_spec:
        cut["split_spec"] = dict(args.split_spec)
    elif args.stages:
        cut["policy"] = pc.policies.balanced_params(args.stages)
    if not args.allow_single_stage:
        runner = refusing_single_stage(name, runner)
    report = pc.assert_equivalent(factory, call_args, call_kwargs, runner=runner,
                                  n_microbatches=args.n_microbatches, schedule=args.schedule,
                                  dtype=_dtype(args.dtype), device=device, tracer=args.tracer,
                                  timeout=args.timeout, stages_per_rank=args.stages_per_rank, seed=args.seed,
                                  **cut)
    print(report)
    return 0


# --- the parser ----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are pipecheck's usage errors (one message style, exit status 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}. Fix: see `{self.prog} --help`.")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one; the epilog (exit statuses) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _split_point(text: str) -> tuple[str, str]:
    fqn, equals, point = text.partition("=")
    if not equals or not fqn or point.upper() not in ("BEGINNING", "END"):
        raise argparse.ArgumentTypeError(f"{text!r} is not FQN=BEGINNING or FQN=END (e.g. layers.2=BEGINNING)")
    return fqn, point.upper()


def _epilog() -> str:
    lines = ["exit status:"] + [f"  {status}  {meaning}" for status, meaning in EXIT_STATUSES.items()]
    return "\n".join(lines) + f"\n{ZOO_STATUS}\nOn an error, --traceback or {DEBUG_ENV}=1 also prints the traceback."


def build_parser() -> argparse.ArgumentParser:
    from pipecheck import __version__

    parser = _Parser(prog="pipecheck", formatter_class=_HelpFormatter, epilog=_epilog(),
                     description="Check that a pipelined model computes what the eager model does.")
    parser.add_argument("--version", action="version", version=f"pipecheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{zoo,check}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n-microbatches", type=_at_least(1), default=4, metavar="N",
                       help="micro-batches per step (the batch is split on dim 0)")
        p.add_argument("--schedule", default="1f1b", type=_schedule_name, metavar="NAME",
                       help="gpipe, 1f1b, interleaved, zb or zbv; runner torch also interleaved_zb, dualpipev")
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                       help="dtype of the model and its floating inputs")
        p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where the model runs; cuda needs a GPU (one per rank for NCCL)")
        p.add_argument("--timeout", type=_seconds, default=120.0, metavar="SECONDS",
                       help="seconds per distributed step before its ranks are reported as hung")
        p.add_argument("--traceback", action="store_true",
                       help=f"on an error, print Python's traceback too (or set {DEBUG_ENV}=1)")

    zoo = sub.add_parser("zoo", formatter_class=_HelpFormatter, epilog=_epilog(),
                         help="run every zoo model through every runner and print a table",
                         description="Run every zoo model through every runner and print a table.")
    zoo.add_argument("--runners", metavar="NAME,...", help=f"comma-separated runners, each a name or "
                     f"package.module:function (default: {','.join(RUNNERS)})")
    zoo.add_argument("--models", metavar="NAME,...", help="comma-separated zoo model names or tags, e.g. hf "
                     "(default: all; the HuggingFace models when transformers is installed)")
    zoo.add_argument("--markdown", action="store_true", help="print a markdown table")
    zoo.add_argument("--write-markdown", metavar="FILE",
                     help=f"also write the table (markdown) between {BEGIN} and {END} in FILE, e.g. README.md")
    zoo.add_argument("--schedules", metavar="NAME,...", help="comma-separated: one column per runner and "
                     "schedule (V schedules zbv and dualpipev run 2 stages per rank); default: --schedule")
    zoo.add_argument("--columns", metavar="RUNNER:SCHEDULE,...",
                     help="the table's columns, e.g. distributed:zb,torch:zbv (instead of --runners x --schedules)")
    zoo.add_argument("--stages-per-rank", type=_at_least(1), default=1, metavar="N",
                     help="for schedules that take any number")
    zoo.add_argument("--block", metavar="NAME", help="with --write-markdown: write between "
                     "<!-- pipecheck-zoo-NAME:begin/end --> instead of the main zoo markers")
    zoo.add_argument("-v", "--verbose", action="store_true", help="print each row to stderr as it is done")
    common(zoo)
    zoo.set_defaults(func=cmd_zoo)

    check = sub.add_parser("check", formatter_class=_HelpFormatter, epilog=_epilog(),
                           help="check one model: package.module:factory",
                           description="Check one model against its eager run.")
    check.add_argument("model", help="zero-argument factory returning the nn.Module, as package.module:function")
    given = check.add_mutually_exclusive_group(required=True)
    given.add_argument("--inputs", metavar="MODULE:FUNCTION",
                       help="function returning (args, kwargs), a tuple of args, or one tensor")
    given.add_argument("--input-shape", metavar="B,D,...", help="one random float input of this shape, e.g. 8,16")
    cut = check.add_mutually_exclusive_group()
    cut.add_argument("--stages", type=_at_least(2, " (a pipeline has at least 2 stages)"), metavar="N",
                     help="cut into N stages with policies.balanced_params (default: the pipe_split() markers)")
    cut.add_argument("--split-spec", nargs="+", type=_split_point, metavar="FQN=BEGINNING|END",
                     help="cut at these modules, e.g. layers.2=BEGINNING head=BEGINNING")
    check.add_argument("--allow-single-stage", action="store_true",
                       help="check a model cut into fewer than 2 stages instead of refusing it")
    check.add_argument("--runner", default="distributed", metavar="NAME|MODULE:FUNCTION",
                       help=f"{', '.join(RUNNERS)}, or your own Runner as package.module:function")
    check.add_argument("--tracer", default="auto", choices=("auto", "fx", "export"),
                       help="how the model is traced to cut it (auto: fx, or export where fx cannot trace)")
    check.add_argument("--stages-per-rank", type=_at_least(1), default=1, metavar="N",
                       help="stages each rank holds (several: interleaved or looped schedules)")
    check.add_argument("--seed", type=int, default=0, help="seed of the model's weights and random inputs")
    common(check)
    check.set_defaults(func=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit status (never raises, except SystemExit from --help)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--traceback" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return int(args.func(args))
    except EquivalenceError as err:
        print(err)  # the verdict: the failure table, on stdout like a passing report
        return 1
    except KeyboardInterrupt:
        print("pipecheck: interrupted.", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            traceback.print_exc()
        print(error_message(err), file=sys.stderr)
        return classify(err)[0]
