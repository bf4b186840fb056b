"""The torch version matrix: measure one torch into its committed record, then write docs/torch-versions.md
whole from every committed record.

    nox -s matrix                                     # every tested torch, one venv each (~8-10 min each)
    nox -s "matrix(torch='2.10')"                     # one of them: its record, then the whole page
    python docs/torch_matrix.py run --out docs/torch-matrix/2.10.json    # inside a venv with that torch
    python docs/torch_matrix.py run --only zoo --out docs/torch-matrix/2.10.json   # the zoo again, the suite kept
    python docs/torch_matrix.py write                 # the page, from docs/torch-matrix/*.json
    python docs/torch_matrix.py check                 # exit 1 if the page is not what the records give

Each supported torch has one record, ``docs/torch-matrix/<minor>.json``, committed: a run of one version
rewrites that version's record and the page keeps every other version's. ``run`` records, for the torch
installed: the default test suite (``pytest -n auto``, counts and the failing test ids) and ``pipecheck
zoo`` through pipecheck's runners and every torch.distributed.pipelining schedule (``--json``), each with
the date it was measured; pytest's and the zoo's own output stay in ``.nox/torch-matrix/``. ``write``
imports neither torch nor pipecheck, checks every record first, and writes nothing unless all are whole.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pipecheck._core.torch_versions import is_tested, minor  # noqa: E402  (torch-free)

DATA = ROOT / "docs" / "torch-matrix"  # one committed record per torch minor
WORK = ROOT / ".nox" / "torch-matrix"  # pytest's junit file and the zoo's JSON, not committed
PAGE = ROOT / "docs" / "torch-versions.md"
# The zoo's columns: pipecheck's two runners, then torch's engine on each of its schedules.
ZOO_COLUMNS = "reference,distributed,torch:1f1b,torch:zb,torch:interleaved_zb,torch:zbv,torch:dualpipev"
BEGIN, END = "<!-- torch-matrix:begin -->", "<!-- torch-matrix:end -->"
# The tests that this page lists every supported torch and is what the records give: they pass only once the
# whole matrix is written (a run of one torch rewrites its record before the page).
PAGE_TESTS = ("tests/core/test_torch_versions.py::test_every_tested_torch_has_its_column_on_the_measured_page",
              "tests/test_torch_matrix.py::test_the_page_is_what_the_committed_records_give")
PARTS = ("suite", "zoo")


class RecordError(Exception):
    """A record that cannot be part of the page: the page is left as it is."""


# --- measuring --------------------------------------------------------------------------------------


def run(out: Path, parts: tuple[str, ...] = PARTS) -> None:
    import torch  # the torch of this venv: the one measured

    record: dict = {"torch": torch.__version__, "python": platform.python_version()}
    if set(parts) != set(PARTS):  # one part measured again: the other one kept from the record
        kept = _read(out)
        if (kept["torch"], kept["python"]) != (record["torch"], record["python"]):
            raise RecordError(f"{out} was measured on torch {kept['torch']}, Python {kept['python']}; this is torch "
                              f"{record['torch']}, Python {record['python']}: measure both parts (no --only)")
        record.update({part: kept[part] for part in PARTS if part not in parts})
    WORK.mkdir(parents=True, exist_ok=True)
    stem = WORK / minor(torch.__version__)
    if "suite" in parts:
        record["suite"] = _suite(stem.with_suffix(".junit.xml"))
    if "zoo" in parts:
        record["zoo"] = _zoo(stem.with_suffix(".zoo.json"))
    _check_record(record, out.name)
    _write_atomically(out, _dump(record))
    print(f"torch {record['torch']}: {_suite_cell(record)}; zoo exit {record['zoo']['status']}; wrote {out}")


def _transformers() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return None
    from importlib.metadata import version

    return version("transformers")


def _suite(junit: Path) -> dict:
    junit.unlink(missing_ok=True)  # a crashed run must not leave an older run's numbers
    started = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={junit}", *(f"--deselect={test}" for test in PAGE_TESTS)], cwd=ROOT,
                           check=False)
    return {"date": time.strftime("%Y-%m-%d"), **_junit_counts(junit), "status": tests.returncode,
            "seconds": round(time.perf_counter() - started)}


def _zoo(zoo_json: Path) -> dict:
    zoo_json.unlink(missing_ok=True)
    started = time.perf_counter()
    zoo = subprocess.run([sys.executable, "-m", "pipecheck", "zoo", "--columns", ZOO_COLUMNS,
                          "--stages-per-rank", "2", "--json", str(zoo_json)], cwd=ROOT, check=False)
    cells = json.loads(zoo_json.read_text())["cells"] if zoo_json.exists() else []  # none: the zoo crashed
    return {"date": time.strftime("%Y-%m-%d"), "transformers": _transformers(), "status": zoo.returncode,
            "seconds": round(time.perf_counter() - started), "cells": cells}


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


def _dump(record: dict) -> str:
    """The record as JSON, one zoo cell a line (a re-measured cell is a one-line diff)."""
    cells = record["zoo"]["cells"]
    text = json.dumps({**record, "zoo": {**record["zoo"], "cells": "@CELLS@"}}, indent=1)
    rows = ",\n".join("  " + json.dumps(cell) for cell in cells)
    return text.replace('"@CELLS@"', f"[\n{rows}\n ]" if cells else "[]") + "\n"


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


# --- the page ---------------------------------------------------------------------------------------


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecordError(f"{path} cannot be read as a record: {err}") from None
    _check_record(record, path.name)
    return record


def _check_record(record: dict, name: str) -> None:
    missing = [key for key in ("torch", "python", "suite", "zoo") if key not in record]
    missing += [f"suite.{key}" for key in ("date", "passed", "failed", "skipped", "failures", "seconds")
                if key not in record.get("suite", {})]
    missing += [f"zoo.{key}" for key in ("date", "status", "cells") if key not in record.get("zoo", {})]
    if missing:
        raise RecordError(f"{name} lacks {', '.join(missing)}; measure it again with `nox -s matrix`")
    if name != f"{minor(record['torch'])}.json":
        raise RecordError(f"{name} holds torch {record['torch']}'s record; it belongs in {minor(record['torch'])}.json")


def load(data: Path) -> list[dict]:
    """Every supported torch's record, oldest first (a version no longer supported is left out)."""
    records = [_read(path) for path in sorted(data.glob("*.json"))]
    records = sorted((r for r in records if is_tested(r["torch"])),
                     key=lambda r: tuple(int(n) for n in minor(r["torch"]).split(".")))
    if not records:
        raise RecordError(f"no records in {data}; run `nox -s matrix` first")
    return records


def render(records: list[dict], page: str) -> str:
    """``page`` with its measured block made from ``records``, whole; the rest of the page as it is."""
    if BEGIN not in page or END not in page:
        raise RecordError(f"the page has no {BEGIN} ... {END} block to write into; add the two markers")
    body = "\n\n".join([_suite_table(records), _conformance_table(records), _failures(records)])
    head, rest = page.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{body.strip()}\n{END}{rest.split(END, 1)[1]}"


def write(data: Path, page: Path) -> None:
    text = render(load(data), page.read_text() if page.exists() else f"{BEGIN}\n{END}\n")
    _write_atomically(page, text)
    print(f"wrote {page} from {len(load(data))} torch versions")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _pipecheck_cells(record: dict) -> str:
    own = [c for c in record["zoo"]["cells"] if not c["column"].startswith("torch")]
    passed = sum(c["outcome"] == "pass" for c in own)
    return f"{passed}/{len(own)}"


def _suite_cell(record: dict) -> str:
    suite = record["suite"]
    return f"{suite['passed']} passed, {suite['failed']} failed, {suite['skipped']} skipped"


def _measured(record: dict) -> str:
    suite, zoo = record["suite"]["date"], record["zoo"]["date"]
    return suite if suite == zoo else f"suite {suite}, zoo {zoo}"


def _suite_table(records: list[dict]) -> str:
    rows = [[r["torch"], r["python"], r["zoo"].get("transformers") or "not recorded", _measured(r), _suite_cell(r),
             f"{r['suite']['seconds']} s", _pipecheck_cells(r), str(r["zoo"]["status"])] for r in records]
    return ("### The test suite and the zoo, per torch\n\n"
            "`pytest -n auto` (the default suite; the engine extras are not installed, so their tests skip) and "
            "`pipecheck zoo` (its reference and distributed cells must all pass; exit 0 means they did and no "
            "pipecheck adapter broke), each on the date it was measured; the suite grows between measurements. "
            "Written from `docs/torch-matrix/<torch>.json`.\n\n"
            + _table(["torch", "python", "transformers (zoo)", "measured", "test suite", "suite time",
                      "zoo: pipecheck's runners pass", "zoo exit"], rows))


# What a torch cell says, in a few words (the records keep torch's whole message). A skip connection
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
            "buffers; `hf_llama`, `hf_mixtral`: a rotary embedding computed under no_grad up to transformers "
            "5.23 (the transformers column above says which one each zoo ran with). FAIL is a wrong "
            "answer torch gives silently; ERROR is torch failing to run; the records keep each cell's whole "
            "first line (`message`) where the zoo wrote one.\n\n"
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
    measure = sub.add_parser("run", help="measure the installed torch into its record")
    measure.add_argument("--out", type=Path, required=True, help="the record to write, docs/torch-matrix/<minor>.json")
    measure.add_argument("--only", choices=PARTS, help="measure this part again and keep the record's other part")
    for name, what in (("write", "write"), ("check", "check")):
        page = sub.add_parser(name, help=f"{what} {PAGE.relative_to(ROOT)} from every record")
        page.add_argument("--data", type=Path, default=DATA)
        page.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args()
    try:
        if args.command == "run":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            run(args.out, (args.only,) if args.only else PARTS)
        elif args.command == "write":
            write(args.data, args.page)
        elif render(load(args.data), args.page.read_text()) != args.page.read_text():
            sys.exit(f"{args.page} is not what {args.data} gives: run `python docs/torch_matrix.py write`")
    except RecordError as err:
        sys.exit(f"torch_matrix: {err}")


if __name__ == "__main__":
    main()
