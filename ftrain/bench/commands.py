"""What each ``python -m ftrain.bench`` command runs, given its parsed options.

Each ``run_<command>(ctx)`` measures and returns an :class:`Outcome` (the figures, the
table, the notes); :mod:`ftrain.bench.cli` prints it with the environment and writes JSON.

Example:
    >>> from ftrain.bench.parser import build_parser
    >>> args = build_parser().parse_args(["checkpoint", "--quick", "--size-mb", "1"])
    >>> outcome = RUNNERS["checkpoint"](make_context(args, on_error=print))
    >>> [r["variant"] for r in outcome.out["results"]]
    ['torch.save', 'ftrain background']
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ftrain.bench.models import ModelSpec

__all__ = ["Context", "Outcome", "make_context", "RUNNERS", "REPEATS"]

#: Timed repeats per command: (full, --quick).
REPEATS = {"amp": (10, 5), "memory": (10, 5), "overhead": (40, 5), "checkpoint": (5, 5),
           "compile": (10, 5), "e2e": (30, 8), "peers": (9, 5)}  # fmt: skip
#: Models per command when --model is not given: (full, --quick).
_MODELS = {"compile": (["transformer", "mlp"], ["mlp"])}


@dataclass
class Context:
    """The resolved options of one command (defaults of a full or a ``--quick`` run applied)."""

    args: argparse.Namespace
    quick: bool
    repeats: int
    warmup: int
    max_seconds: float
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    specs: list[ModelSpec] = field(default_factory=list)
    bar: Any = None


@dataclass
class Outcome:
    """A command's figures (``out``: ``results``, ``targets``...), table and notes."""

    out: dict[str, Any]
    table: str
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    extra: str = ""


def _specs(args: argparse.Namespace) -> list[ModelSpec]:
    from ftrain.bench.models import MODELS, default_spec

    models = args.model
    if models is None:
        full, quick = _MODELS.get(args.command, (list(MODELS), list(MODELS)))
        models = quick if args.quick else full
    sizes = ("batch_size", "width", "layers", "seq_len", "image_size", "heads")
    kw = {k: getattr(args, k) for k in sizes}
    return [default_spec(kind, quick=args.quick, **kw) for kind in dict.fromkeys(models)]


def make_context(args: argparse.Namespace, on_error: Callable[[str], Any]) -> Context:
    """Resolve ``args``; a bad combination goes to ``on_error`` (the parser's ``error``)."""
    from ftrain.bench.env import BenchError, resolve_device

    full, quick = REPEATS[args.command]
    ctx = Context(
        args, args.quick, args.repeats or (quick if args.quick else full),
        (1 if args.quick else 2) if getattr(args, "warmup", None) is None else args.warmup,
        getattr(args, "max_seconds", None) or (10.0 if args.quick else 60.0),
    )  # fmt: skip
    if hasattr(args, "model"):
        try:
            ctx.device, ctx.specs = resolve_device(args.device), _specs(args)
        except (BenchError, ValueError) as exc:
            on_error(str(exc))
    for spec in ctx.specs if args.command == "memory" else []:
        bad = [k for k in args.accum if spec.batch_size % k]
        if bad:
            on_error(
                f"--accum {' '.join(map(str, bad))}: the {spec.kind} batch size "
                f"{spec.batch_size} is not divisible by it; pick a --batch-size divisible "
                f"by {' and '.join(map(str, args.accum))}"
            )
    return ctx


def _interleaved(ctx: Context) -> str:
    return f"warm-up {ctx.warmup}, {ctx.repeats} timed repeats per variant, interleaved"


# ---------------------------------------------------------------------- amp
def run_amp(ctx: Context) -> Outcome:
    from ftrain.bench.amp import AmpConfig, amp_table, run_amp

    args = ctx.args
    steps = args.steps or (8 if ctx.quick else 30)
    cfg = AmpConfig(ctx.specs, ctx.device, args.precisions, steps, ctx.warmup, ctx.repeats,
                    ctx.max_seconds)  # fmt: skip
    with ctx.bar:
        out = run_amp(cfg, progress=ctx.bar)
    ref = args.precisions[0]
    notes = [
        f"step ms: median time of one training step (p25-p75 over {ctx.repeats} interleaved "
        f"repeats); samples/s: batch size / median; time vs {ref}: the median step time over "
        f"{ref}'s (lower is better: 0.50x is twice as fast)",
        f"act MiB: bytes saved for backward in one step (ftrain.memory accounting); act vs "
        f"{ref}: their ratio (lower is better); peak MiB: CUDA allocator peak of one step "
        "above what was allocated before it",
        f"loss@0 / loss@{steps}: held-out loss (float32) before / after {steps} AdamW "
        "steps; skipped: updates skipped by the fp16 loss scaler",
    ]
    config = {"steps": steps, "warmup": ctx.warmup, "repeats": ctx.repeats,
              "max_seconds": ctx.max_seconds, "precisions": list(args.precisions)}  # fmt: skip
    table = amp_table(out["results"], steps, cuda=ctx.device.type == "cuda")
    return Outcome(out, table, config, notes, _interleaved(ctx))


# ------------------------------------------------------------------- memory
def run_memory(ctx: Context) -> Outcome:
    from ftrain.bench.memory import MemoryConfig, memory_table, run_memory

    args = ctx.args
    budgets, accum = tuple(dict.fromkeys(args.budgets)), tuple(dict.fromkeys((1, *args.accum)))
    cfg = MemoryConfig(ctx.specs, ctx.device, budgets, accum, ctx.warmup, ctx.repeats,
                       args.dynamic_warmup, not args.no_conv_bn, ctx.max_seconds)  # fmt: skip
    with ctx.bar:
        out = run_memory(cfg, progress=ctx.bar)
    notes = [
        "ckpt: modules checkpointed; act MiB: bytes saved for backward in one (micro-)step "
        "(ftrain.memory accounting); vs ref: ratios to the first row of the block, of the "
        "bytes and of the step time (lower is better for both)",
        "budget MiB: a dynamic plan's budget (unreachable: over it, or the planner "
        "warned it cannot meet it)",
        f"step ms: median time of one optimizer update over the effective batch (p25-p75 "
        f"over {ctx.repeats} interleaved repeats; with accum K, K micro-steps); "
        "us/sample: median / effective batch",
        "peak MiB: CUDA allocator peak of one update above what was allocated before it",
    ]
    config = {"budgets": list(cfg.budgets), "accum": list(cfg.accum), "warmup": ctx.warmup,
              "repeats": ctx.repeats, "dynamic_warmup": args.dynamic_warmup,
              "max_seconds": ctx.max_seconds}  # fmt: skip
    table = memory_table(out["results"], cuda=ctx.device.type == "cuda")
    return Outcome(out, table, config, notes, _interleaved(ctx))


# ----------------------------------------------------------------- overhead
def run_overhead(ctx: Context) -> Outcome:
    from ftrain.bench.overhead import overhead_table, run_overhead

    args = ctx.args
    imports = (0 if ctx.quick else 5) if args.import_repeats is None else args.import_repeats
    chunk = 200 if ctx.quick else None
    with ctx.bar:
        out = run_overhead(args.workloads, repeats=ctx.repeats, import_repeats=imports,
                           progress=ctx.bar, chunk_steps=chunk, quick=ctx.quick)  # fmt: skip
    extra = f"{ctx.repeats} interleaved repeats per variant" + (
        f", {chunk} steps per chunk (--quick: a rough look; the full run's 1000-step "
        "chunks hold every rare cost)" if chunk else "")  # fmt: skip
    notes = [f"{name}: {desc}" for name, desc in out["descriptions"].items()]
    if out["import_s"] is not None:
        imp = out["import_s"]
        notes.append(
            f"import: torch {imp['torch']:.3f} s, torch+ftrain {imp['torch+ftrain']:.3f} s, "
            f"ftrain adds {imp['added']:+.3f} s; -X importtime: {imp['importtime']:.3f} s"
        )
    notes.append(
        "us/step: median microseconds per training step (p25-p75 over repeats); time vs ref "
        "and added us: medians of the per-repeat paired ratio / difference against 'vs' "
        "(lower is better), the interval: where the median of the added us lies "
        "(order statistics of the paired differences)"
    )
    config = {"repeats": ctx.repeats, "import_repeats": imports, "chunk_steps": chunk}
    return Outcome(out, overhead_table(out["results"]), config, notes, extra)


# --------------------------------------------------------------- checkpoint
def run_checkpoint(ctx: Context) -> Outcome:
    from ftrain.bench.checkpoint import checkpoint_table, run_checkpoint

    args = ctx.args
    size = args.size_mb or (16.0 if ctx.quick else 1024.0)
    directory = None if args.dir is None else str(args.dir)
    out = run_checkpoint(size, ctx.repeats, directory, quick=ctx.quick)
    notes = [
        "blocked: time save() held the training thread (first: the first save, which also "
        "allocates the host buffers later saves reuse); completed: until the file and the "
        "manifest were on disk (fsync); blocked vs torch.save: the median of the per-repeat "
        "ratios (lower is better)"
    ]
    config = {"size_mb": size, "repeats": ctx.repeats}
    extra = f"{ctx.repeats} interleaved repeats per variant"
    return Outcome(out, checkpoint_table(out), config, notes, extra)


# ------------------------------------------------------------------ compile
_VERDICT_WORD = re.compile(r"\s+(OK|MISSED)\s*$")


def quick_targets(lines: list[str]) -> list[str]:
    """A quick run's full-size target lines without a verdict: the figure, for information.

    Example:
        >>> quick_targets(["x on transformer >= 1.3x: 1.19x  MISSED", "y: 1.0x not judged"])
        ['x on transformer >= 1.3x: 1.19x  not judged (--quick)', 'y: 1.0x not judged']
    """
    return [_VERDICT_WORD.sub("  not judged (--quick)", line) for line in lines]


def run_compile(ctx: Context) -> Outcome:
    from ftrain.bench.compile import quick_specs, run_cli

    args = ctx.args
    if ctx.device.type != "cpu":
        print(f"note: compile runs on the CPU; --device {args.device} is ignored")
        ctx.device = torch.device("cpu")
    ctx.specs = quick_specs(args, ctx.specs)
    out, table, config, notes = run_cli(
        args, ctx.specs, ctx.repeats, ctx.warmup, ctx.max_seconds, ctx.bar
    )
    return Outcome(out, table, config, notes, _interleaved(ctx))


# ---------------------------------------------------------------------- e2e
def run_e2e(ctx: Context) -> Outcome:
    from ftrain.bench.e2e import E2EConfig, e2e_table, profile_sides, run_e2e

    args = ctx.args
    every = args.updates // 2 if args.updates % 2 == 0 and args.updates > 1 else args.updates
    blocks = args.blocks or (2 if ctx.quick else 3)
    cfg = E2EConfig(blocks=blocks, rounds=max(1, -(-ctx.repeats // blocks)), updates=args.updates,
                    log_every=every, eval_every=every, checkpoint_every=args.updates,
                    directory=None if args.dir is None else str(args.dir))  # fmt: skip
    with ctx.bar:
        out = run_e2e(cfg, progress=ctx.bar, quick=ctx.quick)
    notes = [
        f"model: {cfg.spec.describe()}; {cfg.accum} micro-batches per update, "
        f"{cfg.updates} updates per chunk, log and evaluation every {cfg.log_every} / "
        f"{cfg.eval_every} updates, a background checkpoint every {cfg.checkpoint_every}",
        "tokens/s: per chunk (p25-p75 over the rounds); the ratio: the median of the "
        "per-round ratios of tokens/s, ftrain / hand-written, higher is better",
    ]
    if args.profile:
        out["profile"] = profile_sides(cfg)
        for name, prof in out["profile"].items():
            notes.append(f"cProfile, {name}: ftrain's own code {prof['ftrain_share']:.1%} of "
                         f"the time; top functions by own time:\n{prof['top']}")  # fmt: skip
    config = {"blocks": cfg.blocks, "rounds": cfg.rounds, "updates": cfg.updates,
              "accum": cfg.accum,
              "log_every": cfg.log_every, "eval_every": cfg.eval_every,
              "checkpoint_every": cfg.checkpoint_every, "model": cfg.spec.as_dict()}  # fmt: skip
    extra = (f"{cfg.blocks} fresh pairs of runs x {cfg.rounds} alternating rounds of "
             f"{cfg.updates} updates per side")  # fmt: skip
    return Outcome(out, e2e_table(out), config, notes, extra)


# -------------------------------------------------------------------- peers
def run_peers(ctx: Context) -> Outcome:
    from ftrain.bench.peers import PeersConfig, peers_table, run_peers

    args = ctx.args
    cfg = PeersConfig(
        steps=args.steps or (300 if ctx.quick else 900),
        rounds=ctx.repeats,
        size_mb=args.size_mb or (16.0 if ctx.quick else 256.0),
        directory=None if args.dir is None else str(args.dir),
    )
    with ctx.bar:
        out = run_peers(cfg, progress=ctx.bar, quick=ctx.quick)
    config = {"steps": cfg.steps, "rounds": cfg.rounds, "size_mb": cfg.size_mb}
    extra = f"{cfg.rounds} alternating rounds per variant"
    return Outcome(out, peers_table(out), config, out.get("notes", []), extra)


#: Each command's runner.
RUNNERS: dict[str, Callable[[Context], Outcome]] = {
    "amp": run_amp, "memory": run_memory, "overhead": run_overhead,
    "checkpoint": run_checkpoint, "compile": run_compile, "e2e": run_e2e, "peers": run_peers,
}  # fmt: skip
