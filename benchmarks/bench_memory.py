"""A check's peak memory against its eager micro-batched step's own peak (parameters, gradients, activations).

    python benchmarks/bench_memory.py [--device cpu|cuda] [--rounds 3] [--write]

Each measurement runs in a fresh Python process. It warms torch up (one tiny step), takes the memory in
use as its base, then runs one thing and reads the peak above that base:
- "eager": the model built by its factory (benchmarks/_gpt.py; on the device) and its eager micro-batched
  step (every micro-batch's forward, then the mean loss's backward into ``.grad``): parameters +
  gradients + activations, what training the model needs;
- "check": ``assert_equivalent(factory, runner="reference")`` on the same inputs, the factory built
  inside it;
- "second": the same check twice in one process, the peak of the second (the first's leftovers count).
Eager, check and second alternate, ``--rounds`` of each. On the CPU the peak is the process's peak
resident memory (``VmHWM``, reset through /proc/self/clear_refs), with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the process and the peak is what is alive; on a
GPU, the peak allocated CUDA memory. Target (issue 34): the check's peak <= 1.5x the eager step's. With
--write the result replaces this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MICROBATCHES, BATCH = 8, 16
TARGET = 1.5
MMAP_THRESHOLD = str(128 * 1024)


def _status(key: str) -> int:
    found = re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(found.group(1)) * 1024 if found else 0


def _reset(device: str) -> int:
    """The base: memory in use now, with the peak reset to it."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS
    return _status("VmRSS")


def _peak(device: str) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status("VmHWM")


def config_for(device: str):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(HERE.parent))
    from _gpt import GPTConfig

    if device == "cuda":
        return GPTConfig(d=1024, vocab=8192, seq=256)
    return GPTConfig(d=512, vocab=8192, seq=64)


def child(what: str, device: str) -> None:
    """One measurement, in this (fresh) process; prints the bytes above the base at the peak."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from _gpt import GPT, gpt_inputs, lm_loss

    import pipecheck as pc

    config = config_for(device)
    factory = functools.partial(GPT, config)
    ids, target = gpt_inputs(config, BATCH, device)
    tiny = torch.nn.Linear(8, 8).to(device)  # torch's one-time set-up is not the step's
    tiny(torch.ones(2, 8, device=device)).sum().backward()
    del tiny

    def check() -> None:
        pc.assert_equivalent(factory, (ids,), runner="reference", loss_fn=lm_loss, target=target,
                             n_microbatches=MICROBATCHES, device=device)

    if what == "second":
        check()
    base = _reset(device)
    if what == "eager":
        model = pc.ModelFactory(factory, device=device)()
        losses = [lm_loss(model(x), t) for x, t in zip(ids.chunk(MICROBATCHES), target.chunk(MICROBATCHES))]
        torch.stack(losses).mean().backward()
    else:
        check()
    print(json.dumps({"peak": _peak(device) - base}))


def measure(what: str, device: str) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    out = subprocess.run([sys.executable, str(HERE), "--child", what, "--device", device], check=True,
                         capture_output=True, text=True, timeout=1200, env=env).stdout
    return int(json.loads(out.strip().splitlines()[-1])["peak"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the result into benchmarks/RESULTS.md")
    parser.add_argument("--child", choices=("eager", "check", "second"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.device)
        return
    peaks: dict[str, list[int]] = {"eager": [], "check": [], "second": []}
    for _ in range(opts.rounds):
        for what in peaks:  # alternating, each in a fresh process
            peaks[what].append(measure(what, opts.device))
            print(what, f"{peaks[what][-1] / 2**20:.0f} MiB", flush=True)
    eager, check, second = (statistics.median(values) for values in peaks.values())
    sys.path.insert(0, str(HERE.parent))
    import torch
    from _gpt import GPT
    from _results import machine, write_section

    config = config_for(opts.device)
    params = sum(p.numel() for p in GPT(config).parameters()) * 4
    what = "peak resident memory" if opts.device == "cpu" else "peak allocated CUDA memory"
    device = torch.cuda.get_device_name() if opts.device == "cuda" else "CPU"
    ratio = check / max(eager, 1)
    table = "\n".join([
        f"Command: `python benchmarks/bench_memory.py --device {opts.device} --rounds {opts.rounds}`  ",
        f"Machine: {machine()}; device: {device}. Model: benchmarks/_gpt.py (d={config.d}, {config.blocks} blocks, "
        f"vocab {config.vocab}, seq {config.seq}, {config.stages} stages; float32 parameters {params / 2**20:.0f} "
        f"MiB), batch {BATCH}, {MICROBATCHES} micro-batches, built by its factory in each. Each number from a fresh "
        f"process (eager, check and second check alternating): the {what} above what the process held before, "
        "the model's build included.", "",
        "| | peak, median (MiB) | each run (MiB) | / eager step |", "| --- | --- | --- | --- |",
        *(f"| {label} | {statistics.median(values) / 2**20:.0f} | "
          f"{', '.join(f'{v / 2**20:.0f}' for v in values)} | {statistics.median(values) / max(eager, 1):.2f} |"
          for label, values in (("eager micro-batched step (parameters, gradients, activations)", peaks["eager"]),
                                ("assert_equivalent(runner='reference')", peaks["check"]),
                                ("the same check, a second time in the process", peaks["second"]))), "",
        f"Ratio check / eager step: {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'}); "
        f"second check / first: {second / max(check, 1):.2f}.", ""])
    print(table)
    if opts.write:
        write_section(f"Check memory ({opts.device})", table)


if __name__ == "__main__":
    main()
