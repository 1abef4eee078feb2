"""The full ftrain stack against a hand-written PyTorch loop with the same features.

A thin wrapper over ``python -m ftrain.bench e2e`` (:mod:`ftrain.bench.e2e`); every
option of that command works here::

    python benchmarks/e2e.py                 # 30 alternating rounds, a few minutes
    python benchmarks/e2e.py --quick         # 8 rounds, under a minute
    python benchmarks/e2e.py --profile --json e2e.json

A small transformer LM trained by ``Loop`` + ``default_hooks`` + ``EvalHook`` with bf16
autocast, accumulation, clipping, warmup + cosine, EMA, a background checkpoint and
logging, and by the same training written with torch alone
(:func:`ftrain.bench.e2e.hand_written_loop`), alternating in one process on the same
data and seed. Target: tokens/s at least 0.98x the hand-written loop's, judged only when
the whole paired interval is on one side; both runs must reach the same loss.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ftrain.bench.cli import main as bench_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ftrain.bench e2e`` with ``argv``."""
    return bench_main(["e2e", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
