"""How long a failure report is: a gradient-scaling bug in a model with 52 parameter tensors.

    python benchmarks/report_lines.py [--show]

The runner is the reference runner with every gradient multiplied by n_microbatches (each
micro-batch's loss not divided by n_microbatches), so every gradient row fails with the same hint.
Prints the number of lines of the EquivalenceError's text (what a test failure shows) and of
``report.table()`` (every row); --show prints the error's text too.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import pipecheck as pc

# private: the reference runner's function, wrapped to plant a bug
from pipecheck._runners.base import run_reference

LAYERS = 25  # 25 Linear layers and a head: 52 parameter tensors, 54 rows with the output and the loss


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(LAYERS))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def loss_not_divided(job: pc.Job) -> pc.StepResult:
    """The bug: gradients summed over micro-batches instead of averaged."""
    result = run_reference(job)
    result.grads = {fqn: grad * job.n_microbatches for fqn, grad in result.grads.items()}
    return result


def failure() -> pc.EquivalenceError:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    try:
        pc.assert_equivalent(Deep, (x,), runner=loss_not_divided, n_microbatches=4,
                             policy=pc.policies.balanced_params(4))
    except pc.EquivalenceError as err:
        return err
    raise SystemExit("the scaled gradients passed: the check is broken")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", action="store_true", help="print the error's text")
    options = parser.parse_args()
    err = failure()
    text = str(err)
    if options.show:
        print(text, end="\n\n")
    report = err.report
    table = report.table() if hasattr(report, "table") else ""
    print(f"{len(report.failures)} of {len(report.rows)} rows fail; EquivalenceError text: "
          f"{len(text.splitlines())} lines; report.table(): {len(table.splitlines())} lines")


if __name__ == "__main__":
    main()
