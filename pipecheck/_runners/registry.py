"""Built-in runners whose engine is a separate install, found without importing it (nor torch).

    OPTIONAL["deepspeed"].available()        # is DeepSpeed installed? (importlib.util.find_spec)
    run = OPTIONAL["deepspeed"].load()       # its runner; InputError with the pip command if missing
    available()                              # ["deepspeed", "torchtitan"], those installed here

A command line can list these without paying for torch: nothing here imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from pipecheck.errors import InputError


@dataclass(frozen=True)
class OptionalRunner:
    """A built-in runner for an engine installed separately (``pip install "pipecheck[<extra>]"``)."""

    name: str
    package: str  # the engine's import name, looked up without importing it
    extra: str
    runner: str  # "module:function" of the runner inside pipecheck

    def available(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def load(self) -> Any:
        if not self.available():
            raise InputError(f"runner={self.name!r} needs {self.package}, which is not installed. Fix: "
                             f'pip install "pipecheck[{self.extra}]".')
        module, _, attr = self.runner.partition(":")
        return getattr(importlib.import_module(module), attr)


OPTIONAL: dict[str, OptionalRunner] = {
    runner.name: runner for runner in (
        OptionalRunner("deepspeed", "deepspeed", "deepspeed", "pipecheck._runners.deepspeed.driver:run_deepspeed"),
        OptionalRunner("torchtitan", "torchtitan", "torchtitan", "pipecheck._runners.torchtitan.driver:run_torchtitan"),
    )
}


def available() -> list[str]:
    """The optional runners whose engine is installed here, in registry order."""
    return [name for name, runner in OPTIONAL.items() if runner.available()]
