"""Shared by the benchmarks: machine description and section-wise rewrite of RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {datetime.date.today().isoformat()}")


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_section(heading: str, body: str) -> None:
    """Replace the ``## heading`` section of RESULTS.md with ``body``, keeping every other section."""
    title = f"## {heading}"
    section = f"{title}\n\n{body.strip()}\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# pipecheck benchmarks\n"
    found = re.search(rf"(?m)^{re.escape(title)}$", text)  # the whole heading line: "## A" is not "## A (b)"
    start = found.start() if found else -1
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(title))
        rest = "" if end == -1 else text[end + 1:]
        text = text[:start] + section + ("\n" + rest if rest else "")
    RESULTS.write_text(text)
