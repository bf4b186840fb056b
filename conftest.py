"""Root conftest: pipecheck's own test-suite defaults.

The pytest plugin itself (worlds, markers, hypothesis profiles) comes from the
installed package's ``pytest11`` entry point, ``pipecheck.plugin``.
"""

import os

# The bounded, derandomized profile unless asked otherwise (HYPOTHESIS_PROFILE=dev|nightly).
os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")

# Tiny tensors, several processes per core under `pytest -n auto` and distributed ranks:
# intra-op threads only oversubscribe the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# tests/test_plugin.py runs real pytest sessions against pipecheck's plugin.
pytest_plugins = ["pytester"]
