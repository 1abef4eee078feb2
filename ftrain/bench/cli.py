"""The command line: ``python -m ftrain.bench {amp,memory,overhead,checkpoint,compile} [options]``.

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

__all__ = ["build_parser", "main"]

# full / --quick defaults of the options left unset
# fmt: off
_DEFAULTS = {
    "full": {"warmup": 2, "repeats": 10, "steps": 30, "max_seconds": 60.0,
             "overhead_repeats": 40, "overhead_chunk": None},
    "quick": {"warmup": 1, "repeats": 5, "steps": 8, "max_seconds": 10.0,
              "overhead_repeats": 5, "overhead_chunk": 200},
}
# fmt: on

_DESCRIPTION = """\
Benchmarks of ftrain's training steps on built-in models (a small transformer, a
small conv net, an MLP). Times are the median and 25th-75th percentile of repeated
steps after warm-up, the variants of a model timed interleaved (round-robin,
rotating who goes first). See `python -m ftrain.bench <command> --help`.
"""

_EPILOG = """\
examples:
  python -m ftrain.bench amp --quick --plot amp.png
  python -m ftrain.bench memory --model transformer --d-model 256 --layers 8 --json mem.json
  python -m ftrain.bench memory --budgets 0.6 0.3 0.1 --plot mem.png
  python -m ftrain.bench overhead --quick --plot overhead.png
  python -m ftrain.bench checkpoint --size-mb 1024
  python -m ftrain.bench compile --quick
"""


# ------------------------------------------------------------------ arg types
def _number(kind: type, minimum: float, *, inclusive: bool) -> Any:
    """An argparse type: a ``kind`` (int or float) >= ``minimum`` (or > when not inclusive)."""
    word = "a whole number" if kind is int else "a number"
    sign = ">=" if inclusive else ">"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word}, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be {sign} {minimum:g}, got {text}")
        return value

    return parse


_positive_int = _number(int, 1, inclusive=True)
_nonneg_int = _number(int, 0, inclusive=True)
_positive_float = _number(float, 0, inclusive=False)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.5, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"a budget fraction must be in (0, 1] (a share of the activation bytes without "
            f"checkpointing), got {text}"
        )
    return value


# -------------------------------------------------------------------- parser
# fmt: off
def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--quick", action="store_true",
                   help="smaller default models and fewer steps: a whole command in seconds "
                   "(used by CI); explicit options still win")
    g.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                   help="torch CPU threads (torch.set_num_threads; default: 1, for reproducible "
                   "CPU timings that do not depend on the machine's core count or load)")
    g.add_argument("--repeats", type=_positive_int, default=None, metavar="N",
                   help="timed repeats per variant; the median and 25th-75th percentile are "
                   "reported (default: 10, --quick 5; overhead: 40, --quick 5)")
    g.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the figures and the environment (torch, device, dtype, "
                   "threads, python, platform, ftrain version, arguments) as JSON to PATH")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it goes to stderr; TQDM_DISABLE=1 hides it too)")


def _add_plot(g: Any, what: str) -> None:
    g.add_argument("--plot", type=Path, default=None, metavar="PATH.png",
                   help=f"draw {what} to PATH.png (needs matplotlib: pip install 'ftrain[bench]')")


def _add_timing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("device and timing")
    g.add_argument("--device", default="auto", metavar="DEV",
                   help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N (default: auto). "
                   "On CUDA the device is synchronised around each timed step and the allocator "
                   "peak is reported; on CPU the peak column is '-'")
    g.add_argument("--warmup", type=_nonneg_int, default=None, metavar="N",
                   help="untimed steps per variant before measuring (default: 2, --quick 1)")
    g.add_argument("--max-seconds", type=_positive_float, default=None, metavar="S",
                   help="time limit per variant: a variant that would exceed it (e.g. float16 "
                   "convolutions on a CPU) runs fewer steps and its time is marked '*' "
                   "(default: 60, --quick 10)")


def _add_models(p: argparse.ArgumentParser) -> None:
    from ftrain.bench.models import MODELS

    g = p.add_argument_group(
        "models",
        "sizes default per model (transformer: batch 8, d-model 128, 6 layers, 128 tokens; "
        "convnet: batch 8, width 32, 6 blocks, 64x64 images; mlp: batch 256, width 512, "
        "6 layers), smaller with --quick; a size option applies to every model listed")
    g.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS), metavar="NAME",
                   help=f"models to run, several allowed: {', '.join(MODELS)} (default: all)")
    g.add_argument("--batch-size", type=_positive_int, metavar="B", help="samples per step")
    g.add_argument("--width", "--d-model", dest="width", type=_positive_int, metavar="W",
                   help="transformer d_model, convnet base channels, MLP width")
    g.add_argument("--layers", type=_positive_int, metavar="L",
                   help="blocks (transformer / res / MLP)")
    g.add_argument("--seq-len", type=_positive_int, metavar="T", help="transformer tokens")
    g.add_argument("--image-size", type=_positive_int, metavar="S",
                   help="convnet image height and width")
    g.add_argument("--heads", type=_positive_int, metavar="H",
                   help="transformer attention heads; must divide --d-model (default: 4)")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ftrain.bench`` argument parser (subcommands amp, memory, overhead).

    Example:
        >>> build_parser().parse_args(["amp", "--precisions", "fp32", "bf16"]).precisions
        ['fp32', 'bf16']
    """
    from ftrain.bench.amp import PRECISIONS

    parser = argparse.ArgumentParser(
        prog="python -m ftrain.bench", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    amp = sub.add_parser(
        "amp", help="fp32 vs bf16 vs fp16 (dynamic loss scaling): time, throughput, memory, loss",
        description="Mixed precision: for each model and precision, train --steps steps "
        "(AdamW) on a learnable synthetic task and evaluate a held-out loss in float32 "
        "before (loss@0) and after (loss@N); measure the activation bytes of one step "
        "(and the CUDA peak), then time the precisions interleaved on a fixed batch.")
    _add_models(amp)
    g = amp.add_argument_group("amp")
    g.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                   metavar="P", help=f"precisions, the first is the reference: "
                   f"{', '.join(PRECISIONS)} (default: all; fp16 uses dynamic loss scaling)")
    g.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="training steps before the loss is evaluated (they warm up too; "
                   "default: 30, --quick 8)")
    _add_plot(g, "step time per precision (median, p25-p75), a panel per model")
    _add_timing(amp)
    _add_common(amp)

    mem = sub.add_parser(
        "memory", help="activation-checkpoint plans, conv-bn eval, gradient accumulation",
        description="Activation memory and step time: checkpoint plans (none, every block, "
        "every other block, selective, dynamic at budget fractions of none's bytes), "
        "efficient conv-bn eval off/on with frozen BatchNorms (models with BatchNorm), and "
        "gradient accumulation at equal effective batch (B vs B/2 x accum 2 ...). "
        "Activation bytes: the bytes saved for backward (ftrain.memory accounting).")
    _add_models(mem)
    g = mem.add_argument_group("memory")
    g.add_argument("--budgets", nargs="+", type=_fraction, default=[0.5, 0.25], metavar="F",
                   help="dynamic-plan budgets as fractions in (0, 1] of the activation bytes "
                   "without checkpointing (default: 0.5 0.25)")
    g.add_argument("--accum", nargs="+", type=_positive_int, default=[2, 4], metavar="K",
                   help="accumulation factors compared with the full batch: batch B/K x accum K "
                   "(default: 2 4; the batch size must be divisible by each)")
    g.add_argument("--dynamic-warmup", type=_positive_int, default=3, metavar="N",
                   help="warm-up forwards of the dynamic plans (default: 3)")
    g.add_argument("--no-conv-bn", action="store_true", help="leave out the conv-bn eval variants")
    _add_plot(g, "activation memory vs step time per plan")
    _add_timing(mem)
    _add_common(mem)

    ovh = sub.add_parser(
        "overhead", help="ftrain's per-step overhead vs a plain PyTorch loop (CPU)",
        description="Per-step overhead of ftrain.make_step and a composed step (bf16 amp, "
        "accumulation, clipping) against equivalent plain PyTorch loops, timed on the CPU "
        "in interleaved chunks. Runs the repository's benchmarks/overhead.py (a source "
        "checkout is needed).")
    g = ovh.add_argument_group("overhead")
    g.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help="the script's workloads (default: all of them, i.e. tiny and mlp)")
    g.add_argument("--import-repeats", type=_nonneg_int, default=None, metavar="N",
                   help="also time `import ftrain` in N fresh processes (default: 5, --quick 0)")
    _add_plot(g, "microseconds per step per variant (median, p25-p75), a panel per workload")
    _add_common(ovh)

    ck = sub.add_parser(
        "checkpoint",
        help="training-thread blocked time of a background save vs a synchronous torch.save",
        description="Saves a state of --size-mb MiB (CPU tensors) with torch.save and with "
        "ftrain's background Checkpointer, interleaved: the time the training thread is "
        "blocked per save (ftrain: the copy to host memory) and when the write completed.")
    g = ck.add_argument_group("checkpoint")
    g.add_argument("--size-mb", type=_positive_float, default=None, metavar="MIB",
                   help="state size in MiB (default: 1024, --quick 16)")
    g.add_argument("--dir", type=Path, default=None, metavar="PATH",
                   help="where to write (default: the system's temporary directory)")
    _add_common(ck)

    cmp = sub.add_parser(
        "compile",
        help="the whole step compiled (with_compile) vs eager and vs torch.compile(model)",
        description="Step time of five variants on each model, timed interleaved: a plain "
        "PyTorch loop, the same loop over torch.compile(model), that loop with the clipping "
        "and AdamW step compiled too (compile(model)+update), ftrain eager, and ftrain's "
        "whole step compiled (ftrain.with_compile: forward, backward, clipping and the AdamW "
        "update). AdamW + gradient clipping by norm, float32, a fixed batch. Also the cold "
        "compile (first step, caches empty) of compile(model)+update and ftrain compiled, "
        "and the share of matrix products and attention in an eager step (the bound on "
        "compile's gain).")
    _add_models(cmp)
    cmp.set_defaults(model=None)  # transformer and mlp; --quick: the mlp (compiles fastest)
    g = cmp.add_argument_group("compile")
    g.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="training steps per timed unit (default: 3, --quick 1)")
    g.add_argument("--backend", default="inductor", metavar="NAME",
                   help="torch.compile backend of both compiled variants (default: inductor; "
                   "aot_eager or eager to check the plumbing quickly)")
    g.add_argument("--mode", default=None, metavar="MODE",
                   help="torch.compile mode (default: none; e.g. reduce-overhead with CUDA graphs)")
    g.add_argument("--profile", action="store_true",
                   help="print the torch.profiler top operators of plain eager and ftrain "
                   "compiled on the first model (done anyway when a full run misses the target)")
    g.add_argument("--cold-pairs", type=_nonneg_int, default=None, metavar="N",
                   help="cold compiles of compile(model)+update and ftrain compiled measured "
                   "again, alternating, after the timed run (default: 1, --quick 0)")
    _add_timing(cmp)
    _add_common(cmp)
    parser.commands = {  # type: ignore[attr-defined]
        "amp": amp, "memory": mem, "overhead": ovh, "checkpoint": ck, "compile": cmp}
    return parser
# fmt: on


# ---------------------------------------------------------------------- run
def _specs(args: argparse.Namespace) -> list[Any]:
    from ftrain.bench.models import default_spec

    sizes = ("batch_size", "width", "layers", "seq_len", "image_size", "heads")
    kw = {k: getattr(args, k) for k in sizes}
    kinds = args.model or (["mlp"] if args.quick else ["transformer", "mlp"])  # compile
    return [default_spec(kind, quick=args.quick, **kw) for kind in dict.fromkeys(kinds)]


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


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ftrain.bench.env import BenchError, environment, resolve_device
    from ftrain.bench.report import progress_bar

    d = _DEFAULTS["quick" if args.quick else "full"]
    torch.set_num_threads(args.threads)
    cmd, device, specs = args.command, torch.device("cpu"), []
    if cmd not in ("checkpoint", "overhead"):
        try:
            device, specs = resolve_device(args.device), _specs(args)
        except (BenchError, ValueError) as exc:
            parser.error(str(exc))
    for spec in specs if cmd == "memory" else []:
        bad = [k for k in args.accum if spec.batch_size % k]
        if bad:
            parser.error(
                f"--accum {' '.join(map(str, bad))}: the {spec.kind} batch size "
                f"{spec.batch_size} is not divisible by it; pick a --batch-size divisible "
                f"by {' and '.join(map(str, args.accum))}"
            )
    warmup = d["warmup"] if getattr(args, "warmup", None) is None else args.warmup
    repeats = args.repeats or {"checkpoint": 3, "overhead": d["overhead_repeats"]}.get(
        cmd, d["repeats"]
    )
    max_seconds = getattr(args, "max_seconds", None) or d["max_seconds"]
    extra = f"warm-up {warmup}, {repeats} timed repeats per variant, interleaved"
    notes: list[str] = []
    bar = progress_bar(0, cmd, enabled=not args.no_progress and cmd != "checkpoint")
    start = time.perf_counter()
    if cmd == "checkpoint":
        from ftrain.bench.checkpoint import checkpoint_table, run_checkpoint

        size = args.size_mb or (16.0 if args.quick else 1024.0)
        out = run_checkpoint(size, repeats, None if args.dir is None else str(args.dir))
        extra = f"{repeats} interleaved repeats per variant"
        table = checkpoint_table(out) + (
            "\nblocked: time save() held the training thread (first: the first save, which "
            "also allocates the host buffers later saves reuse); completed: until the file "
            "and the manifest were on disk (fsync)"
        )
        config: dict[str, Any] = {"size_mb": size, "repeats": repeats}
    elif cmd == "overhead":
        from ftrain.bench.overhead import overhead_table, run_overhead

        imports = (0 if args.quick else 5) if args.import_repeats is None else args.import_repeats
        chunk = d["overhead_chunk"]
        with bar:
            out = run_overhead(args.workloads, repeats=repeats, import_repeats=imports,
                               progress=bar, chunk_steps=chunk)  # fmt: skip
        extra = f"{repeats} interleaved repeats per variant" + (
            f", {chunk} steps per chunk (--quick: a rough look; the full run's 1000-step "
            "chunks hold every rare cost)" if chunk else "")  # fmt: skip
        table = overhead_table(out["results"])
        config = {"repeats": repeats, "import_repeats": imports, "chunk_steps": chunk}
        notes = [f"{name}: {desc}" for name, desc in out["descriptions"].items()]
        if out["import_s"] is not None:
            imp = out["import_s"]
            notes.append(
                f"import: torch {imp['torch']:.3f} s, torch+ftrain {imp['torch+ftrain']:.3f} s, "
                f"ftrain adds {imp['added']:+.3f} s; -X importtime: {imp['importtime']:.3f} s"
            )
        notes.append(
            "us/step: median microseconds per training step (p25-p75 over repeats); ratio "
            "and added us: medians of the per-repeat paired ratio / difference vs 'vs'."
        )
    elif cmd == "compile":
        if device.type != "cpu":
            print(f"note: compile runs on the CPU; --device {args.device} is ignored")
            device = torch.device("cpu")
        from ftrain.bench.compile import quick_specs, run_cli

        specs = quick_specs(args, specs)
        out, table, config, notes = run_cli(args, specs, repeats, warmup, max_seconds, bar)
    elif cmd == "amp":
        from ftrain.bench.amp import AmpConfig, amp_table, run_amp

        steps = args.steps or d["steps"]
        cfg = AmpConfig(specs, device, args.precisions, steps, warmup, repeats, max_seconds)
        with bar:
            out = run_amp(cfg, progress=bar)
        table = amp_table(out["results"], steps, cuda=device.type == "cuda")
        config = {"steps": steps, "warmup": warmup, "repeats": repeats,
                  "max_seconds": max_seconds, "precisions": list(args.precisions)}  # fmt: skip
        notes = [
            f"step ms: median time of one training step (p25-p75 over {repeats} interleaved "
            f"repeats); samples/s: batch size / median; vs {args.precisions[0]}: step time "
            f"in words (N.NNx slower / faster than {args.precisions[0]}), then the "
            "activation bytes' ratio",
            "act MiB: bytes saved for backward in one step (ftrain.memory accounting); "
            "peak MiB: CUDA allocator peak of one step above what was allocated before it",
            f"loss@0 / loss@{steps}: held-out loss (float32) before / after {steps} AdamW "
            "steps; skipped: updates skipped by the fp16 loss scaler",
        ]
    else:
        from ftrain.bench.memory import MemoryConfig, memory_table, run_memory

        budgets, accum = tuple(dict.fromkeys(args.budgets)), tuple(dict.fromkeys((1, *args.accum)))
        cfg = MemoryConfig(specs, device, budgets, accum, warmup, repeats, args.dynamic_warmup,
                           not args.no_conv_bn, max_seconds)  # fmt: skip
        with bar:
            out = run_memory(cfg, progress=bar)
        table = memory_table(out["results"], cuda=device.type == "cuda")
        config = {"budgets": list(cfg.budgets), "accum": list(cfg.accum), "warmup": warmup,
                  "repeats": repeats, "dynamic_warmup": args.dynamic_warmup,
                  "max_seconds": max_seconds}  # fmt: skip
        notes = [
            "ckpt: modules checkpointed; act MiB: bytes saved for backward in one (micro-)step "
            "(ftrain.memory accounting); vs ref: ratio to the first row of the block (step "
            "time: N.NNx slower / faster)",
            "budget MiB: a dynamic plan's budget (unreachable: over it, or the planner "
            "warned it cannot meet it)",
            f"step ms: median time of one optimizer update over the effective batch (p25-p75 "
            f"over {repeats} interleaved repeats; with accum K, K micro-steps); "
            "us/sample: median / effective batch",
            "peak MiB: CUDA allocator peak of one update above what was allocated before it",
        ]
    elapsed = time.perf_counter() - start
    env = environment(device, _jsonable(args))
    print(_header(env, extra))
    for spec in specs:
        print(f"  {spec.describe()}")
    print()
    print(table)
    print()
    if out.get("targets"):
        notes.append("targets:\n" + "\n".join("  " + t for t in out["targets"]))
    for name, prof in out.get("profile", {}).items():
        notes.append(f"profile, {name} ({specs[0].kind}), top ops by self CPU time:\n{prof}")
    if any(r.get("capped") for r in out["results"]):
        notes.append(
            f"*: over the --max-seconds {max_seconds:g} limit: fewer steps (loss@N shows "
            "@steps when training was cut short)"
        )
    for n in notes:
        print(n)
    print(f"({elapsed:.1f} s)")
    return {
        "benchmark": cmd,
        "environment": env,
        "config": config,
        "models": [s.as_dict() for s in specs],
        "seconds": elapsed,
        **out,
    }


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

        path = write_json(args.json, result)
        print(f"wrote {path}")
    if getattr(args, "plot", None) is not None:
        title = _header(result["environment"], "").rstrip("; ")
        module = importlib.import_module(f"ftrain.bench.{args.command}")
        getattr(module, f"plot_{args.command}")(result["results"], str(args.plot), title=title)
        print(f"wrote {args.plot}")
    sys.stdout.flush()
    return 0
