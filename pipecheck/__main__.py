"""``python -m pipecheck``: see :mod:`pipecheck._cli.main`."""

from pipecheck._cli.main import main

raise SystemExit(main())
