"""The argument parser of ``python -m ftrain.bench``: one function per command's options.

Example:
    >>> argv = ["memory", "--quick", "--budgets", "0.5", "--model", "mlp"]
    >>> args = build_parser().parse_args(argv)
    >>> args.command, args.budgets, args.model
    ('memory', [0.5], ['mlp'])
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_parser", "COMMANDS"]

AddParser = Callable[..., argparse.ArgumentParser]  # the subparsers' add_parser

_DESCRIPTION = """\
Benchmarks of ftrain on built-in models (a small transformer, a small conv net, an MLP)
and against a hand-written PyTorch loop and the peers (Lightning, MMEngine, accelerate).
Variants are timed alternately in one process (round-robin, rotating who goes first);
tables give the median and the 25th-75th percentile; a target is judged OK or MISSED only
when the whole interval of the paired ratio or difference is on one side of it, else
"inconclusive". Every command prints its wall time. See `python -m ftrain.bench <command> --help`.
"""

_EPILOG = """\
examples:
  python -m ftrain.bench amp --quick --plot amp.png
  python -m ftrain.bench memory --model transformer --d-model 256 --layers 8 --json mem.json
  python -m ftrain.bench overhead --quick --plot overhead.png
  python -m ftrain.bench checkpoint --size-mb 1024
  python -m ftrain.bench compile --quick
  python -m ftrain.bench e2e --quick
  python -m ftrain.bench peers --quick
"""


# ------------------------------------------------------------------ arg types
def _number(kind: type, minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a ``kind`` (int or float) >= ``minimum`` (or > when not inclusive)."""
    word = "a whole number" if kind is int else "a number"
    sign = ">=" if inclusive else ">"

    def parse(text: str) -> float:
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


# -------------------------------------------------------------------- groups
# fmt: off
def _add_common(p: argparse.ArgumentParser, repeats: str) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--quick", action="store_true",
                   help="smaller or fewer: the whole command in under a minute on an idle "
                   "2-core machine (CI runs it); targets defined at full size are reported "
                   "'not judged'; explicit options still win")
    g.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                   help="torch CPU threads (torch.set_num_threads; default: 1, for reproducible "
                   "CPU timings that do not depend on the machine's core count or load)")
    g.add_argument("--repeats", type=_positive_int, default=None, metavar="N",
                   help=f"timed repeats (paired rounds) per variant ({repeats}); a verdict "
                   "needs at least 5")
    g.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the figures and the environment (torch, device, dtype, "
                   "threads, python, platform, ftrain version, arguments) as JSON to PATH")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal; "
                   "TQDM_DISABLE=1 hides it too)")


def _plot(what: str) -> dict[str, object]:
    """The ``--plot`` option's keywords."""
    return {"type": Path, "default": None, "metavar": "PATH.png",
            "help": f"draw {what} to PATH.png (needs matplotlib: pip install 'ftrain[bench]')"}


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
    g.add_argument("--model", nargs="+", choices=MODELS, default=None, metavar="NAME",
                   help=f"models to run, several allowed: {', '.join(MODELS)} (default: all; "
                   "compile: transformer mlp, --quick mlp)")
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


# ------------------------------------------------------------------ commands
def _amp(add: AddParser) -> argparse.ArgumentParser:
    from ftrain.bench.amp import PRECISIONS

    p = add(
        "amp", help="fp32 vs bf16 vs fp16 (dynamic loss scaling): time, throughput, memory, loss",
        description="Mixed precision: for each model and precision, train --steps steps "
        "(AdamW) on a learnable synthetic task and evaluate a held-out loss in float32 "
        "before (loss@0) and after (loss@N); measure the activation bytes of one step "
        "(and the CUDA peak), then time the precisions interleaved on a fixed batch.")
    _add_models(p)
    g = p.add_argument_group("amp")
    g.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                   metavar="P", help=f"precisions, the first is the reference: "
                   f"{', '.join(PRECISIONS)} (default: all; fp16 uses dynamic loss scaling)")
    g.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="training steps before the loss is evaluated (they warm up too; "
                   "default: 30, --quick 8)")
    g.add_argument("--plot", **_plot("step time per precision (median, p25-p75) per model"))
    _add_timing(p)
    _add_common(p, "default: 10, --quick 5")
    return p


def _memory(add: AddParser) -> argparse.ArgumentParser:
    p = add(
        "memory", help="activation-checkpoint plans, conv-bn eval, gradient accumulation",
        description="Activation memory and step time: checkpoint plans (none, every block, "
        "every other block, selective, dynamic at budget fractions of none's bytes), "
        "efficient conv-bn eval off/on with frozen BatchNorms (models with BatchNorm), and "
        "gradient accumulation at equal effective batch (B vs B/2 x accum 2 ...). "
        "Activation bytes: the bytes saved for backward (ftrain.memory accounting).")
    _add_models(p)
    g = p.add_argument_group("memory")
    g.add_argument("--budgets", nargs="+", type=_fraction, default=[0.5, 0.25], metavar="F",
                   help="dynamic-plan budgets as fractions in (0, 1] of the activation bytes "
                   "without checkpointing (default: 0.5 0.25)")
    g.add_argument("--accum", nargs="+", type=_positive_int, default=[2, 4], metavar="K",
                   help="accumulation factors compared with the full batch: batch B/K x accum K "
                   "(default: 2 4; the batch size must be divisible by each)")
    g.add_argument("--dynamic-warmup", type=_positive_int, default=3, metavar="N",
                   help="warm-up forwards of the dynamic plans (default: 3)")
    g.add_argument("--no-conv-bn", action="store_true", help="leave out the conv-bn eval variants")
    g.add_argument("--plot", **_plot("activation memory vs step time per plan"))
    _add_timing(p)
    _add_common(p, "default: 10, --quick 5")
    return p


def _overhead(add: AddParser) -> argparse.ArgumentParser:
    p = add(
        "overhead", help="ftrain's per-step overhead vs a plain PyTorch loop (CPU)",
        description="Per-step overhead of ftrain.make_step, a composed step (bf16 amp, "
        "accumulation, clipping) and the loop with its default hooks against equivalent "
        "plain PyTorch loops, timed on the CPU in interleaved chunks. Runs the repository's "
        "benchmarks/overhead.py (a source checkout is needed).")
    g = p.add_argument_group("overhead")
    g.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help="the script's workloads (default: all of them, i.e. tiny and mlp)")
    g.add_argument("--import-repeats", type=_nonneg_int, default=None, metavar="N",
                   help="also time `import ftrain` in N fresh processes (default: 5, --quick 0)")
    g.add_argument("--plot", **_plot("us per step per variant (median, p25-p75) per workload"))
    _add_common(p, "default: 40, --quick 5 of 200-step chunks")
    return p


def _checkpoint(add: AddParser) -> argparse.ArgumentParser:
    p = add(
        "checkpoint",
        help="training-thread blocked time of a background save vs a synchronous torch.save",
        description="Saves a state of --size-mb MiB (CPU tensors) with torch.save and with "
        "ftrain's background Checkpointer, alternating: the time the training thread is "
        "blocked per save (ftrain: the copy to host memory) and when the write completed. "
        "Target: blocked time at most 0.25x torch.save's, at the full size.")
    g = p.add_argument_group("checkpoint")
    g.add_argument("--size-mb", type=_positive_float, default=None, metavar="MIB",
                   help="state size in MiB (default: 1024, --quick 16)")
    g.add_argument("--dir", type=Path, default=None, metavar="PATH",
                   help="where to write (default: the system's temporary directory)")
    _add_common(p, "default: 5")
    return p


def _compile(add: AddParser) -> argparse.ArgumentParser:
    p = add(
        "compile",
        help="the whole step compiled (with_compile) vs eager and vs torch.compile(model)",
        description="Step time of five variants on each model, timed interleaved: a plain "
        "PyTorch loop, the same loop over torch.compile(model), that loop with the clipping "
        "and AdamW step compiled too (compile(model)+update), ftrain eager, and ftrain's "
        "whole step compiled (ftrain.with_compile: forward, backward, clipping and the AdamW "
        "update). AdamW + gradient clipping by norm, float32, a fixed batch. Also the cold "
        "compile (first step, caches empty) of compile(model)+update and ftrain compiled, "
        "and the share of matrix products and attention in an eager step (the bound on "
        "compile's gain). --quick: the MLP alone.")
    _add_models(p)
    g = p.add_argument_group("compile")
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
    _add_timing(p)
    _add_common(p, "default: 10, --quick 5")
    return p


def _e2e(add: AddParser) -> argparse.ArgumentParser:
    p = add(
        "e2e", help="the full stack (Loop + hooks + every transform) vs a hand-written loop",
        description="A small transformer LM trained by ftrain's full stack (Loop, default "
        "hooks, bf16 autocast, accumulation, clipping, warmup + cosine, EMA, periodic "
        "evaluation, background checkpoint, logging) and by a hand-written PyTorch loop with "
        "the same features, alternating in chunks in one process, same data and seed. "
        "Reports the tokens/s ratio with its paired interval (target >= 0.98x) and checks "
        "that both reach the same loss.")
    g = p.add_argument_group("e2e")
    g.add_argument("--updates", type=_positive_int, default=10, metavar="N",
                   help="optimizer updates per timed chunk (default: 10; the log, evaluation "
                   "and checkpoint intervals are 5, 5 and 10 updates)")
    g.add_argument("--blocks", type=_positive_int, default=None, metavar="N",
                   help="fresh pairs of runs the rounds are spread over, built in alternating "
                   "order (default: 3, --quick 2)")
    g.add_argument("--profile", action="store_true",
                   help="also cProfile one chunk of each side: the top functions and the share "
                   "of time spent in ftrain's own code")
    g.add_argument("--dir", type=Path, default=None, metavar="PATH",
                   help="where the runs write (default: the system's temporary directory)")
    _add_common(p, "default: 30, --quick 8, spread over the --blocks")
    return p


def _peers(add: AddParser) -> argparse.ArgumentParser:
    p = add(
        "peers", help="loop overhead and checkpoint blocking vs Lightning, MMEngine, accelerate",
        description="The same tiny model trained by a plain loop, ftrain (Loop + default "
        "hooks), Lightning's Trainer, MMEngine's Runner and an accelerate loop, alternating "
        "in rounds: microseconds per step added to the plain loop. Then the time a "
        "background save blocks training, as a share of torch.save's, for ftrain, Lightning's "
        "AsyncCheckpointIO and torch.distributed.checkpoint.async_save. A peer that is not "
        "installed is skipped with a note.")
    g = p.add_argument_group("peers")
    g.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="timed steps per run (default: 900, --quick 300: no periodic checkpoint "
                   "of ftrain's defaults, every 1000 updates, falls in the window)")
    g.add_argument("--size-mb", type=_positive_float, default=None, metavar="MIB",
                   help="checkpointed state size in MiB (default: 256, --quick 16)")
    g.add_argument("--dir", type=Path, default=None, metavar="PATH",
                   help="where to write (default: the system's temporary directory)")
    _add_common(p, "default: 9, --quick 5")
    return p
# fmt: on


#: The commands, in the order ``--help`` lists them.
COMMANDS = {
    "amp": _amp, "memory": _memory, "overhead": _overhead, "checkpoint": _checkpoint,
    "compile": _compile, "e2e": _e2e, "peers": _peers,
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ftrain.bench`` argument parser; ``parser.commands`` maps each command
    to its subparser.

    Example:
        >>> build_parser().parse_args(["amp", "--precisions", "fp32", "bf16"]).precisions
        ['fp32', 'bf16']
    """
    parser = argparse.ArgumentParser(
        prog="python -m ftrain.bench", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = {name: make(sub.add_parser) for name, make in COMMANDS.items()}
    parser.commands = commands  # type: ignore[attr-defined]
    return parser
