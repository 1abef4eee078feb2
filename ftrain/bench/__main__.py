"""``python -m ftrain.bench``: see :mod:`ftrain.bench.cli`."""

from ftrain.bench.cli import main

raise SystemExit(main())
