"""bfloat16 and float16 checks: does "auto" certify correct runners and catch planted bugs?

    python benchmarks/bench_bf16.py [--dtype bfloat16] [--seeds 3] [--microbatches 4 8] [--models ...]
                                    [--distributed] [--write]

Over the zoo (the HF models too, where transformers is installed), several weight seeds and micro-batch
counts, each check runs under tolerance "auto" two ways: as pipecheck runs it ("eager": anchored on
eager in the check's dtype while the runner's forward is bit for bit eager's) and with the eager
anchor switched off ("float64": anchored on the float64 truth, as every check was before). The
correct runners are the reference, an engine that sums each micro-batch's gradient last first after
dividing, one that accumulates in float32 and reports float32 gradients (Megatron's main_grad), and
with --distributed pipecheck's runtime on 4 ranks; the planted bugs are those of
tests/mutants/low_precision.py. A correct runner must pass (a PowerError is a refusal, an
EquivalenceError a false alarm); a bug must be caught.

Power is read off the passing correct runs: per row, the smallest error it sees on every element (as
a fraction of the row's largest value) and as a norm; the table gives the median row's and the worst.
With --write the tables replace this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from mutants.low_precision import BUGS, CORRECT  # noqa: E402

try:
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, write_section
from pipecheck.fixtures import entries  # noqa: E402

import pipecheck as pc  # noqa: E402

# private: the check's choice of anchor, switched off to compare with the rule before the eager anchor
import pipecheck._check.equivalence as equivalence  # noqa: E402


@contextlib.contextmanager
def anchor(rule: str) -> Iterator[None]:
    """``rule`` "float64": the eager anchor switched off, as before it existed."""
    if rule == "eager":
        yield
        return
    kept = equivalence.low_precision
    equivalence.low_precision = lambda eager, precision: False
    try:
        yield
    finally:
        equivalence.low_precision = kept


def outcome(entry: Any, runner: Any, dtype: torch.dtype, seed: int, n: int, device: str
            ) -> tuple[str, pc.Report | None]:
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    try:
        report = pc.assert_equivalent(entry.factory(style), args, kwargs, runner=runner, dtype=dtype, seed=seed,
                                      n_microbatches=n, loss_fn=entry.loss_fn, target=entry.target(),
                                      timeout=300, device=device, **entry.cut(style))
    except pc.PowerError:
        return "refused", None
    except pc.EquivalenceError:
        return "caught", None
    except pc.PipecheckError as err:
        return f"error: {type(err).__name__}", None
    return "pass", report


HEADINGS = {"eager": "auto, anchored on eager", "float64": "auto, anchored on float64 (before)"}


def applies(bug: str, entry: Any, n: int) -> bool:
    if bug == "tied share missing":
        return "tied" in entry.tags
    if bug in ("micro-batch 1 dropped", "outputs of mb 0, 1 swapped"):
        return n >= 2
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--models", nargs="*", default=[], help="zoo names or tags (default: the whole zoo)")
    parser.add_argument("--distributed", action="store_true", help="also runner='distributed' (4 ranks)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rules", nargs="+", default=["eager", "float64"], choices=("eager", "float64"),
                        help="float64: also each check with the eager anchor switched off, as before")
    parser.add_argument("--write", action="store_true", help="write the tables into benchmarks/RESULTS.md")
    options = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, options.dtype)
    runners: dict[str, Any] = dict(CORRECT)
    if options.distributed:
        runners["distributed"] = "distributed"
    counts: dict[tuple[str, str], Counter[str]] = {}
    on_eager: Counter[str] = Counter()  # passing correct runs anchored on eager: the runner's forward was eager's bits
    powers: dict[str, list[float]] = {"element": [], "norm": [], "float64 row": []}
    started = time.perf_counter()
    zoo = entries(options.models)
    for entry in zoo:
        for n in options.microbatches:
            if entry.name == "running_stats" and n > 8:
                continue
            for seed in range(options.seeds):
                for rule in options.rules:
                    with anchor(rule):
                        for label, runner in runners.items():
                            got, report = outcome(entry, runner, dtype, seed, n, options.device)
                            counts.setdefault((rule, label), Counter())[got] += 1
                            if got != "pass":
                                print(f"{rule:8s} {label:20s} {entry.name} seed {seed} n {n}: {got}", flush=True)
                            if report is not None:
                                rows = [r for r in report.rows if r.power is not None and not r.numerically_zero]
                                if rule == "eager":
                                    on_eager[label] += report.tolerance.startswith("auto, anchored on eager")
                                    powers["element"] += [r.power for r in rows]
                                    powers["norm"] += [r.norm_bound for r in rows if r.norm_bound is not None]
                                else:
                                    powers["float64 row"] += [r.power for r in rows]
                        for label, bug in BUGS.items():
                            if applies(label, entry, n):
                                got, _ = outcome(entry, bug, dtype, seed, n, options.device)
                                counts.setdefault((rule, label), Counter())[got] += 1
                                if got != "caught":
                                    print(f"{rule:8s} {label:20s} {entry.name} seed {seed} n {n}: {got}", flush=True)
    elapsed = time.perf_counter() - started

    def cell(rule: str, label: str) -> str:
        c = counts.get((rule, label), Counter())
        total = sum(c.values())
        wanted = "pass" if label in runners else "caught"
        other = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k != wanted)
        anchored = f"; {on_eager[label]} of the passes anchored on eager" if rule == "eager" and label in runners else ""
        return f"{c[wanted]}/{total} {wanted}" + (f" ({other})" if other else "") + anchored

    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        return f"median {100 * statistics.median(values):.2g}%, worst {100 * max(values):.2g}%"

    labels = [*runners, *BUGS]
    lines = [f"Command: `python benchmarks/bench_bf16.py --dtype {options.dtype} --seeds {options.seeds} "
             f"--microbatches {' '.join(map(str, options.microbatches))}"
             + (" --distributed" if options.distributed else "")
             + (f" --device {options.device}" if options.device != "cpu" else "")
             + (f" --rules {' '.join(options.rules)}" if options.rules != ["eager", "float64"] else "")
             + (f" --models {' '.join(options.models)}" if options.models else "") + "`  ",
             f"Machine: {machine()}{device_name(options.device)}; {len(zoo)} zoo models ({', '.join(e.name for e in zoo)}); {elapsed:.0f} s.", "",
             "| runner | " + " | ".join(HEADINGS[rule] for rule in options.rules) + " |",
             "| --- | " + " | ".join("---" for _ in options.rules) + " |",
             *[f"| {label} | " + " | ".join(cell(rule, label) for rule in options.rules) + " |" for label in labels], "",
             f"Power of the passing correct runs, per row (numerically zero rows aside): anchored on eager, on every "
             f"element {spread(powers['element'])}, as a norm {spread(powers['norm'])}; anchored on float64, on "
             f"every row {spread(powers['float64 row'])}.", ""]
    table = "\n".join(lines)
    print(table)
    if options.write:
        write_section(f"Low precision: {options.dtype} checks, correct runners and planted bugs"
                      + (" (with the distributed runner)" if options.distributed else "")
                      + (f" ({options.device})" if options.device != "cpu" else ""), table)


def device_name(device: str) -> str:
    return f"; device: {torch.cuda.get_device_name()}" if device == "cuda" else ""


if __name__ == "__main__":
    main()
