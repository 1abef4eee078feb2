"""ftrain against Lightning, MMEngine and accelerate: loop overhead and save blocking.

A thin wrapper over ``python -m ftrain.bench peers`` (:mod:`ftrain.bench.peers`); every
option of that command works here::

    python benchmarks/peers.py               # 9 rounds of 900 steps, a 256 MiB state
    python benchmarks/peers.py --quick       # 5 rounds of 300 steps, 16 MiB
    python benchmarks/peers.py --json peers.json

Loop overhead: microseconds per step each framework's loop adds to a plain PyTorch loop
on a tiny model (paired by round). Save blocking: how long a background save holds the
training thread, as a share of ``torch.save``, for ftrain, Lightning's
``AsyncCheckpointIO`` and ``torch.distributed.checkpoint.async_save``. A peer that is
not installed is skipped with a note (``pip install lightning mmengine accelerate``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ftrain.bench.cli import main as bench_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ftrain.bench peers`` with ``argv``."""
    return bench_main(["peers", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
