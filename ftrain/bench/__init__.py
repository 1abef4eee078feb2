"""``python -m ftrain.bench``: benchmarks of ftrain's steps on built-in models.

Example:
    >>> from ftrain.bench import main
    >>> main(["amp", "--quick", "--model", "mlp"])  # doctest: +SKIP
    0
"""

from ftrain.bench.cli import main

__all__ = ["main"]
