"""Print the planted-bug table: every mutant x every zoo model -> caught (hint).

    python -m tests.mutants.table              # markdown
    python -m tests.mutants.table --plain

Cells: ``caught`` (with the hint's first two words when the check gave one) where the
mutant declares the model; ``MISSED`` where it declares the model but the check
passed or named the wrong tensors; ``-`` where it does not declare the model and
the bug has no effect there (the check passes, rightly); ``caught*`` where the
check fails on a model the mutant does not declare.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import pipecheck as pc

# private: the report's table format, for the mutants table
from pipecheck._check.report import format_plain_table

from .runners import ALL, MUTANTS, BaseRunner, check


def cell(runner: BaseRunner, model: str) -> str:
    declared = model in runner.applies_to
    try:
        check(runner, model)
    except pc.EquivalenceError as err:
        if not declared:
            return "caught*"
        failing = {row.name for row in err.report.failures}
        expected = runner.expect(model)
        if not set(expected) <= failing:
            return f"MISSED (named {sorted(failing)[:2]})"
        hint = err.report.hints.get(expected[0], "")
        if runner.expected_hint(model) and runner.expected_hint(model) not in hint:
            return "caught, hint MISSED"
        short = " ".join(hint.split(":")[0].split()[:2])  # "tied parameter", "gradient scaling"
        return f"caught: {short}" if short else "caught"
    if runner.name == "base":
        return "pass"
    return "MISSED" if declared else "-"


def _declared(models: tuple[str, ...]) -> str:
    if set(models) == set(ALL):
        return "all"
    if len(models) > len(ALL) // 2:
        return "all but " + ", ".join(m for m in ALL if m not in models)
    return ", ".join(models)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants.table")
    parser.add_argument("--plain", action="store_true", help="plain text instead of markdown")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = []
    for runner in [BaseRunner(), *MUTANTS.values()]:
        rows.append([runner.name, *(cell(runner, model) for model in ALL)])
    markdown = not options.plain
    print(format_plain_table(["bug \\ model", *ALL], rows, markdown=markdown))
    print(f"\n{len(rows) - 1} mutants x {len(ALL)} zoo models in {time.perf_counter() - started:.1f}s\n")
    details = []
    for runner in MUTANTS.values():
        model = runner.applies_to[0]
        details.append([runner.name, runner.bug, _declared(runner.applies_to),
                        f"{model}: {', '.join(runner.expect(model))}"])
    print(format_plain_table(["bug", "what it does", "declared for", "tensors it must name (e.g.)"], details,
                             markdown=markdown))


if __name__ == "__main__":
    main()
