"""Root conftest: pipecheck's own test-suite defaults.

The pytest plugin itself (worlds, markers, hypothesis profiles) comes from the
installed package's ``pytest11`` entry point, ``pipecheck.plugin``.
"""

import os

# The bounded, derandomized profile unless asked otherwise (HYPOTHESIS_PROFILE=dev|nightly).
os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
