"""``python -m ftrain.bench e2e``: the full stack against a hand-written loop, same features.

Both train the same small transformer language model from the same seed on the same
batches, with bf16 autocast, gradient accumulation, clipping by norm, a warmup + cosine
learning rate, an EMA of the weights, a periodic evaluation of the EMA, a background
checkpoint and logging (console line, JSONL, TensorBoard). ftrain is ``Loop`` +
``default_hooks`` + ``EvalHook``; the other is the loop a user writes by hand with torch
alone (:func:`hand_written_loop`). They run alternately in one process, in chunks of
``updates`` optimizer updates, rotating who goes first; every chunk holds the same number
of logs, evaluations and checkpoints for both. The whole is repeated in ``blocks`` fresh
pairs of runs, built in alternating order: two identical runs in one process can differ
by a few percent (where their tensors landed in memory), and fresh pairs average that
out instead of fixing it for the whole measurement. The figure is the per-round tokens/s
ratio (ftrain / hand-written, higher is better), its median and order-statistic interval.

Example:
    >>> cfg = E2EConfig(blocks=1, rounds=2, updates=4, accum=2, log_every=2, eval_every=2,
    ...                 checkpoint_every=4, spec=E2EConfig.small_spec(width=16, layers=1))
    >>> out = run_e2e(cfg)  # doctest: +SKIP
    >>> out["same_loss"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch
from torch.utils.data import DataLoader, TensorDataset

from ftrain.bench.models import ModelSpec, lm_loss
from ftrain.bench.timing import summarize
from ftrain.bench.verdict import Target, judge, median_interval, paired

__all__ = ["E2EConfig", "hand_written_loop", "ftrain_loop", "run_e2e", "e2e_table", "TARGET"]

#: tokens/s of the full ftrain stack over the hand-written loop's (issue 21).
TARGET = Target("tokens/s, ftrain / hand-written (higher is better)", 0.98, "x", better="higher")
#: Largest |loss difference| between the two runs that counts as the same loss.
LOSS_TOLERANCE = 1e-4

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class E2EConfig:
    """What ``e2e`` runs: the model, the chunking and every feature's setting.

    ``blocks`` fresh pairs of runs, each ``rounds`` timed chunks per side. The first,
    untimed chunk of a run has ``updates // 2`` updates, so checkpoints (every
    ``checkpoint_every``, a divisor of ``updates``) land mid-chunk and their background
    writes end inside the chunk that started them.

    Example:
        >>> E2EConfig().total_updates  # one run of a block
        105
    """

    spec: ModelSpec = field(default_factory=lambda: E2EConfig.small_spec())
    blocks: int = 3
    rounds: int = 10
    updates: int = 10
    accum: int = 4
    log_every: int = 5
    eval_every: int = 5
    checkpoint_every: int = 10
    lr: float = 3e-3
    warmup_updates: int = 10
    ema_decay: float = 0.99
    max_norm: float = 1.0
    epoch_batches: int = 48
    val_batches: int = 2
    directory: str | None = None

    @staticmethod
    def small_spec(**sizes: int) -> ModelSpec:
        """The small transformer LM (d 64, 4 layers, 8 x 64 tokens, vocab 512) with ``sizes``."""
        base = {"batch_size": 8, "width": 64, "layers": 4, "seq_len": 64}
        return ModelSpec("transformer", **{**base, **sizes})

    @property
    def total_updates(self) -> int:
        """Updates in one run (of one block): the warm-up chunk and ``rounds`` chunks."""
        return self.updates // 2 + self.rounds * self.updates

    def check(self) -> None:
        """Raise ValueError naming a setting that breaks the equal-chunk design."""
        for name in ("log_every", "eval_every", "checkpoint_every"):
            if self.updates % getattr(self, name):
                raise ValueError(
                    f"e2e: {name}={getattr(self, name)} must divide --updates {self.updates}, so "
                    "every timed chunk holds the same logs, evaluations and checkpoints"
                )
        if self.blocks < 1 or self.rounds < 1:
            raise ValueError(
                f"e2e: blocks and rounds must be >= 1, got {self.blocks}, {self.rounds}"
            )
        if self.spec.kind != "transformer":
            raise ValueError(f"e2e: the model is a transformer LM, got {self.spec.kind!r}")


# ------------------------------------------------------------------------- data
def make_data(cfg: E2EConfig) -> tuple[DataLoader, list[Batch]]:
    """The training loader (the same batches, in order, every epoch) and the held-out batches."""
    batches = [cfg.spec.batch(seed=i) for i in range(cfg.epoch_batches)]
    xs, ys = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=cfg.spec.batch_size, shuffle=False)
    val = [cfg.spec.batch(seed=1_000_000 + i) for i in range(cfg.val_batches)]
    return loader, val


def lr_factor(cfg: E2EConfig, update: int) -> float:
    """Linear warmup from 0.1x over ``warmup_updates``, times a cosine to 0 over the run.

    Example:
        >>> cfg = E2EConfig()
        >>> round(lr_factor(cfg, 0), 6), lr_factor(cfg, cfg.total_updates)
        (0.1, 0.0)
    """
    cosine = 0.5 * (1 + math.cos(math.pi * min(update, cfg.total_updates) / cfg.total_updates))
    if update >= cfg.warmup_updates:
        return cosine
    return (1 - (1 - update / cfg.warmup_updates) * 0.9) * cosine


def val_loss(model: torch.nn.Module, val: list[Batch]) -> torch.Tensor:
    """The mean loss over the held-out batches (call it in eval mode under ``no_grad``)."""
    return torch.stack([lm_loss(model, b) for b in val]).mean()


# ------------------------------------------------------------ the hand-written loop
def _start_save(model: Any, opt: Any, ema: Any, update: int, path: Path) -> threading.Thread:
    """Copy the state (the training thread waits for the copy), write it on a thread."""
    snapshot = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
        "ema": {k: v.detach().clone() for k, v in ema.state_dict().items()},
        "update": update,
    }
    thread = threading.Thread(target=torch.save, args=(snapshot, path))
    thread.start()
    return thread


def _log(update: int, loss: float, lr: float, jsonl: Any, tb: Any) -> None:
    """A console line, a JSONL row and TensorBoard scalars."""
    print(f"step {update}  loss {loss:.4f}  lr {lr:.3e}")
    jsonl.write(orjson.dumps({"step": update, "loss": loss, "lr": lr}) + b"\n")
    tb.add_scalar("loss", loss, update)
    tb.add_scalar("lr", lr, update)


def _evaluate(module: torch.nn.Module, val: list[Batch]) -> float:
    module.eval()
    with torch.no_grad():
        return float(val_loss(module, val))


def hand_written_loop(
    cfg: E2EConfig, loader: DataLoader, val: list[Batch], work_dir: Path, evals: list[float]
) -> Iterator[int]:
    """The same training, written with torch alone as a user would; yields after each update."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torch.utils.tensorboard import SummaryWriter

    model = cfg.spec.build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: lr_factor(cfg, u))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay))
    tb = SummaryWriter(str(work_dir / "tb"))
    jsonl = open(work_dir / "metrics.jsonl", "ab")  # noqa: SIM115
    update, micro, loss_sum, saving = 0, 0, torch.zeros(()), None
    try:
        while True:
            for batch in loader:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = lm_loss(model, batch)
                (loss / cfg.accum).backward()
                loss_sum += loss.detach()
                micro += 1
                if micro % cfg.accum:
                    continue
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                ema.update_parameters(model)
                update += 1
                if update % cfg.log_every == 0:
                    mean = loss_sum.item() / (cfg.log_every * cfg.accum)
                    _log(update, mean, opt.param_groups[0]["lr"], jsonl, tb)
                    loss_sum.zero_()
                if update % cfg.eval_every == 0:
                    evals.append(_evaluate(ema.module, val))
                if update % cfg.checkpoint_every == 0:
                    if saving is not None:
                        saving.join()
                    saving = _start_save(model, opt, ema, update, work_dir / f"iter_{update}.pth")
                yield update
    finally:
        if saving is not None:
            saving.join()
        tb.close()
        jsonl.close()
        evals.append(_evaluate(model, val))


# ------------------------------------------------------------------------ ftrain
def ftrain_loop(
    cfg: E2EConfig, loader: DataLoader, val: list[Batch], work_dir: Path, evals: list[float]
) -> Any:
    """The same training with ftrain: the step's transforms, default hooks and an EvalHook."""
    import ftrain
    from ftrain import schedules as S
    from ftrain.transforms.ema import use_ema

    model = cfg.spec.build(seed=0)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    lr = S.warmup(S.cosine(cfg.lr, total=cfg.total_updates), iters=cfg.warmup_updates, ratio=0.1)
    step = ftrain.make_step(lm_loss)
    step = ftrain.with_amp(step, dtype="bf16")
    step = ftrain.with_grad_accum(step, every=cfg.accum)
    step = ftrain.with_clip(step, "norm", max_norm=cfg.max_norm)
    step = ftrain.with_schedule(step, lr=lr)
    step = ftrain.with_ema(step, decay=cfg.ema_decay)

    def evaluate(state: Any) -> dict[str, torch.Tensor]:
        loss = val_loss(state.model, val)
        evals.append(float(loss))
        return {"val_loss": loss}

    hooks = ftrain.default_hooks(
        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, max_keep=2
    ).add(ftrain.EvalHook(use_ema(evaluate), every=cfg.eval_every, by_epoch=False))
    return ftrain.Loop(step, state, loader, hooks, max_steps=cfg.total_updates, work_dir=work_dir)


# ----------------------------------------------------------------------- runners
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Both runs' console output (lines, bars) goes to the null device."""
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        with contextlib.redirect_stderr(null):
            yield


class _Side:
    """One side's runner: ``run(k)`` trains ``k`` more updates, waiting for its writes."""

    def __init__(self, name: str, run: Callable[[int], None], close: Callable[[], None]) -> None:
        self.name, self.run, self.close = name, run, close
        self.times: list[float] = []  # wall-clock seconds per chunk
        self.cpu: list[float] = []  # CPU seconds of the process (every thread) per chunk
        self.evals: list[float] = []

    def timed(self, k: int) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        with _quiet():
            self.run(k)
        dt = time.perf_counter() - t0
        self.times.append(dt)
        self.cpu.append(time.process_time() - c0)
        return dt


def _hand_side(cfg: E2EConfig, loader: DataLoader, val: list[Batch], root: Path) -> _Side:
    (root / "plain").mkdir()
    side = _Side("hand-written", lambda k: None, lambda: None)
    gen = hand_written_loop(cfg, loader, val, root / "plain", side.evals)

    def run(k: int) -> None:
        for _ in range(k):
            next(gen)

    side.run, side.close = run, gen.close
    return side


def _ftrain_side(cfg: E2EConfig, loader: DataLoader, val: list[Batch], root: Path) -> _Side:
    side = _Side("ftrain", lambda k: None, lambda: None)
    lp = ftrain_loop(cfg, loader, val, root / "ftrain", side.evals)

    def run(k: int) -> None:
        lp.run(steps=k)
        if lp.checkpointer is not None:
            lp.checkpointer.wait()  # as the hand-written side joins its writer: no spill-over

    def close() -> None:
        with _quiet():
            lp.run()  # the run is at max_steps: ends it (final checkpoint, sinks closed)
        side.evals.append(_evaluate(lp.state.model, val))

    side.run, side.close = run, close
    return side


def _alternate(cfg: E2EConfig, sides: list[_Side], progress: Any) -> None:
    for side in sides:  # untimed: compiles nothing, allocates the snapshot buffers, opens files
        with _quiet():
            side.run(cfg.updates // 2)
    for r in range(cfg.rounds):
        for i in range(len(sides)):
            sides[(r + i) % len(sides)].timed(cfg.updates)
            if progress is not None:
                progress.update(1)


def _block(cfg: E2EConfig, b: int, data: tuple[DataLoader, list[Batch]], progress: Any) -> Any:
    """One fresh pair of runs (built ftrain first in even blocks), alternated; closed."""
    with tempfile.TemporaryDirectory(dir=cfg.directory, prefix="ftrain-e2e-") as tmp:
        makers = [_ftrain_side, _hand_side] if b % 2 == 0 else [_hand_side, _ftrain_side]
        sides = [make(cfg, *data, Path(tmp)) for make in makers]
        _alternate(cfg, sides, progress)
        for side in sides:
            side.close()
    return {side.name: side for side in sides}


def run_e2e(cfg: E2EConfig, progress: Any = None, *, quick: bool = False) -> dict[str, Any]:
    """Run both sides alternately in ``blocks`` fresh pairs; the tokens/s ratio, its verdict
    and the loss check."""
    cfg.check()
    data = make_data(cfg)
    if progress is not None:
        progress.total = (progress.total or 0) + 2 * cfg.rounds * cfg.blocks
    merged = {
        name: _Side(name, lambda k: None, lambda: None) for name in ("ftrain", "hand-written")
    }
    for b in range(cfg.blocks):
        for name, side in _block(cfg, b, data, progress).items():
            for key in ("times", "cpu", "evals"):
                getattr(merged[name], key).extend(getattr(side, key))
    return _summary(cfg, [merged["ftrain"], merged["hand-written"]], quick)


def _summary(cfg: E2EConfig, sides: list[_Side], quick: bool) -> dict[str, Any]:
    ft, hw = sides
    tokens = cfg.updates * cfg.accum * cfg.spec.batch_size * cfg.spec.seq_len
    rows = []
    for side in sides:
        rates = [tokens / t for t in side.times]
        s = summarize(rates)
        rows.append({"variant": side.name, "tokens_per_s": s.median, "tokens_per_s_p25": s.p25,
                     "tokens_per_s_p75": s.p75, "times_s": side.times,
                     "cpu_s": side.cpu})  # fmt: skip
    ratio = median_interval(paired(hw.times, ft.times, "ratio"))  # = tokens/s ftrain / hand
    cpu = median_interval(paired(hw.cpu, ft.cpu, "ratio"))  # the same in CPU seconds
    verdict = judge(TARGET, ratio, quick=quick)
    diff = max((abs(a - b) for a, b in zip(ft.evals, hw.evals)), default=math.nan)
    same = len(ft.evals) == len(hw.evals) and diff <= LOSS_TOLERANCE
    return {"results": rows, "ratio": ratio.as_dict(), "cpu_ratio": cpu.as_dict(),
            "targets": [verdict.line()],
            "verdicts": [verdict.as_dict()],
            "evals": {"ftrain": ft.evals, "hand-written": hw.evals},
            "loss_max_abs_diff": diff, "same_loss": same, "tokens_per_round": tokens}  # fmt: skip


def e2e_table(out: dict[str, Any]) -> str:
    """The tokens/s of each side, the paired ratio and the loss check, as text."""
    from ftrain.bench.report import format_table
    from ftrain.bench.verdict import fmt_ratio

    cells = [[r["variant"], f"{r['tokens_per_s']:.0f}",
              f"{r['tokens_per_s_p25']:.0f}-{r['tokens_per_s_p75']:.0f}"]
             for r in out["results"]]  # fmt: skip
    iv, cpu = out["ratio"], out["cpu_ratio"]
    ev = out["evals"]
    return "\n".join([
        format_table(["variant", "tokens/s", "p25-p75"], [cells]),
        "",
        f"tokens/s ratio ftrain / hand-written (higher is better): {fmt_ratio(iv['median'])} "
        f"({iv['confidence']:.0%} interval {fmt_ratio(iv['lo'])} to {fmt_ratio(iv['hi'])}, "
        f"{iv['n']} paired rounds)",
        f"(info) the same in CPU seconds of the process, every thread (steadier on a busy "
        f"machine; background writes count): {fmt_ratio(cpu['median'])} ({fmt_ratio(cpu['lo'])} "
        f"to {fmt_ratio(cpu['hi'])})",
        f"same loss: {'yes' if out['same_loss'] else 'NO'}: {len(ev['ftrain'])} losses (every "
        f"EMA evaluation, each run's final loss), last: ftrain {ev['ftrain'][-1]:.6f} vs "
        f"hand-written {ev['hand-written'][-1]:.6f}, largest |difference| "
        f"{out['loss_max_abs_diff']:.2e} "
        f"(tolerance {LOSS_TOLERANCE:g})",
    ])  # fmt: skip


def profile_sides(cfg: E2EConfig, top: int = 15) -> dict[str, Any]:
    """cProfile one chunk of each side after the warm-up; the share of time in ftrain's code."""
    import cProfile
    import io
    import pstats

    import ftrain

    root_dir = str(Path(ftrain.__file__).resolve().parent)
    bench_dir = str(Path(__file__).resolve().parent)
    loader, val = make_data(cfg)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=cfg.directory, prefix="ftrain-e2e-prof-") as tmp:
        sides = [_ftrain_side(cfg, loader, val, Path(tmp)), _hand_side(cfg, loader, val, Path(tmp))]
        for side in sides:
            with _quiet():
                side.run(cfg.updates // 2)
            prof = cProfile.Profile()
            with _quiet():
                prof.runcall(side.run, cfg.updates)
            stats = pstats.Stats(prof)
            total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
            own = sum(v[2] for k, v in stats.stats.items()  # type: ignore[attr-defined]
                      if k[0].startswith(root_dir) and not k[0].startswith(bench_dir))  # fmt: skip
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
            out[side.name] = {"ftrain_share": own / total if total else math.nan,
                              "top": text.getvalue()}  # fmt: skip
            side.close()
    return out
