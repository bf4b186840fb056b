"""pipecheck's pytest plugin (registered through the ``pytest11`` entry point).

    def test_my_engine(pipecheck_world):
        world = pipecheck_world(4)           # live for the whole session, one per xdist worker
        pc.assert_equivalent(make_model, (x,), runner="distributed", world=world)

It only declares options, markers, fixtures and hooks; torch and the runtime
are imported when a fixture is first used. The ``gpu`` marker is declared here
(and only here), so every project using pipecheck gets it.

Hypothesis profiles ``ci`` (bounded, derandomized), ``dev`` and ``nightly``
(many examples) are registered here and chosen with ``HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pipecheck")
    group.addoption("--pipecheck-device", default="cpu", choices=("cpu", "cuda"),
                    help="device of the session's pipecheck worlds (default: cpu)")
    group.addoption("--pipecheck-timeout", type=float, default=120.0,
                    help="seconds before a pipecheck world job is declared hung (default: 120)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu(n=1): needs n CUDA GPUs; skipped cleanly without them")
    _register_hypothesis_profiles()


def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, Phase, settings
    except ImportError:  # pragma: no cover - hypothesis is a dependency
        return
    slow = [HealthCheck.too_slow, HealthCheck.data_too_large]
    # No explain phase: after a failure it re-runs the shrunk case hundreds of times (a minute
    # per failing test here), and the repro script pipecheck prints already says what failed.
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
    settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None,
                              suppress_health_check=slow, print_blob=True, phases=phases)
    # derandomize=False said outright: with CI set, hypothesis's own "ci" profile is the default
    # these inherit from, and a nightly run that replays one fixed seed explores nothing new.
    settings.register_profile("dev", max_examples=100, derandomize=False, deadline=None,
                              suppress_health_check=slow)
    settings.register_profile("nightly", max_examples=500, derandomize=False, deadline=None,
                              suppress_health_check=slow, print_blob=True, phases=phases)
    profile = os.environ.get("HYPOTHESIS_PROFILE")
    if profile:
        settings.load_profile(profile)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    available = _gpu_count()
    for item in gpu_items:
        marker = item.get_closest_marker("gpu")
        needed = int(marker.kwargs.get("n", marker.args[0] if marker.args else 1)) if marker else 1
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {available}"))


@pytest.fixture(scope="session")
def pipecheck_world(request: pytest.FixtureRequest) -> Iterator[Callable[[int], Any]]:
    """A factory of session-long Worlds: ``pipecheck_world(n)`` starts n ranks once, then reuses them.

    They are ``pc.World.shared(n, device)``: the same Worlds a check uses when given none. The
    session's end stops them (and the interpreter's exit stops any a test made outside this fixture).
    """
    from pipecheck import World

    device = request.config.getoption("--pipecheck-device")
    timeout = request.config.getoption("--pipecheck-timeout")

    def get(world_size: int) -> Any:
        return World.shared(world_size, device, timeout=timeout)

    yield get
    World.close_shared()
