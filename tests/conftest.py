"""The test folders mirror the package's (tests/split/ for pipecheck/_split/, ...); the helpers they
share (``_world_jobs``, ``_engine_models``, ``_odd_models``, ...) live here in tests/ and are imported
by name, by the tests and by the worker ranks that unpickle them (spawned ranks inherit sys.path)."""

import sys
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
