"""The command line: ``python -m ftrain.bench {amp,memory,overhead,checkpoint,compile,e2e,peers}``.

:mod:`ftrain.bench.parser` reads the options, :mod:`ftrain.bench.commands` runs the
command; this module prints the environment, the table, the notes, the targets and the
command's wall time, and writes the JSON and the plot.

Example:
    >>> parser = build_parser()
    >>> args = parser.parse_args(["memory", "--quick", "--budgets", "0.5", "--model", "mlp"])
    >>> args.command, args.budgets, args.model
    ('memory', [0.5], ['mlp'])
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftrain.bench.parser import build_parser

__all__ = ["build_parser", "main", "targets_text"]


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def _header(env: dict[str, Any], extra: str) -> str:
    line = (
        f"ftrain {env['ftrain']}, torch {env['torch']}, Python {env['python']}, "
        f"{env['device']} ({env['device_name']}), {env['threads']} thread(s); {extra}"
    )
    num = env.get("numerics")
    if num and str(env["device"]).startswith("cuda"):
        line += (
            f"\nTF32 matmul {'on' if num['cuda_matmul_allow_tf32'] else 'off'}, "
            f"TF32 cuDNN {'on' if num['cudnn_allow_tf32'] else 'off'}, float32 matmul "
            f"precision {num['float32_matmul_precision']}, cuDNN {num['cudnn_version']} "
            f"(benchmark {'on' if num['cudnn_benchmark'] else 'off'}, deterministic "
            f"{'on' if num['cudnn_deterministic'] else 'off'})"
        )
    return line


def targets_text(targets: Sequence[str], quick: bool) -> str:
    """The targets block; a quick run says which targets it cannot judge.

    Example:
        >>> print(targets_text(["a <= 1.02x: 1.00x (...) OK"], quick=False))
        targets (OK / MISSED only when the whole interval is on one side; else inconclusive):
          a <= 1.02x: 1.00x (...) OK
    """
    head = "targets (OK / MISSED only when the whole interval is on one side; else inconclusive)"
    if quick:
        head += (
            "; a --quick run does not judge the targets defined at full size "
            "(marked 'not judged'): run without --quick for them"
        )
    return head + ":\n" + "\n".join("  " + t for t in targets)


def _print(result: dict[str, Any], outcome: Any, ctx: Any, elapsed: float) -> None:
    out = outcome.out
    print(_header(result["environment"], outcome.extra))
    for spec in ctx.specs:
        print(f"  {spec.describe()}")
    print()
    print(outcome.table)
    print()
    notes = list(outcome.notes)
    if out.get("targets"):
        notes.append(targets_text([str(t) for t in out["targets"]], ctx.quick))
    for name, prof in out.get("profile", {}).items():
        if isinstance(prof, str):
            notes.append(
                f"profile, {name} ({ctx.specs[0].kind}), top ops by self CPU time:\n{prof}"
            )
    if any(r.get("capped") for r in out.get("results", [])):
        notes.append(
            f"*: over the --max-seconds {ctx.max_seconds:g} limit: fewer steps (loss@N shows "
            "@steps when training was cut short)"
        )
    for n in notes:
        print(n)
    from ftrain.bench.env import process_seconds

    total = process_seconds()
    since = "" if total is None else f"; {total:.1f} s since the process started"
    print(f"({ctx.args.command} took {elapsed:.1f} s{since})")


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ftrain.bench.commands import RUNNERS, make_context
    from ftrain.bench.env import environment
    from ftrain.bench.report import progress_bar

    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    ctx = make_context(args, on_error=parser.error)
    ctx.bar = progress_bar(0, args.command, enabled=not args.no_progress)
    outcome = RUNNERS[args.command](ctx)
    env = environment(ctx.device, _jsonable(args))
    elapsed = time.perf_counter() - start
    result = {
        "benchmark": args.command,
        "environment": env,
        "config": outcome.config,
        "models": [s.as_dict() for s in ctx.specs],
        "seconds": elapsed,
        **outcome.out,
    }
    _print(result, outcome, ctx, elapsed)
    return result


def _plot(args: argparse.Namespace, result: dict[str, Any]) -> None:
    title = _header(result["environment"], "").rstrip("; ")
    module = importlib.import_module(f"ftrain.bench.{args.command}")
    getattr(module, f"plot_{args.command}")(result["results"], str(args.plot), title=title)
    print(f"wrote {args.plot}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, print; exit status.

    Example:
        >>> main(["memory", "--budgets", "1.5"])  # doctest: +SKIP
        usage: python -m ftrain.bench memory ...
        python -m ftrain.bench memory: error: argument --budgets: a budget fraction must be in (0, 1] ...
    """
    from ftrain.bench.env import BenchError

    parser = build_parser()
    args = parser.parse_args(argv)
    sub = parser.commands[args.command]  # type: ignore[attr-defined]
    try:
        result = _run(sub, args)
    except BenchError as exc:
        sub.error(str(exc))
    if args.json is not None:
        from ftrain.bench.report import write_json

        print(f"wrote {write_json(args.json, result)}")
    if getattr(args, "plot", None) is not None:
        _plot(args, result)
    sys.stdout.flush()
    return 0
