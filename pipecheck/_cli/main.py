"""The command line: ``pipecheck zoo`` and ``pipecheck check`` (also ``python -m pipecheck``).

    pipecheck zoo                                                    # every zoo model x every runner
    pipecheck check my_models:make_model --inputs my_models:make_inputs --stages 2
    pipecheck check my_models:make_model --inputs my_models:make_inputs -v          # every row

Exit statuses follow pytest's (:data:`EXIT_STATUSES`). Every error is one message on
stderr, ``pipecheck: <kind>: <what>. Fix: <how>``; ``--traceback`` (or
``PIPECHECK_DEBUG=1``) adds Python's traceback above it.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from pipecheck._check.report import MAX_LINES, Report
from pipecheck._cli.options import (
    DTYPES,
    RUNNERS,
    UserFactory,
    at_least,
    call_inputs,
    device_option,
    dtype_option,
    load_object,
    loss_options,
    runner_option,
    runners_help,
    schedule_option,
    seconds,
    split_point,
)
from pipecheck._cli.zoo import ZOO_STATUS, cmd_zoo, markers
from pipecheck.errors import (
    AdapterError,
    EngineError,
    EquivalenceError,
    PipecheckError,
    PowerError,
    RankError,
    TaskPickleError,
    UsageError,
    WorldError,
    first_line,
    plural,
)

EXIT_STATUSES = {
    0: "every check matches eager",
    1: "a mismatch: a runner does not compute what the eager model computes",
    2: "usage or input error: a bad option, path, module or value, or an input pipecheck refuses (a check "
       "that cannot see a gross error included)",
    3: "engine or runtime error: the engine under test or pipecheck's worker processes failed to run",
    4: "internal error: a bug in pipecheck, or its adapter to torch or an engine broken by their release",
}
DEBUG_ENV = "PIPECHECK_DEBUG"
SEE_ALL = "rerun with -v to see every row"  # the last line of a report cut to MAX_LINES


def classify(error: BaseException) -> tuple[int, str]:
    """``(exit status, kind)`` of an error: what a script and a person read first."""
    if isinstance(error, EquivalenceError):
        return 1, "mismatch"
    if isinstance(error, UsageError):
        return 2, "usage error"
    if isinstance(error, PowerError):
        return 2, "no certificate"
    if isinstance(error, TaskPickleError):
        return 2, "input error"
    if isinstance(error, AdapterError):
        return 4, "pipecheck adapter error"
    if isinstance(error, EngineError):
        return 3, "engine error"
    if isinstance(error, WorldError):
        return 3, "runtime error"
    if isinstance(error, PipecheckError):
        return 2, "input error"
    return 4, "internal error"


def error_message(error: BaseException) -> str:
    """``pipecheck: <kind>: <what>. Fix: <how>``: one message for every error; a rank's failure in
    one line (its traceback is what ``--traceback`` prints)."""
    status, kind = classify(error)
    if status == 4 and not isinstance(error, AdapterError):
        first = first_line(error)
        return (f"pipecheck: internal error: {type(error).__name__}{': ' + first if first else ''}. This is a "
                "bug in pipecheck, not in your model. Fix: rerun the command with --traceback and report "
                "it, with that output, on pipecheck's issue tracker.")
    text = str(error).strip()
    if status in (3, 4):
        text = _without_rank_traceback(error, text)
    return f"pipecheck: {kind}: {text}"


def _without_rank_traceback(error: BaseException, text: str) -> str:
    """An engine's or a rank's failure as one line: what failed, on which rank and stage, with which
    settings; the failing rank's traceback after it (``Traceback on rank N:``) is left to
    ``--traceback``, whose Python traceback ends in the whole message. A message with no rank's
    traceback (a hang's stacks, a World that could not start) is kept whole."""
    rank_error = getattr(error, "cause", None) or getattr(error, "error", None)
    rank = rank_error.rank if isinstance(rank_error, RankError) else None
    lines = [line.strip() for line in text.splitlines()]
    marker = f"Traceback on rank {rank}:"
    if rank is None or marker not in lines:
        if len(lines) > 1 or "Fix:" in text:
            return text
        return f"{_sentence(text)} Fix: rerun with --traceback to see where it failed."
    head = " ".join(_sentence(line) for line in lines[:lines.index(marker)] if line)
    see = f"rerun with --traceback to see rank {rank}'s traceback"
    return f"{head} ({see}.)" if "Fix:" in head else f"{head} Fix: {see}, where it failed."


def _sentence(line: str) -> str:
    return line if line.endswith((".", "!", "?")) else f"{line}."


class RefusingSingleStage:
    """``runner``, but a split of fewer than 2 stages is refused as soon as the model is split, before
    any eager work (``check_split``: the Runner protocol's early refusal)."""

    def __init__(self, name: str, runner: Any) -> None:
        from pipecheck._check.equivalence import resolve_runner

        self.__name__ = name
        _, self.run = resolve_runner(runner)

    def check_split(self, pipe: Any) -> None:
        stages = pipe.num_stages
        if stages < 2:
            raise UsageError(
                f"the model was cut into {plural(stages, 'stage')}, so the check would compare nothing a "
                "pipeline does differently from eager. Fix: cut it with pipe_split() markers in forward, "
                "--stages N (N >= 2) or --split-spec FQN=BEGINNING; or pass --allow-single-stage to check "
                "one stage anyway."
            )
        getattr(self.run, "check_split", lambda pipe: None)(pipe)

    def __call__(self, job: Any) -> Any:
        return self.run(job)

    def __getattr__(self, name: str) -> Any:  # the runner's own split (reference_boundaries), ...
        if name == "run":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.run, name)


def cmd_check(args: argparse.Namespace) -> int:
    import pipecheck as pc

    device = device_option(args.device)
    name, runner = runner_option(args.runner)
    factory = UserFactory(load_object(args.model, "the model factory"), args.model)
    call_args, call_kwargs = call_inputs(args)
    cut: dict[str, Any] = {}
    if args.split_spec:
        cut["split_spec"] = dict(args.split_spec)
    elif args.stages:
        cut["policy"] = pc.policies.balanced_params(args.stages)
    if not args.allow_single_stage:
        runner = RefusingSingleStage(name, runner)
    loss = loss_options(args)
    max_lines = None if args.verbose else MAX_LINES
    try:
        report = pc.assert_equivalent(factory, call_args, call_kwargs, runner=runner,
                                      n_microbatches=args.n_microbatches, schedule=args.schedule,
                                      dtype=dtype_option(args.dtype), device=device, tracer=args.tracer,
                                      timeout=args.timeout, stages_per_rank=args.stages_per_rank, seed=args.seed,
                                      **loss, **cut)
    except EquivalenceError as err:  # the verdict, on stdout like a passing report; -v: every row
        failed = err.report
        if not isinstance(failed, Report):  # raised by something other than the check: main prints it
            raise
        print(failed.text(None) if args.verbose else failed.failure_text(max_lines, SEE_ALL))
        return 1
    print(report.text(max_lines, SEE_ALL))
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
        p.add_argument("--n-microbatches", type=at_least(1), default=4, metavar="N",
                       help="micro-batches per step (the batch is split on dim 0)")
        p.add_argument("--schedule", default="1f1b", type=schedule_option, metavar="NAME",
                       help="gpipe, 1f1b, interleaved, zb or zbv; runner torch also interleaved_zb, dualpipev")
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                       help="dtype of the model and its floating inputs")
        p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where the model runs; cuda needs a GPU (one per rank for NCCL)")
        p.add_argument("--timeout", type=seconds, default=120.0, metavar="SECONDS",
                       help="seconds per distributed step before its ranks are reported as hung")
        p.add_argument("--traceback", action="store_true",
                       help=f"on an error, print Python's traceback too (or set {DEBUG_ENV}=1)")

    zoo = sub.add_parser("zoo", formatter_class=_HelpFormatter, epilog=_epilog(),
                         help="run every zoo model through every runner and print a table",
                         description="Run every zoo model through every runner and print a table.")
    zoo.add_argument("--runners", metavar="NAME,...", help=f"comma-separated runners, each your own as "
                     f"package.module:function or a built-in one: {runners_help()} (default: {','.join(RUNNERS)})")
    zoo.add_argument("--models", metavar="NAME,...", help="comma-separated zoo model names or tags, e.g. hf "
                     "(default: all; the HuggingFace models when transformers is installed)")
    zoo.add_argument("--markdown", action="store_true", help="print a markdown table")
    zoo.add_argument("--write-markdown", metavar="FILE",
                     help="also write the table (markdown) between {} and {} in FILE, e.g. docs/zoo.md".format(
                         *markers(None)))
    zoo.add_argument("--schedules", metavar="NAME,...", help="comma-separated: one column per runner and "
                     "schedule (V schedules zbv and dualpipev run 2 stages per rank); default: --schedule")
    zoo.add_argument("--columns", metavar="RUNNER:SCHEDULE,...",
                     help="the table's columns, e.g. distributed:zb,torch:zbv (instead of --runners x --schedules)")
    zoo.add_argument("--stages-per-rank", type=at_least(1), default=1, metavar="N",
                     help="for schedules that take any number")
    zoo.add_argument("--block", metavar="NAME", help="with --write-markdown: write between "
                     "<!-- pipecheck-zoo-NAME:begin/end --> instead of the main zoo markers")
    zoo.add_argument("--json", metavar="FILE", help="also write every cell as JSON to FILE (model, column, "
                     "schedule, text, outcome: pass, fail, error or adapter) with the torch version and exit status")
    zoo.add_argument("--training", action="store_true",
                     help="add a column that trains on pipecheck's runtime: 3 optimizer steps of AdamW with "
                          "clipping, 2 accumulation steps each, 2 data-parallel replicas (twice the ranks)")
    zoo.add_argument("-v", "--verbose", action="store_true", help="print each row to stderr as it is done")
    common(zoo)
    zoo.set_defaults(func=cmd_zoo)

    check = sub.add_parser("check", formatter_class=_HelpFormatter, epilog=_epilog(),
                           help="check one model: package.module:factory",
                           description="Check one model against its eager run.")
    check.add_argument("model", help="zero-argument factory returning the nn.Module, as package.module:function "
                       "or path/to/file.py:function")
    given = check.add_mutually_exclusive_group(required=True)
    given.add_argument("--inputs", metavar="MODULE:FUNCTION",
                       help="function returning (args, kwargs), a tuple of args, or one tensor")
    given.add_argument("--input-shape", metavar="B,D,...", help="one random float input of this shape, e.g. 8,16")
    cut = check.add_mutually_exclusive_group()
    cut.add_argument("--stages", type=at_least(2, " (a pipeline has at least 2 stages)"), metavar="N",
                     help="cut into N stages with policies.balanced_params (default: the pipe_split() markers)")
    cut.add_argument("--split-spec", nargs="+", type=split_point, metavar="FQN=BEGINNING|END",
                     help="cut at these modules, e.g. layers.2=BEGINNING head=BEGINNING")
    check.add_argument("--allow-single-stage", action="store_true",
                       help="check a model cut into fewer than 2 stages instead of refusing it")
    check.add_argument("--runner", default="distributed", metavar="NAME|MODULE:FUNCTION",
                       help=f"a built-in runner: {runners_help()}; or your own Runner as package.module:function")
    check.add_argument("--tracer", default="auto", choices=("auto", "fx", "export"),
                       help="how the model is traced to cut it (auto: fx, or export where fx cannot trace)")
    check.add_argument("--stages-per-rank", type=at_least(1), default=1, metavar="N",
                       help="stages each rank holds (several: interleaved or looped schedules)")
    check.add_argument("--seed", type=int, default=0, help="seed of the model's weights and random inputs")
    check.add_argument("--loss", metavar="MODULE:FUNCTION", help="loss_fn(outputs, target) -> scalar tensor, as "
                       "package.module:function (default: a seeded random projection of every output)")
    check.add_argument("--target", metavar="MODULE:FUNCTION", help="zero-argument function returning the loss's "
                       "target, split on dim 0 like the inputs (needs --loss)")
    check.add_argument("-v", "--verbose", action="store_true",
                       help=f"print every compared tensor's row (default: at most {MAX_LINES} lines, the failing "
                       "rows that tell most)")
    common(check)
    check.set_defaults(func=cmd_check)
    return parser


def _shadowing_folder() -> str | None:
    """A folder named ``pipecheck`` without ``__init__.py`` on ``sys.path`` (the working directory first) that
    Python took for an empty namespace package named pipecheck, hiding the installed one."""
    import pipecheck

    if getattr(pipecheck, "__file__", None) is not None:
        return None
    return next(iter(getattr(pipecheck, "__path__", [])), "?")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit status (never raises, except SystemExit from --help)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--traceback" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    shadow = _shadowing_folder()
    if shadow is not None:
        print(f"pipecheck: usage error: Python imported the folder {shadow} as the package 'pipecheck' (it has no "
              "__init__.py: a checkout's root, run from the folder above it), not the installed pipecheck. Fix: "
              "run from another folder (inside the checkout, say), or rename that folder.", file=sys.stderr)
        return 2
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
