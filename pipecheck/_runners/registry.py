"""Every built-in runner, in one table: its name, whose engine runs, where its code lives, what it needs.

    entry = runner_named("torch-pipelining")  # any spelling -> its row ("torch"); None if unknown
    run = entry.load()                        # its runner; InputError with the pip command if missing
    available()                               # ["reference", "distributed", "torch", "deepspeed", ...]

A runner is listed by ``available`` only when its engine is installed (looked up without importing
it). Each name says whose engine runs as an alias too ("pipecheck-runtime", "torch-pipelining");
the contract's names ("reference", "distributed", "torch") stay the ones listed and reported. A new
engine is one folder under ``pipecheck/_runners/`` and one row here. The command line reads this
table without paying for torch: nothing here imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from pipecheck.errors import InputError

DISTRIBUTION = "torch-pipecheck"
"""pipecheck's name on the package index (pyproject's ``[project] name``); it imports as ``pipecheck``.
The index's ``pipecheck`` is an unrelated project: every install line says this name."""


def install_command(extra: str | None = None) -> str:
    """``pip install "torch-pipecheck[deepspeed]"``: the command that installs pipecheck with ``extra``."""
    return f'pip install "{DISTRIBUTION}[{extra}]"' if extra else f"pip install {DISTRIBUTION}"


@dataclass(frozen=True)
class RunnerEntry:
    """One built-in runner."""

    name: str
    engine: str  # whose engine runs, in words
    runner: str  # "module:attribute" of the runner inside pipecheck
    aliases: tuple[str, ...] = ()  # other names, each saying whose engine runs
    package: str | None = None  # an engine installed separately: its import name, looked up without importing it
    extra: str | None = None  # install_command(extra) installs it
    on_world: bool = True  # runs on worker processes (a script calling it needs `if __name__ == "__main__":`)

    def available(self) -> bool:
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def load(self) -> Any:
        if not self.available():
            raise InputError(f"runner={self.name!r} needs {self.package}, which is not installed. Fix: "
                             f"{install_command(self.extra)}.")
        module, _, attr = self.runner.partition(":")
        return getattr(importlib.import_module(module), attr)


RUNNERS: dict[str, RunnerEntry] = {
    entry.name: entry for entry in (
        RunnerEntry("reference", "pipecheck's DetachExecutor, in this process", "pipecheck._runners.training:reference_runner",
                    aliases=("detach_executor",), on_world=False),
        RunnerEntry("distributed", "pipecheck's runtime", "pipecheck._runners.runtime.driver:run_distributed",
                    aliases=("pipecheck_runtime",)),
        RunnerEntry("torch", "torch.distributed.pipelining", "pipecheck._runners.torch_pipelining.driver:run_torch",
                    aliases=("torch_pipelining",)),
        RunnerEntry("deepspeed", "DeepSpeed's PipelineEngine", "pipecheck._runners.deepspeed.driver:run_deepspeed",
                    package="deepspeed", extra="deepspeed"),
        RunnerEntry("torchtitan", "torchtitan", "pipecheck._runners.torchtitan.driver:run_torchtitan",
                    package="torchtitan", extra="torchtitan"),
        RunnerEntry("megatron", "Megatron Core's pipeline schedules", "pipecheck._runners.megatron.driver:run_megatron",
                    aliases=("megatron_core",), package="megatron", extra="megatron"),
    )
}

BUILTIN = tuple(name for name, entry in RUNNERS.items() if entry.package is None)
"""The runners that ship with pipecheck itself."""

OPTIONAL = {name: entry for name, entry in RUNNERS.items() if entry.package is not None}
"""The runners whose engine is a separate install."""


def name_key(name: str) -> str:
    """A runner's name as the table compares it: case, surrounding spaces and "-" vs "_" ignored."""
    return name.strip().lower().replace("-", "_")


_BY_NAME = {name_key(spelling): entry for entry in RUNNERS.values() for spelling in (entry.name, *entry.aliases)}


def runner_named(name: object) -> RunnerEntry | None:
    """The row of a built-in runner's name or alias, or None."""
    return _BY_NAME.get(name_key(name)) if isinstance(name, str) else None


def available() -> list[str]:
    """Every built-in runner whose engine is installed here, in table order."""
    return [name for name, entry in RUNNERS.items() if entry.available()]
