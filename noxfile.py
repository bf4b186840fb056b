"""nox sessions: ``nox -s tests`` (CPU, what CI runs), ``lint``, ``gpu``, ``nightly``, ``matrix``, ``real_models``,
``bench``.

``tests`` installs as a new user does, so it gets the newest torch the package index serves;
``tests_floor`` the oldest torch pipecheck supports; ``matrix`` one session per supported torch
minor (``nox -s "matrix(torch='2.10')"``), which rewrites that torch's record in docs/torch-matrix/ and
then docs/torch-versions.md whole from every record.
"""

import os
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from pipecheck._core.torch_versions import TESTED_TORCH  # noqa: E402  (torch-free: no torch in nox's own venv)

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"

# Each session asks for its torch itself: a machine-wide pip constraint (a pinned or capped torch, as
# some CI images carry) must not swap in another one.
NO_CONSTRAINTS = {"PIP_CONSTRAINT": os.devnull}
NEWEST = {**NO_CONSTRAINTS, "DS_BUILD_OPS": "0"}  # DeepSpeed builds no C++ op at install time


def _install_with_torch(session: nox.Session, minor: str) -> None:
    """pipecheck and its test extras with torch ``minor`` (one resolution, so nothing moves torch), and
    a check that it is the torch the session runs."""
    session.install(f"torch=={minor}.*", "-e", ".[test]", env=NO_CONSTRAINTS)
    session.run("python", "-c", "import sys, torch; from pipecheck._core.torch_versions import minor; "
                f"print('torch', torch.__version__); sys.exit(minor(torch.__version__) != {minor!r})")


@nox.session
def tests(session: nox.Session) -> None:
    """What CI runs: the whole suite on the torch a fresh install resolves to (the newest), with the
    DeepSpeed, torchtitan and Megatron Core extras, so their runners are tested too."""
    session.install("-e", ".[test,deepspeed,torchtitan,megatron]", env=NEWEST)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", "-n", "auto", *session.posargs)


@nox.session
def tests_floor(session: nox.Session) -> None:
    """The whole suite on the oldest supported torch (pyproject's floor), without the engine extras."""
    _install_with_torch(session, TESTED_TORCH[0])
    session.run("pytest", "-n", "auto", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("-e", ".[lint]", env=NO_CONSTRAINTS)
    session.run("ruff", "check", "pipecheck", "tests", "fixtures", "benchmarks", "docs", "noxfile.py")
    session.run("mypy", "pipecheck")


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU tests: NCCL and shared-GPU worlds. Needs CUDA; skips cleanly without it."""
    session.install("-e", ".[test]", env=NO_CONSTRAINTS)
    session.run("pytest", "-m", "gpu", "--pipecheck-device", "cuda", "-rs", *session.posargs)


@nox.session
def nightly(session: nox.Session) -> None:
    """Many more hypothesis examples (HYPOTHESIS_PROFILE=nightly), then the tests marked slow, then the
    torch version matrix (every supported torch: about an hour on 2 cores; it re-checks the release
    boundaries tests/_torch_findings.py assumes), then the real-model suite (real_models)."""
    session.install("-e", ".[test]", env=NO_CONSTRAINTS)
    session.run("pytest", "-n", "auto", "tests/strategies/test_properties.py", *session.posargs,
                env={"HYPOTHESIS_PROFILE": "nightly"})
    session.run("pytest", "-n", "auto", "-m", "slow")  # e.g. two torchrun agents as two nodes
    for minor in TESTED_TORCH:  # notify("matrix") would queue only the first of them
        session.notify(f"matrix(torch={minor!r})")
    session.notify("real_models")


@nox.session
def real_models(session: nox.Session) -> None:
    """HuggingFace families and torchvision's models as users write them (default configs, train mode)
    through the reference, distributed and torch runners; rewrites docs/real-models.md's table (about an
    hour on 2 cores). ``nox -s real_models -- --families llama,gptj`` runs a few."""
    session.install("-e", ".[test,vision]", env=NO_CONSTRAINTS)
    session.run("python", "benchmarks/real_models.py", *(session.posargs or ["--write"]))


@nox.session
@nox.parametrize("torch", TESTED_TORCH)
def matrix(session: nox.Session, torch: str) -> None:
    """One supported torch: the default suite and the zoo (every torch schedule), recorded in its committed
    record docs/torch-matrix/<torch>.json; then docs/torch-versions.md is written whole from every record
    (the other versions' records are kept). ``-- --only zoo`` measures the zoo again and keeps the suite."""
    _install_with_torch(session, torch)
    session.run("python", "docs/torch_matrix.py", "run", "--out", f"docs/torch-matrix/{torch}.json", *session.posargs)
    session.run("python", "docs/torch_matrix.py", "write")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks; they rewrite their sections of benchmarks/RESULTS.md."""
    session.install("-e", ".[test]", env=NO_CONSTRAINTS)
    for script in ("bench_split.py", "bench_runtime.py", "bench_zero_bubble.py"):
        session.run("python", f"benchmarks/{script}", *session.posargs)
