"""Checkpoint saves: training-thread blocked time of a background save vs ``torch.save``.

A thin wrapper over ``python -m ftrain.bench checkpoint`` (:mod:`ftrain.bench.checkpoint`);
every option of that command works here::

    python benchmarks/checkpoint.py                   # a 1 GiB state, 3 repeats
    python benchmarks/checkpoint.py --quick           # 16 MiB, seconds
    python benchmarks/checkpoint.py --size-mb 4096 --json ckpt.json

Target: the blocked time of a background save is at most 25% of a synchronous
``torch.save`` of the same state.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ftrain.bench.cli import main as bench_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ftrain.bench checkpoint`` with ``argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return bench_main(["checkpoint", *args])


if __name__ == "__main__":
    raise SystemExit(main())
