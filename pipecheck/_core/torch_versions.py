"""The torch releases pipecheck is proven on, as data (no torch import: the noxfile reads it too).

    TESTED_TORCH            # ("2.10", ..., "2.15"): one nox session each, ``nox -s "matrix(torch='2.10')"``
    tested_note("2.16.0")   # "pipecheck is tested on torch 2.10 to 2.15; this is torch 2.16.0"

The floor is ``torch>=`` in pyproject.toml; docs/torch-versions.md is the
matrix measured on each of them, written from one committed record each
(docs/torch-matrix/<minor>.json, which ``nox -s matrix`` rewrites).
"""

from __future__ import annotations

TESTED_TORCH = ("2.10", "2.11", "2.12", "2.13", "2.14", "2.15")


def minor(version: str) -> str:
    """``"2.14"`` of ``"2.14.1+cpu"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def at_least(version: str, floor: str) -> bool:
    """Whether torch ``version`` (``"2.10.0+cu128"``) is ``floor`` (``"2.11"``) or newer, by minor release."""
    def number(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in minor(text).split("."))

    return number(version) >= number(floor)


def is_tested(version: str) -> bool:
    return minor(version) in TESTED_TORCH


def tested_note(version: str) -> str:
    """One sentence: the tested range, and where ``version`` stands in it."""
    where = "one of them" if is_tested(version) else "not one of them"
    return (f"pipecheck is tested on torch {TESTED_TORCH[0]} to {TESTED_TORCH[-1]} "
            f"(docs/torch-versions.md in its repository); this is torch {version}, {where}")
