"""The test folders mirror the package's (tests/split/ for pipecheck/_split/, ...); the helpers they
share (``_world_jobs``, ``_engine_models``, ``_odd_models``, ...) live here in tests/ and are imported
by name, by the tests and by the worker ranks that unpickle them (spawned ranks inherit sys.path)."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures(...)``): a
    second thread only waits for a core, and contends with the other workers' (25x slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
