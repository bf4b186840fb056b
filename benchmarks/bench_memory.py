"""A check's peak memory against its eager micro-batched step's.

    python benchmarks/bench_memory.py [--device cpu|cuda] [--rounds 3] [--write]

Each measurement runs in a fresh Python process: it builds the model (benchmarks/_gpt.py, the check
benchmark's model: d=256, 8 blocks, 4 stages on CPU; d=1024 on a GPU) and its inputs (batch 16, 8
micro-batches), reads the process's peak memory, runs one thing, and reads the peak again; the
difference is what that thing added. The things: the eager micro-batched step (every micro-batch's
forward, then the mean loss's backward: what any check must do once per dtype) and
``assert_equivalent(model, runner="reference")`` on the same model and inputs, alternating, ``--rounds``
of each. Peak memory is the peak RSS on CPU (``resource.getrusage``), the peak allocated CUDA memory
on a GPU. Target (issue "Real models at the speed of the zoo"): the check adds at most 3x what the
eager step adds. With --write the result replaces this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MICROBATCHES, BATCH = 8, 16


def _peak(device: str) -> int:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(what: str, device: str) -> None:
    """One measurement, in this (fresh) process; prints the bytes ``what`` added to the peak."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from _gpt import GPT, GPTConfig, gpt_inputs, lm_loss
    from bench_check import eager_microbatched_step

    import pipecheck as pc

    torch.manual_seed(0)
    gpu = device == "cuda"
    config = GPTConfig(d=1024 if gpu else 256, vocab=8192 if gpu else 2048, seq=256 if gpu else 64)
    model = GPT(config).to(device)
    ids, target = gpt_inputs(config, BATCH, device)
    gc.collect()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    base = _peak(device)
    if what == "eager":
        eager_microbatched_step(model, ids, target)
    else:
        pc.assert_equivalent(model, (ids,), runner="reference", loss_fn=lm_loss, target=target,
                             n_microbatches=MICROBATCHES, device=device)
    print(json.dumps({"added": _peak(device) - base}))


def measure(what: str, device: str) -> int:
    out = subprocess.run([sys.executable, str(HERE), "--child", what, "--device", device], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return int(json.loads(out.strip().splitlines()[-1])["added"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the result into benchmarks/RESULTS.md")
    parser.add_argument("--child", choices=("eager", "check"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.device)
        return
    added: dict[str, list[int]] = {"eager": [], "check": []}
    for _ in range(opts.rounds):
        for what in added:  # alternating, each in a fresh process
            added[what].append(measure(what, opts.device))
            print(what, f"{added[what][-1] / 2**20:.0f} MiB", flush=True)
    eager, check = (statistics.median(values) for values in added.values())
    sys.path.insert(0, str(HERE.parent))
    from _results import machine, write_section

    what = "peak RSS" if opts.device == "cpu" else "peak allocated CUDA memory"
    table = "\n".join([
        f"Command: `python benchmarks/bench_memory.py --device {opts.device} --rounds {opts.rounds}`  ",
        f"Machine: {machine()}. Model: benchmarks/_gpt.py (d={1024 if opts.device == 'cuda' else 256}, 8 blocks, "
        f"4 stages), batch {BATCH}, {MICROBATCHES} micro-batches; each number from a fresh process, eager and "
        f"check alternating; {what} added by one step or one check.", "",
        "| | added peak, median (MiB) | each run (MiB) |", "| --- | --- | --- |",
        *(f"| {label} | {statistics.median(values) / 2**20:.0f} | "
          f"{', '.join(f'{v / 2**20:.0f}' for v in values)} |"
          for label, values in (("eager micro-batched step", added["eager"]),
                                ("assert_equivalent(runner='reference')", added["check"]))), "",
        f"Ratio check / eager: {check / max(eager, 1):.2f} (target <= 3).", ""])
    print(table)
    if opts.write:
        write_section(f"Check memory ({opts.device})", table)


if __name__ == "__main__":
    main()
