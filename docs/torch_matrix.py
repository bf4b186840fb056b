"""The torch version matrix: measure one torch, then write docs/torch-versions.md from every measurement.

    nox -s matrix                                     # every tested torch, one venv each (~8-10 min each)
    nox -s "matrix(torch='2.10')"                     # one of them
    python docs/torch_matrix.py run --out .nox/torch-matrix/2.10.json   # inside a venv with that torch
    python docs/torch_matrix.py write                 # the page, from .nox/torch-matrix/*.json

``run`` records, for the torch installed: the default test suite (``pytest -n auto``, counts and the
failing test ids), and ``pipecheck zoo`` through pipecheck's runners and every torch.distributed.
pipelining schedule (``--json``). ``write`` imports neither torch nor pipecheck.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pipecheck._core.torch_versions import is_tested, minor  # noqa: E402  (torch-free)

RESULTS = ROOT / ".nox" / "torch-matrix"
PAGE = ROOT / "docs" / "torch-versions.md"
# The zoo's columns: pipecheck's two runners, then torch's engine on each of its schedules.
ZOO_COLUMNS = "reference,distributed,torch:1f1b,torch:zb,torch:interleaved_zb,torch:zbv,torch:dualpipev"
BEGIN, END = "<!-- torch-matrix:begin -->", "<!-- torch-matrix:end -->"
# The test that this page lists every supported torch: it passes only once the whole matrix is written.
PAGE_TEST = "tests/core/test_torch_versions.py::test_every_tested_torch_has_its_column_on_the_measured_page"


def run(out: Path) -> None:
    import torch  # the torch of this venv: the one measured

    record: dict[str, object] = {"torch": torch.__version__, "python": platform.python_version(),
                                 "date": time.strftime("%Y-%m-%d")}
    junit, zoo_json = out.with_suffix(".junit.xml"), out.with_suffix(".zoo.json")
    for stale in (out, junit, zoo_json):  # a crashed step must not leave an older run's numbers
        stale.unlink(missing_ok=True)
    started = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={junit}", "--deselect", PAGE_TEST], cwd=ROOT, check=False)
    record["suite"] = {**_junit_counts(junit), "status": tests.returncode,
                       "seconds": round(time.perf_counter() - started)}
    started = time.perf_counter()
    zoo = subprocess.run([sys.executable, "-m", "pipecheck", "zoo", "--columns", ZOO_COLUMNS,
                          "--stages-per-rank", "2", "--json", str(zoo_json)], cwd=ROOT, check=False)
    cells = json.loads(zoo_json.read_text())["cells"] if zoo_json.exists() else []  # none: the zoo crashed
    record["zoo"] = {"status": zoo.returncode, "seconds": round(time.perf_counter() - started), "cells": cells}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"torch {record['torch']}: {record['suite']}; zoo exit {zoo.returncode}")


def _junit_counts(path: Path) -> dict[str, object]:
    if not path.exists():
        return {"passed": 0, "failed": 1, "skipped": 0, "failures": ["(pytest wrote no report)"]}  # never "0 failed"
    cases = ET.parse(path).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        key = {"failure": "failed", "error": "failed"}.get(outcome, outcome)
        counts[key] += 1
        if key == "failed":
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failures": failures}


def write(results: Path, page: Path) -> None:
    measured = [json.loads(p.read_text()) for p in results.glob("*.json") if not p.name.endswith(".zoo.json")]
    records = sorted((r for r in measured if is_tested(r["torch"])),  # a version no longer supported: left out
                     key=lambda r: tuple(int(n) for n in minor(r["torch"]).split(".")))
    if not records:
        sys.exit(f"no measurements in {results}; run `nox -s matrix` first")
    body = "\n\n".join([_suite_table(records), _conformance_table(records), _failures(records)])
    text = page.read_text() if page.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        sys.exit(f"{page} has no {BEGIN} ... {END} block to write into; add the two markers")
    head, rest = text.split(BEGIN, 1)
    page.write_text(f"{head}{BEGIN}\n{body.strip()}\n{END}{rest.split(END, 1)[1]}")
    print(f"wrote {page} from {len(records)} torch versions")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _pipecheck_cells(record: dict) -> str:
    own = [c for c in record["zoo"]["cells"] if not c["column"].startswith("torch")]
    passed = sum(c["outcome"] == "pass" for c in own)
    return f"{passed}/{len(own)}"


def _suite_table(records: list[dict]) -> str:
    rows = [[r["torch"], r["python"], r["date"],
             f"{r['suite']['passed']} passed, {r['suite']['failed']} failed, {r['suite']['skipped']} skipped",
             f"{r['suite']['seconds']} s", _pipecheck_cells(r), str(r["zoo"]["status"])] for r in records]
    return ("### The test suite and the zoo, per torch\n\n"
            "`pytest -n auto` (the default suite; the engine extras are not installed, so their tests skip) and "
            "`pipecheck zoo` (its reference and distributed cells must all pass; exit 0 means they did and no "
            "pipecheck adapter broke).\n\n"
            + _table(["torch", "python", "measured", "test suite", "suite time", "zoo: pipecheck's runners pass",
                      "zoo exit"], rows))


# What a torch cell says, in a few words (the JSON files keep torch's whole message). A skip connection
# fails on two ranks at once with two messages, and the cell shows whichever reached the driver first:
# both are one finding.
LABELS = (
    ("tied parameter not synchronised", "FAIL: tied weight gets one stage's share"),
    ("Backward of skip connections", "ERROR: skip connection refused"),
    ("only supports adjacent-stage", "ERROR: skip connection refused"),
    ("unexpected keyword argument", "ERROR: kwarg handed to the wrong stage"),
    ("only last-stage outputs", "refused: drops earlier stages' outputs"),
    ("only Tensors of floating point dtype", "ERROR: an integer tensor made to require grad"),
    ("Expected positional argument", "ERROR: outlined no_grad region called without inputs"),
    ("unexpected placeholder node", "ERROR: outlined no_grad region called without inputs"),
    ("backward through the graph a second time", "ERROR: zero-bubble W walks a freed graph"),
)


def _short(cell: dict) -> str:
    text = cell["text"]
    for start, label in (("pass", "pass"), ("n/a", "n/a")):
        if text.startswith(start):
            return label
    label = next((label for needle, label in LABELS if needle in text), None)
    return label or text.replace("ERROR EngineError: ", "ERROR: ").replace("|", "/")[:70]


def _conformance_table(records: list[dict]) -> str:
    versions = [{(c["model"], c["schedule"]): _short(c) for c in r["zoo"]["cells"] if c["column"] == "torch"}
                for r in records]
    models = list(dict.fromkeys(c["model"] for r in records for c in r["zoo"]["cells"] if c["column"] == "torch"))
    schedules = list(dict.fromkeys(c["schedule"] for r in records for c in r["zoo"]["cells"]
                                   if c["column"] == "torch"))
    rows = []
    for model in models:
        ran = [s for s in schedules if any(v.get((model, s), "n/a") != "n/a" for v in versions)]
        same = all(len({v.get((model, s), "-") for s in ran}) == 1 for v in versions)
        groups = [ran] if same and ran else [[s] for s in ran]
        rows += [[model, ", ".join(group), *(v.get((model, group[0]), "-") for v in versions)] for group in groups]
    return ("### What torch.distributed.pipelining gets wrong, by version\n\n"
            "runner=\"torch\" on every zoo model, 4 micro-batches, on each schedule that can run its layout "
            "(one row when every schedule gives the same answer). Each model exercises one thing: `tiny_gpt`, "
            "`alias_reuse`, `titan_lm`, `hf_gpt2`, `hf_bert`: weights used by two stages; `skip_one`, "
            "`long_skip`, `encoder_decoder`: skip connections; `kwarg_last`, `kwarg_default`: kwargs for a "
            "later stage; `dict_outputs`, `hf_t5`: outputs of an earlier stage; `buffers`, `running_stats`: "
            "buffers; `hf_llama`, `hf_mixtral`: a rotary embedding computed under no_grad. FAIL is a wrong "
            "answer torch gives silently; ERROR is torch failing to run; the JSON files under "
            "`.nox/torch-matrix/` keep each cell's whole first line (`message`).\n\n"
            + _table(["model", "schedules", *(r["torch"] for r in records)], rows))


def _failures(records: list[dict]) -> str:
    lines = ["### Failing tests", ""]
    for r in records:
        failed = r["suite"]["failures"]
        lines.append(f"- torch {r['torch']}: " + (", ".join(f"`{f}`" for f in failed[:20]) if failed else "none")
                     + (f" and {len(failed) - 20} more" if len(failed) > 20 else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    measure = sub.add_parser("run", help="measure the installed torch")
    measure.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    page = sub.add_parser("write", help=f"write {PAGE.relative_to(ROOT)} from every measurement")
    page.add_argument("--results", type=Path, default=RESULTS)
    page.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args()
    if args.command == "run":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        run(args.out)
    else:
        write(args.results, args.page)


if __name__ == "__main__":
    main()
