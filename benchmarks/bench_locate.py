"""What locating a failure costs: a failing check with its first divergence and fitted hints, against
the same failing check at a commit before them, and a passing check (nothing recorded) against it too.

    python benchmarks/bench_locate.py --baseline /path/to/an/older/checkout [--repeats 7]

Each case runs in its own process per code base, alternating (new, old, new, old, ...), each process
timing ``--checks`` checks after one warm-up check; the table gives the medians and their ratio.
Cases: planted bugs in an in-process runner (tests/mutants) on the zoo's mlp and skip_one, and
pipecheck's runtime, DeepSpeed and torchtitan on World(2) with a model that is wrong on rank 1 only
(the engines need pipecheck's extras; the baseline before them located neither). With --write the table
replaces this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CASE = r"""
import sys, time
sys.path[:0] = [{code!r}, {tests!r}]
import torch
import pipecheck as pc
from pipecheck.fixtures import get
torch.set_num_threads(1)
case = {case!r}

def once():
    if case in ("distributed", "deepspeed"):
        import _odd_models
        return pc.assert_equivalent(_odd_models.WrongOnRank1, (torch.randn(8, 4),),
                                    split_spec={{"b": pc.SplitPoint.BEGINNING}}, n_microbatches=2,
                                    runner=case, tracer="fx")
    if case == "torchtitan":
        import _odd_models
        return pc.assert_equivalent(_odd_models.TitanWrongOnRank1, (torch.randn(8, 4),),
                                    split_spec={{"layers.1": pc.SplitPoint.BEGINNING}}, n_microbatches=2,
                                    runner="torchtitan")
    from mutants.runners import MUTANTS, BaseRunner, check
    name, model = case.split(":")
    return check(MUTANTS[name] if name != "base" else BaseRunner(), model)

def timed():
    start = time.perf_counter()
    try:
        once()
    except pc.EquivalenceError:
        pass
    return time.perf_counter() - start

timed()
times = sorted(timed() for _ in range({checks}))
print(times[len(times) // 2])
"""

CASES = {
    "mutant grad_overwritten on mlp (4 stages, 4 mbs)": "grad_overwritten:mlp",
    "mutant skip_wrong_microbatch on skip_one": "skip_wrong_microbatch:skip_one",
    "runtime World(2), wrong on rank 1": "distributed",
    "DeepSpeed World(2), wrong on rank 1": "deepspeed",
    "torchtitan World(2), wrong on rank 1": "torchtitan",
    "passing check (base runner on mlp)": "base:mlp",
}


def run_case(code: Path, case: str, checks: int) -> float:
    script = CASE.format(code=str(code), tests=str(ROOT / "tests"), case=case, checks=checks)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ""}, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, type=Path, help="a checkout of pipecheck before the change")
    parser.add_argument("--repeats", type=int, default=5, help="processes per case and code base")
    parser.add_argument("--checks", type=int, default=5, help="timed checks per process")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for label, case in CASES.items():
        new, old = [], []
        for _ in range(args.repeats):
            new.append(run_case(ROOT, case, args.checks))
            old.append(run_case(args.baseline, case, args.checks))
        n, o = statistics.median(new), statistics.median(old)
        rows.append(f"| {label} | {o * 1e3:.1f} | {n * 1e3:.1f} | {n / o:.2f} |")
        print(rows[-1], flush=True)
    try:  # after the cases: this driver imports torch only to describe the machine
        from _results import machine, write_section
    except ImportError:  # run as a module from the repo root
        from benchmarks._results import machine, write_section

    table = "\n".join([
        f"`python benchmarks/bench_locate.py --baseline <checkout of the commit before> --repeats {args.repeats} "
        f"--checks {args.checks}`; {machine()}. Medians of {args.repeats} processes per code base, run "
        f"alternating, each the median of {args.checks} checks after a warm-up; one intra-op thread.", "",
        "| case | before (ms) | with locating (ms) | ratio |", "| --- | --- | --- | --- |", *rows, ""])
    print(table)
    if args.write:
        write_section("Locating a failure (first divergence and fitted hints)", table)

if __name__ == "__main__":
    main()
