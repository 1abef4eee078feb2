"""``python -m ftrain.demo``: train a tiny character-level transformer, no download.

The model (:class:`~ftrain.demo.model.CharTransformer`) learns the text that
ships with the package (``corpus.txt``: standard-library documentation) with
one ftrain step composing gradient accumulation, norm clipping and mixed
precision. At start-up it times a few bf16 and fp32 steps on the device and
keeps the faster (``--amp`` overrides). It prints the loss as it falls and a
sample of generated text at the end; the default run takes about a minute on
two CPU cores.

Structure: :func:`main` parses arguments and calls :func:`train`, whose
training loop is a plain ``for`` loop over the ftrain step.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import attrs
import torch

import ftrain
from ftrain.demo.model import CharDataset, CharTransformer, lm_loss, make_dataset
from ftrain.optim import param_groups

__all__ = ["main", "train", "parse_args", "build_step", "choose_amp", "lr_at", "TrainResult"]

AMP_CHOICES = ("auto", "bf16", "fp16", "off")
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@attrs.frozen
class TrainResult:
    """What :func:`train` returns (handy in tests and notebooks).

    Attributes:
        state: the final :class:`ftrain.TrainState`.
        dataset: the dataset trained on.
        amp: the precision used (``"bf16"``, ``"fp16"`` or ``"off"``).
        history: one ``(update, mean loss over the interval)`` per progress line.
        val_loss: mean validation loss at the end.
        sample: the generated text.
        seconds: wall time of the training loop.
    """

    state: ftrain.TrainState
    dataset: CharDataset
    amp: str
    history: list[tuple[int, float]]
    val_loss: float
    sample: str
    seconds: float


# ------------------------------------------------------------------ arguments
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's command line."""
    p = argparse.ArgumentParser(
        prog="python -m ftrain.demo",
        description="Train a tiny character-level transformer on text shipped with ftrain.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=350, help="optimizer updates")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer update")
    p.add_argument("--amp", choices=AMP_CHOICES, default="auto", help="mixed precision")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda:0'")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: the CPUs we may use)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up updates")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--context", type=int, default=64, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--log-every", type=int, default=0, help="updates per line (0: ~12 lines)")
    p.add_argument("--sample-chars", type=int, default=240, help="length of the final sample")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "accum", "context", "d_model", "layers", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------- setup
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _set_threads(requested: int, device: torch.device) -> int:
    """Use the CPUs this process may run on (cgroup/affinity aware) unless told."""
    if requested > 0:
        torch.set_num_threads(requested)
    elif device.type == "cpu":
        try:
            available = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            available = os.cpu_count() or 1
        torch.set_num_threads(max(1, available))
    return torch.get_num_threads()


def _nice_interval(steps: int, lines: int = 10) -> int:
    """A round number of updates between progress lines (about ``lines`` of them)."""
    target = max(1, steps // lines)
    nice = [m * 10**e for e in range(7) for m in (1, 2, 5, 10, 25)]
    return max(n for n in nice if n <= target)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> CharTransformer:
    return CharTransformer(
        vocab_size,
        context=args.context,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
    ).to(device)


def _make_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms, biases and position embeddings."""
    with warnings.catch_warnings():  # the output layer is tied to the embedding
        warnings.filterwarnings("ignore", "parameter 'head.weight' is the same tensor")
        groups = param_groups(
            model,
            lr=args.lr,
            weight_decay=args.weight_decay,
            norm_decay_mult=0.0,
            bias_decay_mult=0.0,
            custom_keys={"pos.": {"decay_mult": 0.0}},
            bypass_duplicate=True,
        )
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # what the schedule multiplies
    return optimizer


def build_step(amp: str, *, accum: int, clip: float) -> ftrain.Step:
    """The demo's step: the loss, with accumulation, norm clipping and AMP composed."""
    step = ftrain.make_step(lm_loss)
    step = ftrain.with_grad_accum(step, every=accum)
    step = ftrain.with_clip(step, "norm", max_norm=clip)
    if amp != "off":
        step = ftrain.with_amp(step, dtype=_AMP_DTYPES[amp])
    return step


def lr_at(update: int, *, warmup: int, total: int) -> float:
    """Learning-rate factor for optimizer update ``update`` (a pure function of it).

    Linear warm-up over ``warmup`` updates, then a cosine decay to 0.1 at ``total``.
    """
    if update < warmup:
        return (update + 1) / warmup
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def _amp_candidates(device: torch.device) -> list[str]:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["off", "fp16"]
    return ["off", "bf16"]


def measure_amp(
    args: argparse.Namespace,
    data: CharDataset,
    device: torch.device,
    candidates: Sequence[str],
    *,
    rounds: int = 3,
    steps_per_round: int = 2,
) -> dict[str, float]:
    """Seconds per micro-step of the demo's composed step, for each precision.

    Runs a throw-away model (the training model is built afterwards, from the
    seed), warms each precision up, then alternates them round by round so
    load changes on a shared machine hit both alike. Returns the median.
    """
    g = torch.Generator().manual_seed(args.seed + 1)
    batch = data.sample(args.batch_size, generator=g, device=device)
    runners: dict[str, tuple[ftrain.Step, list[ftrain.TrainState]]] = {}
    for amp in candidates:
        model = _make_model(args, data.vocab_size, device)
        state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        runners[amp] = (build_step(amp, accum=args.accum, clip=args.clip), [state])
    times: dict[str, list[float]] = {amp: [] for amp in candidates}

    def run(amp: str, n: int) -> float:
        step, holder = runners[amp]
        state = holder[0]
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            state, _metrics = step(state, batch)
        _sync(device)
        holder[0] = state
        return (time.perf_counter() - t0) / n

    for amp in candidates:  # warm-up: first calls allocate, pick kernels
        run(amp, 2)
    for r in range(rounds):
        order = list(candidates) if r % 2 == 0 else list(reversed(candidates))
        for amp in order:
            times[amp].append(run(amp, steps_per_round))
    return {amp: statistics.median(ts) for amp, ts in times.items()}


def choose_amp(
    args: argparse.Namespace,
    data: CharDataset,
    device: torch.device,
    echo: Callable[[str], None] = print,
) -> str:
    """The precision to train in: ``args.amp``, or the faster one measured."""
    if args.amp != "auto":
        echo(f"amp: {args.amp} (from --amp)")
        return args.amp
    candidates = _amp_candidates(device)
    t0 = time.perf_counter()
    seconds = measure_amp(args, data, device, candidates)
    best = min(seconds, key=seconds.__getitem__)
    names = {"off": "fp32"}
    timings = ", ".join(f"{names.get(a, a)} {s * 1e3:.1f} ms" for a, s in seconds.items())
    echo(
        f"amp: measured one micro-step: {timings} ({time.perf_counter() - t0:.1f}s to measure)"
        f" -> {'fp32 (amp off)' if best == 'off' else best}; --amp overrides"
    )
    return best


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: CharDataset, args: argparse.Namespace, device: torch.device
) -> float:
    """Mean loss on ``args.eval_batches`` fixed validation batches."""
    if args.eval_batches < 1:
        return math.nan
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = [
        lm_loss(model, data.sample(args.batch_size, generator=g, split="val", device=device))
        for _ in range(args.eval_batches)
    ]
    model.train(was_training)
    return torch.stack(losses).mean().item()


# ---------------------------------------------------------------------- train
def train(args: argparse.Namespace, echo: Callable[[str], None] = print) -> TrainResult:
    """Train the demo model as ``args`` says; print progress with ``echo``."""
    device = _device(args.device)
    threads = _set_threads(args.threads, device)
    data = make_dataset(context=args.context)
    echo(
        f"ftrain demo: a character-level transformer learns the shipped corpus "
        f"({len(data.train) + len(data.val):,} characters, vocabulary {data.vocab_size}); "
        f"device {device}"
        + (f", {threads} thread{'s' if threads != 1 else ''}" if device.type == "cpu" else "")
    )
    amp = choose_amp(args, data, device, echo)

    torch.manual_seed(args.seed)
    model = _make_model(args, data.vocab_size, device)
    state = ftrain.TrainState.create(model, _make_optimizer(args, model))
    step = build_step(amp, accum=args.accum, clip=args.clip)
    n_params = sum(p.numel() for p in model.parameters())
    echo(
        f"model: {n_params / 1e6:.2f}M parameters (d_model {args.d_model}, {args.layers} "
        f"layers, {args.heads} heads, context {args.context}); {args.steps} updates of "
        f"{args.accum} x {args.batch_size} sequences"
    )
    echo("step:  " + repr(step).replace("\n  ", " "))

    log_every = args.log_every or _nice_interval(args.steps)
    header = f"{'update':>7} {'loss':>7} {'grad_norm':>9} {'lr':>9} {'samples/s':>9} {'time':>7}"
    echo(header)
    history: list[tuple[int, float]] = []
    losses: list[torch.Tensor] = []  # device tensors; read only when a line is printed
    norms: list[torch.Tensor] = []
    start = last = time.perf_counter()
    samples = 0
    batches = data.batches(args.batch_size, seed=args.seed, device=device)

    # The training loop: a plain loop over the ftrain step (one call = one micro-batch).
    for batch in batches:
        if state.step >= args.steps:
            break
        factor = lr_at(state.step, warmup=args.warmup, total=args.steps)
        for group in state.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        updates_before = state.step
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        if "grad_norm" in metrics:
            norms.append(metrics["grad_norm"])
        samples += args.batch_size
        if state.step != updates_before and (
            state.step % log_every == 0 or state.step == args.steps
        ):
            loss = torch.stack(losses).float().mean().item()  # the only host sync
            norm = torch.stack(norms).float().mean().item() if norms else math.nan
            now = time.perf_counter()
            echo(
                f"{state.step:>7} {loss:>7.3f} {norm:>9.3f} {args.lr * factor:>9.2e} "
                f"{samples / (now - last):>9.0f} {now - start:>6.1f}s"
            )
            history.append((state.step, loss))
            losses, norms, samples, last = [], [], 0, now
    state, _ = step.flush(state)  # a partial accumulation window, if any, is applied
    seconds = time.perf_counter() - start

    model = state.model
    val_loss = evaluate(model, data, args, device)
    train_loss = history[-1][1] if history else math.nan
    echo(
        f"done: {state.step} updates in {seconds:.1f}s; loss {train_loss:.3f} (last interval), "
        f"validation {val_loss:.3f} nats/char"
    )
    sample = ""
    if args.sample_chars > 0:
        prompt = "def "
        g = torch.Generator().manual_seed(args.seed)
        ids = model.generate(data.encode(prompt), args.sample_chars, top_k=20, generator=g)
        sample = data.decode(ids)
        echo("sample:\n" + "\n".join("  | " + line for line in sample.splitlines()))
    return TrainResult(
        state=state,
        dataset=data,
        amp=amp,
        history=history,
        val_loss=val_loss,
        sample=sample,
        seconds=seconds,
    )


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Entry point of ``python -m ftrain.demo``."""
    return train(parse_args(argv))
