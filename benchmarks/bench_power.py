"""Planted bugs on ill-conditioned models: is each caught, refused for lack of power, or passed?

    python benchmarks/bench_power.py [--write]

Models (all in this process, runner "reference" and broken runners built on it): BatchNorm over two
nearly equal values per channel (micro-batches of two, samples 1e-5 apart), a deep tanh network
without normalisation in its chaotic regime, the zoo's tiny_gpt and skip_one in bfloat16, and the
zoo's mlp in float32 as a well-conditioned control, and two zoo models whose gradients cancel
(encoder_decoder; running_stats, biases before a BatchNorm). Each runs correct (the reference, and a
correct runner that sums the micro-batches' gradients in another order), and with four planted bugs:
every gradient x0.75 (a micro-batch of four lost), stage 0's gradients x0.75, stage 0's gradients
x2 (summed twice), and stage 0's gradients x0.9. Each check runs under tolerance "auto" in the
model's dtype and again with ``dtype=torch.float64``.

A cell says what the check did: ``pass`` (the runner matched and every row could see 10%),
``caught`` (EquivalenceError), ``refused`` (PowerError: it matched, but some rows could hide an
error of 10%; before rows knew their power, that was a pass). A bug must never read ``pass``, a
correct runner never ``caught``.
With --write the table replaces this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import _odd_models  # noqa: E402

try:
    from _results import machine, write_section
except ImportError:  # run as a module from the repo root
    from benchmarks._results import machine, write_section
from pipecheck.fixtures import get  # noqa: E402

import pipecheck as pc  # noqa: E402
from pipecheck import DetachExecutor, split_microbatches  # noqa: E402

# private: the reference runner's function, wrapped to plant bugs
from pipecheck._runners.base import run_reference  # noqa: E402


class ChaoticTanh(nn.Module):
    """16 tanh layers with weights of gain 3 (the chaotic regime): no normalisation, float32 error grows."""

    def __init__(self, width: int = 16, depth: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=3.0 / width ** 0.5)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _stage0(job: pc.Job) -> set[str]:
    pipe = job.structure()
    return set(pipe.stages[0].local_to_fqn.values())


def planted(name: str, factor: float, stage0_only: bool) -> Callable[[pc.Job], pc.StepResult]:
    def run(job: pc.Job) -> pc.StepResult:
        result = run_reference(job)
        names = _stage0(job) if stage0_only else set(result.grads)
        grads = {fqn: grad * factor if fqn in names else grad for fqn, grad in result.grads.items()}
        return dataclasses.replace(result, grads=grads, stage_grads=[], replica_grads={})

    run.__name__ = name
    return run


def reordered(job: pc.Job) -> pc.StepResult:
    """A correct engine that accumulates differently: each micro-batch's step on its own, the gradients
    summed last micro-batch first (eager and the reference sum them in autograd's order)."""
    whole = run_reference(job)
    n = job.n_microbatches
    inputs = split_microbatches((job.args, job.kwargs), n)
    targets = split_microbatches(job.target, n, "target") if job.target is not None else [None] * n
    executor = DetachExecutor(job.split())  # one split: each micro-batch sees the buffers the last one left
    steps = [executor.step(args, kwargs, loss_fn=job.loss_fn, target=target)
             for (args, kwargs), target in zip(inputs, targets)]
    grads = {fqn: sum((step.grads[fqn] / n for step in reversed(steps)), torch.zeros_like(grad))
             for fqn, grad in whole.grads.items()}
    return dataclasses.replace(whole, grads=grads, stage_grads=[], replica_grads={})


RUNNERS: dict[str, Any] = {
    "correct": "reference",
    "correct, summed in another order": reordered,
    "all grads x0.75": planted("all_x075", 0.75, False),
    "stage 0 x0.75": planted("stage0_x075", 0.75, True),
    "stage 0 x2": planted("stage0_x2", 2.0, True),
    "stage 0 x0.9": planted("stage0_x09", 0.9, True),
}


def _zoo(name: str, dtype: torch.dtype | None) -> Callable[..., pc.Report]:
    entry = get(name)
    style = entry.cut_styles[0]
    args, kwargs = entry.inputs()
    return lambda **options: pc.assert_equivalent(entry.factory(style), args, kwargs, loss_fn=entry.loss_fn,
                                                  target=entry.target(), n_microbatches=4,
                                                  **entry.cut(style), **{"dtype": dtype, **options})


MODELS: dict[str, Callable[..., pc.Report]] = {
    "mlp, float32 (control)": _zoo("mlp", None),
    "BatchNorm over 2 nearly equal values, float32": lambda **options: pc.assert_equivalent(
        _odd_models.NearlyEqualBatchNorm, (_odd_models.nearly_equal_samples(),), n_microbatches=4,
        split_spec={"layers.2": pc.SplitPoint.BEGINNING}, **options),
    "tanh x16, chaotic, no normalisation, float32": lambda **options: pc.assert_equivalent(
        ChaoticTanh, (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),), n_microbatches=4,
        split_spec={"layers.8": pc.SplitPoint.BEGINNING}, **options),
    "encoder_decoder, float32 (sums that cancel)": _zoo("encoder_decoder", None),
    "running_stats, float32 (biases before BatchNorm)": _zoo("running_stats", None),
    "tiny_gpt, bfloat16": _zoo("tiny_gpt", torch.bfloat16),
    "skip_one, bfloat16": _zoo("skip_one", torch.bfloat16),
}


def outcome(check: Callable[..., pc.Report], runner: Any, **options: Any) -> str:
    try:
        check(runner=runner, **options)
    except pc.PowerError as err:
        return f"refused ({len(err.report.blind)} blind)"
    except pc.EquivalenceError as err:
        return f"caught ({len(err.report.failures)} rows)"
    return "pass"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = []
    bad = false_alarms = 0
    for model, check in MODELS.items():
        for mode, options in (("auto", {}), ("float64", {"dtype": torch.float64})):
            cells = []
            for label, runner in RUNNERS.items():
                got = outcome(check, runner, **options)
                bad += not label.startswith("correct") and got == "pass"
                false_alarms += label.startswith("correct") and got.startswith("caught")
                cells.append(got)
            lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    table = "\n".join([
        "Command: `python benchmarks/bench_power.py`  ",
        f"Machine: {machine()}. Runner 'reference' and broken runners built on it, in one process; "
        "'float64' reruns the check with dtype=torch.float64 (eager, runner and truth in float64).", "",
        "| model | check | " + " | ".join(RUNNERS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in RUNNERS) + " |", *lines, "",
        f"Planted bugs that passed: {bad}. Correct runners caught (false alarms): {false_alarms}. "
        "'refused' is a PowerError: the runner matched eager, but some rows "
        "could hide an error of 10%; before rows knew their power, each of those read 'matches eager'.", ""])
    print(table)
    if args.write:
        write_section("Power: planted bugs on ill-conditioned models", table)


if __name__ == "__main__":
    main()
