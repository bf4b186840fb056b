"""nox sessions: ``nox -s tests`` (CPU, what CI runs), ``lint``, ``gpu``, ``nightly``, ``bench``."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    """What CI runs: the whole suite, DeepSpeed and torchtitan installed (torch kept pinned)."""
    session.install(TORCH)
    session.install("-c", ".ci/constraints.txt", "-e", ".[test,deepspeed,torchtitan]", env={"DS_BUILD_OPS": "0"})
    session.run("pytest", "-n", "auto", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[lint]")
    session.run("ruff", "check", "pipecheck", "tests", "fixtures", "benchmarks")
    session.run("mypy", "pipecheck")


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU tests: NCCL and shared-GPU worlds. Needs CUDA; skips cleanly without it."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "gpu", "--pipecheck-device", "cuda", "-rs", *session.posargs)


@nox.session
def nightly(session: nox.Session) -> None:
    """Many more hypothesis examples (HYPOTHESIS_PROFILE=nightly), then the tests marked slow."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "auto", "tests/test_properties.py", *session.posargs,
                env={"HYPOTHESIS_PROFILE": "nightly"})
    session.run("pytest", "-n", "auto", "-m", "slow")  # e.g. two torchrun agents as two nodes


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks; they rewrite their sections of benchmarks/RESULTS.md."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    for script in ("bench_split.py", "bench_runtime.py", "bench_zero_bubble.py"):
        session.run("python", f"benchmarks/{script}", *session.posargs)
