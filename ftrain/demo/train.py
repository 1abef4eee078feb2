"""``python -m ftrain.demo``: train a tiny character-level transformer, no download.

The model (:class:`~ftrain.demo.model.CharTransformer`) learns the text that
ships with the package (``corpus.txt``: standard-library documentation) with
one ftrain step composing gradient accumulation, norm clipping, mixed
precision and (``--checkpoint-plan``) activation checkpointing. At start-up it
times a few bf16 and fp32 steps on the device and keeps the faster (``--amp``
overrides). The default run takes about a minute on two CPU cores.

It trains with :func:`ftrain.loop` and hooks, into a run directory
(``--run-dir``, default ``runs/demo``)::

    runs/demo/
      iter_300.pth iter_350.pth           periodic checkpoints (the newest 2)
      best_val_loss_iter_350.pth          the best validation loss so far
      interrupted.pth                     written on Ctrl-C / SIGTERM
      manifest.json                       what ftrain wrote (sizes, hashes)
      metrics.jsonl                       one JSON object per log line
      tb/                                 TensorBoard (tensorboard --logdir runs/demo/tb)

Run the same command again and it resumes from the newest checkpoint (the
model, optimizer, RNG, data-loader position and hook state: it ends bitwise
equal to a run that never stopped); a finished run says so and stops, or
trains on if ``--steps`` was raised. ``--fresh`` starts over.

Structure: :func:`main` parses arguments and calls :func:`train`, which
builds the step (:func:`build_step`), the data (:func:`make_loader`), the
hooks (:func:`build_hooks`) and runs :func:`ftrain.loop`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import ftrain
from ftrain import schedules
from ftrain.checkpoint import Manifest, find_resumable, load_checkpoint
from ftrain.demo.model import CharDataset, CharTransformer, lm_loss, make_dataset
from ftrain.events import Event
from ftrain.hooks.evaluation import EvalHook
from ftrain.hooks.schedule import ScheduleHook
from ftrain.loop import TerminatedError
from ftrain.optim import param_groups

__all__ = [
    "main",
    "train",
    "parse_args",
    "build_step",
    "build_hooks",
    "make_loader",
    "lr_schedule",
    "choose_amp",
    "TrainResult",
    "CharWindows",
    "make_checkpoint_plan",
    "make_evaluator",
    "ProgressTable",
    "RunConfig",
]

AMP_CHOICES = ("auto", "bf16", "fp16", "off")
CHECKPOINT_PLANS = ("none", "blocks", "dynamic")
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_AMP_RESOLVED = ("bf16", "fp16", "off")

# What defines a run: saved with every checkpoint; a resumed run takes these
# from its checkpoint, and an explicit different value on the command line is
# an error (the model would not load, or the resumed run would silently differ).
RUN_KEYS = (
    "context",
    "d_model",
    "layers",
    "heads",
    "batch_size",
    "accum",
    "lr",
    "warmup",
    "decay_steps",
    "weight_decay",
    "clip",
    "seed",
    "eval_batches",
)
# How it is executed: taken from the checkpoint unless given again; may change.
EXEC_KEYS = ("amp", "checkpoint_plan")


@attrs.frozen
class TrainResult:
    """What :func:`train` returns (handy in tests and notebooks).

    Attributes:
        state: the final :class:`ftrain.TrainState`.
        dataset: the dataset trained on.
        amp: the precision used (``"bf16"``, ``"fp16"`` or ``"off"``).
        history: one ``(update, mean loss over the interval)`` per progress line.
        val_loss: mean validation loss of the final model.
        sample: the generated text.
        seconds: wall time of the training loop (0 when nothing was trained).
        run_dir: the run directory.
        resumed_from: the checkpoint this run continued from, or ``None``.
        start_step: the optimizer update the run started (or resumed) at.
        trained: ``False`` when the run had already finished and nothing was trained.
    """

    state: ftrain.TrainState
    dataset: CharDataset
    amp: str
    history: list[tuple[int, float]]
    val_loss: float
    sample: str
    seconds: float
    run_dir: Path
    resumed_from: Path | None = None
    start_step: int = 0
    trained: bool = True


# ------------------------------------------------------------------ arguments
def _parser(with_defaults: bool = True) -> argparse.ArgumentParser:
    """The command line; ``with_defaults=False`` leaves out what was not given."""
    p = argparse.ArgumentParser(
        prog="python -m ftrain.demo",
        description=(
            "Train a tiny character-level transformer on text shipped with ftrain, into a run "
            "directory; run it again to resume."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=None if with_defaults else argparse.SUPPRESS,
    )

    def add(*flags: str, default: Any = None, **kw: Any) -> None:
        if with_defaults:
            kw["default"] = default
        p.add_argument(*flags, **kw)

    add("--steps", type=int, default=350, help="train until this many optimizer updates")
    add("--batch-size", type=int, default=32, help="sequences per micro-batch")
    add("--accum", type=int, default=2, help="micro-batches per optimizer update")
    add("--amp", choices=AMP_CHOICES, default="auto", help="mixed precision")
    add(
        "--checkpoint-plan",
        choices=CHECKPOINT_PLANS,
        default="none",
        help="activation checkpointing: none, every transformer block, or a dynamic plan "
        "under --activation-budget",
    )
    add(
        "--activation-budget",
        default="auto",
        help="budget of the dynamic plan, e.g. '16MiB' ('auto': half of what the model saves)",
    )
    add("--seed", type=int, default=0, help="seeds the model and the data order")
    add("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda:0'")
    add("--threads", type=int, default=0, help="CPU threads (0: the CPUs we may use)")
    add("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    add("--warmup", type=int, default=30, help="linear warm-up updates")
    add(
        "--decay-steps",
        type=int,
        default=350,
        help="updates of the cosine decay to 0.1 x lr; independent of --steps, so a run "
        "extended with a larger --steps continues the same curve",
    )
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on norms, biases)")
    add("--clip", type=float, default=1.0, help="max gradient norm")
    add("--context", type=int, default=64, help="characters per sequence")
    add("--d-model", type=int, default=128, help="width of the model")
    add("--layers", type=int, default=3, help="transformer blocks")
    add("--heads", type=int, default=4, help="attention heads per block")
    add("--log-every", type=int, default=0, help="updates per progress line (0: ~12 lines)")
    add("--eval-every", type=int, default=0, help="updates per validation (0: ~6 of them)")
    add("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    add("--checkpoint-every", type=int, default=0, help="updates per checkpoint (0: as eval)")
    add("--max-keep", type=int, default=2, help="periodic checkpoints kept")
    add("--sample-chars", type=int, default=240, help="length of the final sample")
    add(
        "--progress",
        choices=("auto", "bar", "lines"),
        default="auto",
        help="a progress bar (auto: in a terminal or Jupyter) or plain lines",
    )
    add("--run-dir", default="runs/demo", help="where checkpoints and logs go")
    add(
        "--resume",
        default="auto",
        metavar="auto|never|PATH",
        help="auto: continue from the newest checkpoint in --run-dir; never: start over; "
        "or a checkpoint file (or directory) to continue from",
    )
    add("--fresh", action="store_true", default=False, help="start over (= --resume never)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's command line; ``args.explicit`` holds the options actually given."""
    p = _parser()
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "accum", "context", "d_model", "layers", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup", "decay_steps", "max_keep"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fresh and args.resume not in ("auto", "never"):
        p.error("--fresh starts over; it cannot be combined with --resume PATH")
    args.explicit = frozenset(vars(_parser(with_defaults=False).parse_args(argv)))
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
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def lr_schedule(lr: float, *, warmup: int, decay_steps: int) -> schedules.Schedule:
    """The learning rate as a pure function of the update (:mod:`ftrain.schedules`).

    Cosine from ``lr`` down to ``0.1 * lr`` at ``decay_steps`` (then held), with a
    linear warm-up from ``0.1 * lr`` over the first ``warmup`` updates (MMCV's
    ``warmup='linear', warmup_ratio=0.1``).

    Example:
        >>> s = lr_schedule(1.0, warmup=10, decay_steps=100)
        >>> round(s(0), 4), round(s(10), 4), round(s(100), 4), round(s(500), 4)
        (0.1, 0.978, 0.1, 0.1)
    """
    return schedules.warmup(
        schedules.cosine(lr, total=decay_steps, final_ratio=0.1), iters=warmup, ratio=0.1
    )


def build_step(amp: str, *, accum: int, clip: float, checkpoint_plan: Any = None) -> ftrain.Step:
    """The demo's step: the loss, with accumulation, clipping, AMP and checkpointing composed.

    ``checkpoint_plan`` is an activation-checkpointing plan
    (:func:`ftrain.memory.pattern`, :func:`ftrain.memory.dynamic`) or ``None``.
    """
    step = ftrain.make_step(lm_loss)
    step = ftrain.with_grad_accum(step, every=accum)
    step = ftrain.with_clip(step, "norm", max_norm=clip)
    if amp != "off":
        step = ftrain.with_amp(step, dtype=_AMP_DTYPES[amp])
    if checkpoint_plan is not None:
        from ftrain.transforms.checkpoint import with_activation_checkpoint

        step = with_activation_checkpoint(step, checkpoint_plan)
    return step


def make_checkpoint_plan(
    args: argparse.Namespace, data: CharDataset, device: torch.device
) -> tuple[Any, str]:
    """The ``--checkpoint-plan`` as an ftrain plan (or ``None``) and a line describing it."""
    from ftrain.memory import dynamic, measure_activations, pattern

    if args.checkpoint_plan == "none":
        return None, "activation checkpointing: none (--checkpoint-plan blocks|dynamic)"
    blocks = pattern(under="blocks", level=1)
    if args.checkpoint_plan == "blocks":
        return blocks, f"activation checkpointing: every block ({args.layers} blocks.*)"
    # dynamic: checkpoint as few blocks as keep the bytes saved for backward under a budget
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = _make_model(args, data.vocab_size, device)
        x, y = data.sample(args.batch_size, generator=torch.Generator().manual_seed(0))
        report = measure_activations(
            model, lambda: lm_loss(model, (x.to(device), y.to(device))), backward=False, time=False
        )
    eager = report.total_bytes
    if args.activation_budget == "auto":
        budget, why = eager / 2, "half of"
    else:
        from ftrain.memory.plans import parse_bytes

        budget, why = parse_bytes(args.activation_budget), "vs"
    plan = dynamic(budget, candidates=blocks, warmup_iters=3, measure="saved")
    mib = 2**20
    return plan, (
        f"activation checkpointing: dynamic, budget {budget / mib:.1f} MiB ({why} the "
        f"{eager / mib:.1f} MiB a micro-batch saves for backward without it)"
    )


# ----------------------------------------------------------------------- data
class CharWindows(torch.utils.data.Dataset):
    """Every window of ``context + 1`` characters of a 1-D id tensor, as ``(x, y)``.

    Item ``i`` is the window starting at character ``i``; ``y`` is ``x``
    shifted by one. ``__getitems__`` gathers a whole batch with one indexing
    operation (the loader then passes it through unchanged).

    Example:
        >>> w = CharWindows(torch.arange(10), context=4)
        >>> len(w), w[2]
        (6, (tensor([2, 3, 4, 5]), tensor([3, 4, 5, 6])))
    """

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids = ids
        self.context = context
        self.offsets = torch.arange(context + 1, device=ids.device)

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i : i + self.context + 1]
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.tensor(indices, device=self.ids.device)
        windows = self.ids[starts[:, None] + self.offsets]
        return windows[:, :-1], windows[:, 1:]


def _batch_as_is(batch: Any) -> Any:
    return batch  # CharWindows.__getitems__ already returns a batch


def make_loader(
    data: CharDataset, batch_size: int, *, seed: int, device: torch.device | str = "cpu"
) -> Any:
    """Shuffled training batches from a resumable ``StatefulDataLoader``.

    Its position (and the shuffling generator's state) is saved with each
    checkpoint by :func:`ftrain.loop`, so a resumed run reads exactly the
    batches an uninterrupted one would have.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():  # torchdata calls the deprecated torch.set_vital
        warnings.filterwarnings("ignore", "'set_vital' is deprecated")
        return StatefulDataLoader(
            CharWindows(data.train.to(device), data.context),
            batch_size=batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(seed),
            collate_fn=_batch_as_is,
        )


# ------------------------------------------------------------------------ amp
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
    checkpoint_plan: Any = None,
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
        step = build_step(amp, accum=args.accum, clip=args.clip, checkpoint_plan=checkpoint_plan)
        runners[amp] = (step, [state])
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
    *,
    checkpoint_plan: Any = None,
) -> str:
    """The precision to train in: ``args.amp``, or the faster one measured."""
    if args.amp != "auto":
        echo(f"amp: {args.amp} (from --amp)")
        return args.amp
    candidates = _amp_candidates(device)
    # the measurement builds throw-away models: keep the seeded RNG streams as they were
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        t0 = time.perf_counter()
        seconds = measure_amp(args, data, device, candidates, checkpoint_plan=checkpoint_plan)
    best = min(seconds, key=seconds.__getitem__)
    names = {"off": "fp32"}
    timings = ", ".join(f"{names.get(a, a)} {s * 1e3:.1f} ms" for a, s in seconds.items())
    echo(
        f"amp: measured one micro-step: {timings} ({time.perf_counter() - t0:.1f}s to measure)"
        f" -> {'fp32 (amp off)' if best == 'off' else best}; --amp overrides"
    )
    return best


# ---------------------------------------------------------------------- hooks
def make_evaluator(
    data: CharDataset, args: argparse.Namespace, device: torch.device
) -> Callable[[ftrain.TrainState], dict[str, torch.Tensor]]:
    """``evaluate(state) -> {"val/loss": ...}`` on ``args.eval_batches`` fixed batches."""
    g = torch.Generator().manual_seed(1234)
    batches = [
        data.sample(args.batch_size, generator=g, split="val", device=device)
        for _ in range(args.eval_batches)
    ]

    def evaluate(state: ftrain.TrainState) -> dict[str, torch.Tensor]:
        # EvalHook calls this in eval mode under torch.no_grad()
        losses = [lm_loss(state.model, batch) for batch in batches]
        return {"val/loss": torch.stack(losses).mean()}

    return evaluate


class RunConfig:
    """A stateful hook that carries the run's settings inside every checkpoint.

    A resumed run reads them back (``ckpt["hooks"]["demo_config"]``) to
    rebuild the same model, data and schedule.
    """

    name = "demo_config"
    priority = "HIGHEST"

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        yield from events

    def state_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        pass  # read before the loop is built (see train); this run's config stays

    def __repr__(self) -> str:
        return "RunConfig()"


def _seconds(value: float | None) -> str:
    """``12.3s`` under a minute, else ``h:mm:ss``; ``?`` when unknown."""
    from ftrain.hooks.timer import format_seconds

    if value is None or value != value:
        return "?"
    return f"{value:.1f}s" if value < 59.95 else format_seconds(value)


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    return get is not None and type(get()).__name__ == "ZMQInteractiveShell"


def _use_bar(progress: str) -> bool:
    if progress != "auto":
        return progress == "bar"
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty or _in_notebook()


class ProgressTable:
    """A logger sink: one table row per log (above the progress bar, if there is one).

    ``write`` gets the means over the logging interval (from
    :class:`~ftrain.hooks.logging.LoggerHook`); numbers come from the device
    only then. Evaluations get a row too unless ``eval_rows=False`` (the
    console progress bar prints them).
    """

    HEADER = (
        f"{'update':>7} {'loss':>7} {'grad_norm':>9} {'lr':>9} {'samples/s':>9} "
        f"{'elapsed':>8} {'eta':>8}"
    )

    def __init__(
        self,
        batch_size: int,
        echo: Callable[[str], None],
        *,
        best: Any = None,
        eval_rows: bool = True,
    ) -> None:
        self.batch_size = batch_size
        self.echo = echo
        self.best = best
        self.eval_rows = eval_rows
        self.history: list[tuple[int, float]] = []
        self.evaluations: list[tuple[int, float]] = []
        self._header = False

    def _row(self, text: str) -> None:
        if not self._header:
            self.echo(self.HEADER)
            self._header = True
        self.echo(text)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        loss = scalars.get("loss", float("nan"))
        iter_time = scalars.get("iter_time")
        speed = f"{self.batch_size / iter_time:>9.0f}" if iter_time else f"{'-':>9}"
        self._row(
            f"{step:>7} {loss:>7.3f} {scalars.get('grad_norm', float('nan')):>9.3f} "
            f"{scalars.get('lr', float('nan')):>9.2e} {speed} "
            f"{_seconds(scalars.get('elapsed')):>8} {_seconds(scalars.get('eta')):>8}"
        )
        self.history.append((step, loss))

    def write_eval(self, step: int, scalars: dict[str, float]) -> None:
        value = scalars.get("val/loss")
        if value is None:
            return
        self.evaluations.append((step, value))
        if self.eval_rows:
            # the logger sees the result before the best-checkpoint hook (lower priority) does
            best = self.best is not None and self.best.is_better(value)
            self._row(f"{'':>7} val/loss {value:.3f} at update {step}" + (" *best" if best else ""))

    def close(self) -> None:
        pass


def _intervals(args: argparse.Namespace) -> tuple[int, int, int]:
    """Updates between progress lines, evaluations and checkpoints."""
    log_every = args.log_every or _nice_interval(args.steps)
    eval_every = args.eval_every or _nice_interval(args.steps, 6)
    return log_every, eval_every, args.checkpoint_every or eval_every


def build_hooks(
    args: argparse.Namespace,
    evaluate: Callable[[ftrain.TrainState], Mapping[str, Any]],
    config: Mapping[str, Any],
    echo: Callable[[str], None] = print,
) -> tuple[ftrain.Hooks, ProgressTable]:
    """The demo's hooks, and the table sink that prints the progress lines.

    Evaluation every ``eval_every`` updates (and at the end), timer, logger
    (console progress, JSONL and TensorBoard sinks in the run directory), the
    learning-rate schedule, periodic checkpoints (``max_keep``), the best
    checkpoint on ``val/loss``, and a checkpoint on Ctrl-C/SIGTERM.
    """
    log_every, eval_every, checkpoint_every = _intervals(args)
    bar = _use_bar(args.progress)
    best = ftrain.BestCheckpointHook("val/loss")
    write = echo
    if bar and echo is print:
        from tqdm.auto import tqdm

        write = tqdm.write  # prints above the bar (in Jupyter: next to the widget)
    table = ProgressTable(args.batch_size, write, best=best, eval_rows=not bar)
    hooks = ftrain.Hooks(
        [
            RunConfig(config),
            EvalHook(evaluate, every=eval_every, by_epoch=False, at_end=True),
            ftrain.TimerHook(skip_first_k=2),
            ftrain.LoggerHook(
                every=log_every,
                progress=bar,
                console=bar,
                jsonl=True,
                tensorboard=True,
                sinks=[table],
                desc="demo",
            ),
            ScheduleHook(lr=lr_schedule(args.lr, warmup=args.warmup, decay_steps=args.decay_steps)),
            ftrain.CheckpointHook(checkpoint_every, max_keep=args.max_keep),
            best,
            ftrain.AutoCheckpointHook(),
        ]
    )
    return hooks, table


# ---------------------------------------------------------------- run folder
def _clear_run(run_dir: Path, *, checkpoints: bool = True) -> list[str]:
    """Delete what an earlier run wrote in ``run_dir``: only ftrain's own files.

    The checkpoints listed in its manifest (unless ``checkpoints=False``), the
    JSONL log and the TensorBoard event files.
    """
    removed: list[str] = []
    if not run_dir.is_dir():
        return removed
    if checkpoints:
        manifest = Manifest(run_dir)
        for entry in list(manifest.entries):
            manifest.remove(entry["name"])
            removed.append(entry["name"])
        with contextlib.suppress(FileNotFoundError):
            manifest.path.unlink()
    jsonl = run_dir / "metrics.jsonl"
    if jsonl.exists():
        jsonl.unlink()
        removed.append(jsonl.name)
    tb = run_dir / "tb"
    events = sorted(tb.glob("events.out.tfevents.*")) if tb.is_dir() else []
    for p in events:
        p.unlink()
    if events:
        removed.append("tb/")
        with contextlib.suppress(OSError):
            tb.rmdir()
    return removed


def _find_checkpoint(args: argparse.Namespace, run_dir: Path) -> tuple[Path | None, Any]:
    """The checkpoint to continue from (``--resume``), and its contents."""
    mode = "never" if args.fresh else args.resume
    if mode == "never":
        return None, None
    if mode == "auto":
        found = find_resumable(run_dir)
        return found if found is not None else (None, None)
    path = Path(mode)
    if path.is_dir():
        found = find_resumable(path)
        if found is None:
            raise SystemExit(f"--resume {path}: no checkpoint to resume from in that directory")
        return found
    if not path.exists():
        raise SystemExit(f"--resume {path}: no such file (use auto, never or a checkpoint path)")
    return path, load_checkpoint(path)


def _config(args: argparse.Namespace, saved: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Settings for this run: the resumed run's, with what the command line may change.

    Returns ``(config, old)``: this run's settings (also set on ``args``) and
    those saved in the checkpoint being resumed (empty for a new run).
    """
    mine = {k: getattr(args, k) for k in (*RUN_KEYS, *EXEC_KEYS)}
    old = None
    if isinstance(saved, Mapping):
        old = (saved.get("hooks") or {}).get(RunConfig.name)
    if not isinstance(old, Mapping):
        return mine, {}
    explicit = getattr(args, "explicit", None)
    if explicit is None:  # a Namespace not made by parse_args: everything counts as given
        explicit = frozenset(mine)
    conflicts = [
        f"--{k.replace('_', '-')} {mine[k]} (the run has {old[k]})"
        for k in RUN_KEYS
        if k in explicit and k in old and mine[k] != old[k]
    ]
    if conflicts:
        raise SystemExit(
            f"{args.run_dir}: this run was started with other settings: "
            + "; ".join(conflicts)
            + ". Use --fresh to start over, or another --run-dir."
        )
    config = {**mine, **{k: old[k] for k in RUN_KEYS if k in old}}
    if "checkpoint_plan" in old and "checkpoint_plan" not in explicit:
        config["checkpoint_plan"] = old["checkpoint_plan"]
    for k, v in config.items():
        setattr(args, k, v)
    return config, dict(old)


def _files_report(run_dir: Path, hint: str = "run again to resume") -> list[str]:
    """Lines describing what is in the run directory."""
    entries = Manifest(run_dir).entries if run_dir.is_dir() else []
    periodic = [e["name"] for e in entries if e.get("kind") == "periodic"]
    best = [e for e in entries if e.get("kind") == "best"]
    interrupted = [e["name"] for e in entries if e.get("kind") == "interrupted"]
    lines = [f"run dir {run_dir}/:"]
    if periodic or interrupted:
        lines.append(f"  checkpoints  {', '.join(periodic + interrupted)}  ({hint})")
    for e in best:
        lines.append(f"  best         {e['name']}  (val/loss {e.get('value', float('nan')):.3f})")
    if (run_dir / "metrics.jsonl").exists():
        lines.append("  metrics      metrics.jsonl  (one JSON object per log line)")
    if (run_dir / "tb").is_dir():
        lines.append(f"  tensorboard  tb/  (tensorboard --logdir {run_dir / 'tb'})")
    return lines


def _sample(
    model: CharTransformer, data: CharDataset, args: argparse.Namespace, echo: Callable
) -> str:
    if args.sample_chars <= 0:
        return ""
    g = torch.Generator().manual_seed(args.seed)
    ids = model.generate(data.encode("def "), args.sample_chars, top_k=20, generator=g)
    sample = data.decode(ids)
    echo("sample:\n" + "\n".join("  | " + line for line in sample.splitlines()))
    return sample


# ---------------------------------------------------------------------- train
def train(args: argparse.Namespace, echo: Callable[[str], None] = print) -> TrainResult:
    """Train the demo model as ``args`` says, in ``args.run_dir``; print progress with ``echo``.

    Continues the run in ``args.run_dir`` (``args.resume``), or starts it.
    """
    device = _device(args.device)
    threads = _set_threads(args.threads, device)
    run_dir = Path(args.run_dir)
    resume_path, saved = _find_checkpoint(args, run_dir)
    if resume_path is None:
        # a new run: the logs of an earlier one would be continued, so they go (with
        # its checkpoints when starting over on purpose)
        fresh = args.fresh or args.resume == "never"
        removed = _clear_run(run_dir, checkpoints=fresh)
        if removed:
            why = "starting over" if fresh else "no checkpoint to resume"
            echo(f"{why} in {run_dir}/: removed {', '.join(removed)}")
    config, old = _config(args, saved)

    data = make_dataset(context=args.context)
    echo(
        f"ftrain demo: a character-level transformer learns the shipped corpus "
        f"({len(data.train) + len(data.val):,} characters, vocabulary {data.vocab_size}); "
        f"device {device}"
        + (f", {threads} thread{'s' if threads != 1 else ''}" if device.type == "cpu" else "")
    )
    start_step = 0
    if resume_path is not None:
        start_step = int(saved["state"]["step"])
        pending = bool(saved["state"].get("grads"))  # a partial accumulation window
        if start_step >= args.steps and not pending:
            return _finished(args, data, device, run_dir, resume_path, saved, old, echo)
        echo(
            f"run dir {run_dir}/: resuming from {resume_path} at update {start_step} of "
            f"{args.steps} (--fresh starts over)"
        )
    else:
        echo(f"run dir {run_dir}/: a new run of {args.steps} updates")

    plan, plan_line = make_checkpoint_plan(args, data, device)
    if args.amp == "auto" and old.get("amp") in _AMP_RESOLVED:
        amp = old["amp"]  # a resumed run keeps its precision (measured when it started)
        echo(f"amp: {amp} (as the run so far; --amp overrides)")
    else:
        amp = choose_amp(args, data, device, echo, checkpoint_plan=plan)
        if old.get("amp") not in (None, amp):
            echo(f"note: training in {amp} from here; the run so far used {old['amp']}")
    if old.get("checkpoint_plan") not in (None, args.checkpoint_plan):
        echo(
            f"note: --checkpoint-plan {args.checkpoint_plan} from here; the run so far used "
            f"{old['checkpoint_plan']}"
        )
    config["amp"] = amp

    torch.manual_seed(args.seed)
    model = _make_model(args, data.vocab_size, device)
    state = ftrain.TrainState.create(model, _make_optimizer(args, model))
    step = build_step(amp, accum=args.accum, clip=args.clip, checkpoint_plan=plan)
    n_params = sum(p.numel() for p in model.parameters())
    echo(
        f"model: {n_params / 1e6:.2f}M parameters (d_model {args.d_model}, {args.layers} "
        f"layers, {args.heads} heads, context {args.context}); {args.steps} updates of "
        f"{args.accum} x {args.batch_size} sequences"
    )
    echo("step:  " + repr(step).replace("\n  ", " "))
    echo(plan_line)

    evaluate = make_evaluator(data, args, device)
    hooks, table = build_hooks(args, evaluate, config, echo)
    loader = make_loader(data, args.batch_size, seed=args.seed, device=device)
    lp = ftrain.loop(
        step,
        state,
        loader,
        hooks=hooks,
        max_steps=args.steps,
        work_dir=run_dir,
        resume=resume_path,
    )
    log_every, eval_every, checkpoint_every = _intervals(args)
    echo(
        "hooks: " + " -> ".join(h.name for h in lp.hooks) + f"; a line every {log_every} "
        f"updates, validation every {eval_every}, a checkpoint every {checkpoint_every} "
        f"(newest {args.max_keep} kept)"
    )

    start = time.perf_counter()
    try:
        state = lp.run()
    except (KeyboardInterrupt, TerminatedError) as exc:
        what = "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else signal.Signals(exc.signum).name
        entry = Manifest(run_dir).entry("interrupted.pth")
        saved_now = entry is not None and entry.get("step") == lp.state.step
        echo(
            f"\n{what}: stopped at update {lp.state.step}; "
            + (
                f"saved {run_dir / 'interrupted.pth'}"
                if saved_now
                else "could not save it, the newest periodic checkpoint remains"
            )
            + ": run the same command to resume"
        )
        raise
    seconds = time.perf_counter() - start

    model = state.model
    eval_hook = lp.hooks["eval"].fn
    val_loss = float((eval_hook.metrics or {}).get("val/loss", float("nan")))
    train_loss = table.history[-1][1] if table.history else float("nan")
    echo(
        f"done: update {state.step} ({state.step - start_step} this run) in {seconds:.1f}s; "
        f"loss {train_loss:.3f} (last interval), validation {val_loss:.3f} nats/char"
    )
    last = state.transforms.get("activation_checkpoint")
    if last is not None and getattr(last, "last", None):
        names = last.last.get("checkpointed", [])
        echo(f"activation checkpointing: the last step checkpointed {len(names)} modules {names}")
    for line in _files_report(run_dir, "a larger --steps trains further; --fresh starts over"):
        echo(line)
    sample = _sample(model, data, args, echo)
    return TrainResult(
        state=state,
        dataset=data,
        amp=amp,
        history=table.history,
        val_loss=val_loss,
        sample=sample,
        seconds=seconds,
        run_dir=run_dir,
        resumed_from=resume_path,
        start_step=start_step,
    )


def _finished(
    args: argparse.Namespace,
    data: CharDataset,
    device: torch.device,
    run_dir: Path,
    path: Path,
    saved: Mapping[str, Any],
    old: Mapping[str, Any],
    echo: Callable[[str], None],
) -> TrainResult:
    """The run already reached ``--steps``: report it, train nothing."""
    step = int(saved["state"]["step"])
    where = "already finished" if step == args.steps else f"is past --steps {args.steps}"
    echo(
        f"run dir {run_dir}/: this run {where} ({path.name}: update {step}); nothing to train. "
        "Pass a larger --steps to train further, or --fresh to start over."
    )
    model = _make_model(args, data.vocab_size, device)
    state = ftrain.TrainState.create(model, _make_optimizer(args, model))
    state = ftrain.checkpoint.load_state_dict(state, saved["state"], rng=False)
    evaluate = make_evaluator(data, args, device)
    from ftrain.hooks.evaluation import evaluation_mode

    with evaluation_mode(model):
        val_loss = float(evaluate(state)["val/loss"])
    echo(f"validation {val_loss:.3f} nats/char")
    for line in _files_report(run_dir, "--steps N to train further, --fresh to start over"):
        echo(line)
    sample = _sample(model, data, args, echo)
    return TrainResult(
        state=state,
        dataset=data,
        amp=str(old.get("amp", args.amp)),
        history=[],
        val_loss=val_loss,
        sample=sample,
        seconds=0.0,
        run_dir=run_dir,
        resumed_from=path,
        start_step=step,
        trained=False,
    )


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Entry point of ``python -m ftrain.demo``."""
    return train(parse_args(argv))
