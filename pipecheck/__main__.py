"""``python -m pipecheck``: see :mod:`pipecheck._cli`."""

from pipecheck._cli import main

raise SystemExit(main())
