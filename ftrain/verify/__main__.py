"""``python -m ftrain.verify module:function``: does your run resume bitwise? (docs/verify.md)"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence

from ftrain.verify.core import verify_resume

__all__ = ["main", "load"]


def load(spec: str) -> Callable:
    """The function ``module:function`` names (the current directory is importable).

    Example:
        >>> load("ftrain.demo:build_short").__name__
        'build_short'
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(
            f"{spec!r}: name your build function as module:function, e.g. train:build for "
            "build() in train.py (run from its directory) or ftrain.demo:build_short."
        )
    if "" not in sys.path:
        sys.path.insert(0, "")  # a script in the current directory
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{spec!r}: cannot import {module} ({exc}).") from None
    fn = getattr(found, name, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: {module} has no function {name}.")
    return fn


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ftrain.verify",
        description="Run your training uninterrupted, resume it from a checkpoint at every "
        "update (and after signals in subprocesses) and report whether every resumed run "
        "continues bitwise, or where it first differs. BUILD is module:function, a function "
        "(work_dir, resume) -> ftrain.Loop passing both on to ftrain.Loop.",
    )
    p.add_argument("build", metavar="BUILD", help="module:function, e.g. ftrain.demo:build_short")
    p.add_argument("--points", type=int, default=None, help="resume from N sampled updates "
                   "(default: every update)")  # fmt: skip
    p.add_argument("--signals", type=int, default=0, help="also deliver N signals "
                   "(SIGINT, SIGTERM, SIGKILL) to the run in subprocesses")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="where sampled points and signals land")
    p.add_argument("--dir", default=None, help="keep the runs here (default: a temporary dir)")
    p.add_argument("--verbose", action="store_true", help="show what the runs print")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Verify as the command line says; print the report; 0 when bitwise equal everywhere."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        build = load(args.build)
    except ValueError as exc:
        p.error(str(exc))
    start = time.perf_counter()
    verdict = verify_resume(
        build, points=args.points, signals=args.signals, seed=args.seed, directory=args.dir,
        quiet=not args.verbose, progress=lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip
    print(verdict)
    for s in verdict.signals:
        print(f"  {s}")
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
