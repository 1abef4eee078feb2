"""``python -m ftrain.bench``: benchmarks of ftrain's steps on built-in models.

Commands (see ``python -m ftrain.bench --help`` and ``docs/bench.md``):

* ``amp``: float32 vs bfloat16 vs float16 with dynamic loss scaling
  (:mod:`ftrain.bench.amp`).
* ``memory``: activation-checkpoint plans, efficient conv-bn eval, gradient
  accumulation (:mod:`ftrain.bench.memory`).
* ``overhead``: per-step overhead against a plain PyTorch loop
  (:mod:`ftrain.bench.overhead`, running the repository's ``benchmarks/overhead.py``).

The pieces: :mod:`~ftrain.bench.models` (the models, sized by flags),
:mod:`~ftrain.bench.timing` (interleaved repeats, median and spread),
:mod:`~ftrain.bench.env` (device and environment), :mod:`~ftrain.bench.report`
(tables, progress bar, JSON), :mod:`~ftrain.bench.cli` (the command line).
``import ftrain`` does not import this package.

Example:
    >>> from ftrain.bench import main
    >>> main(["amp", "--quick", "--model", "mlp"])  # doctest: +SKIP
    0
"""

from ftrain.bench.cli import main

__all__ = ["main"]
