"""Activation memory and step time with activation checkpointing and efficient conv-bn eval.

A thin wrapper over ``python -m ftrain.bench memory`` (:mod:`ftrain.bench.memory`)
on the transformer and the conv net; every option of that command works here::

    python benchmarks/memory.py                 # full sizes, a few minutes on one CPU thread
    python benchmarks/memory.py --quick         # small models, a few seconds
    python benchmarks/memory.py --device cuda --json memory.json --plot memory.png
    python benchmarks/memory.py --model mlp --budgets 0.6 0.3

Variants per model: no checkpointing, every block, every other block, selective,
dynamic plans at budget fractions of the unchecked activation bytes, efficient
conv-bn eval off/on with frozen BatchNorms (conv net), and gradient accumulation at
equal effective batch. See ``python -m ftrain.bench memory --help`` and
``docs/bench.md`` for what each column means.

The models (``Transformer``/``Block``/``lm_loss``, ``ConvNet``/``ResBlock``/
``ce_loss``) live in :mod:`ftrain.bench.models`; they are re-exported here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ftrain.bench.cli import main as bench_main
from ftrain.bench.models import Block, ConvNet, ResBlock, Transformer, ce_loss, lm_loss

__all__ = ["Block", "Transformer", "lm_loss", "ResBlock", "ConvNet", "ce_loss", "main"]

DEFAULT_MODELS = ("transformer", "convnet")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ftrain.bench memory`` on :data:`DEFAULT_MODELS` (a ``--model`` in ``argv`` wins)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return bench_main(["memory", "--model", *DEFAULT_MODELS, *args])


if __name__ == "__main__":
    raise SystemExit(main())
