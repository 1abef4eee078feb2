"""The whole training step compiled (``ftrain.with_compile``) vs eager and vs a compiled model.

Run::

    python benchmarks/compile.py                  # full run: transformer and MLP, default sizes
    python benchmarks/compile.py --quick          # smaller models, fewer rounds
    python benchmarks/compile.py --json out.json --profile

The same as ``python -m ftrain.bench compile`` (every option of it works here):
four variants per model, timed interleaved on the CPU (one thread by default),
AdamW + gradient clipping by norm, float32, a fixed batch:

* ``plain eager``: a plain PyTorch loop;
* ``plain compile(model)``: the plain loop over ``torch.compile(model)``;
* ``ftrain eager``: ``make_step`` + ``with_clip``;
* ``ftrain compiled``: the same step under ``ftrain.with_compile``.

Target (issue 14): ``ftrain compiled`` at least 1.3x faster than ``plain eager``
on the transformer, and faster than ``plain compile(model)``. When a full run
misses it, the torch.profiler top operators of both are printed.
"""

from __future__ import annotations

import sys

from ftrain.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
