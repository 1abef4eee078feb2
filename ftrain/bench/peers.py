"""``python -m ftrain.bench peers``: ftrain against Lightning, MMEngine and accelerate.

Two measurements, each alternating the variants in rounds in one process (rotating who
goes first) and comparing each round's figures pairwise:

* **loop overhead**: the same tiny model (``Linear(16, 16)``, batch 8, MSE, SGD with
  momentum) trained by a plain PyTorch loop, ftrain (``Loop`` + ``default_hooks``),
  Lightning's ``Trainer``, MMEngine's ``Runner`` and a loop prepared by accelerate's
  ``Accelerator``, each with its own defaults (logging, checkpoint hooks; progress bars
  off) and a work directory. Every variant reads the same data loader, which stamps the
  time it hands out batch ``warmup`` and batch ``warmup + steps``: the microseconds per
  step between them, without set-up and tear-down. The figure: microseconds per step
  added to the plain loop's, paired by round.
* **background-save blocking**: a state of ``size_mb`` MiB saved by ``torch.save``
  (the reference), ftrain's background ``Checkpointer``, Lightning's ``AsyncCheckpointIO``
  and ``torch.distributed.checkpoint.async_save``: the time the caller is blocked, as a
  share of ``torch.save``'s, paired by round.

A peer that is not installed is skipped with a note.

Example:
    >>> [v.name for v in loop_variants()][:2]
    ['plain', 'ftrain']
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

from ftrain.bench.timing import summarize
from ftrain.bench.verdict import fmt_ratio, median_interval, paired

__all__ = ["PeersConfig", "LoopVariant", "loop_variants", "save_variants", "run_peers",
           "peers_table"]  # fmt: skip

LR, MOMENTUM = 1e-3, 0.9
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PeersConfig:
    """Steps timed per run (after ``warmup``), rounds, and the saved state's size."""

    steps: int = 900
    warmup: int = 50
    rounds: int = 9
    size_mb: float = 256.0
    directory: str | None = None


# ------------------------------------------------------------------- the probe
class Probe(IterableDataset):
    """The fixed batch, forever; stamps when batch ``start`` and batch ``stop`` are handed out.

    Example:
        >>> p = Probe((torch.zeros(1), torch.zeros(1)), start=2, stop=4)
        >>> it = iter(p)
        >>> _ = [next(it) for _ in range(4)]
        >>> p.per_step_us() >= 0
        True
    """

    def __init__(self, batch: Batch, start: int, stop: int) -> None:
        self.batch, self.start, self.stop = batch, start, stop
        self.count, self.t0, self.t1 = 0, math.nan, math.nan

    def __iter__(self) -> Iterator[Batch]:
        while True:
            self.count += 1
            if self.count == self.start:
                self.t0 = time.perf_counter()
            elif self.count == self.stop:
                self.t1 = time.perf_counter()
            yield self.batch

    def __len__(self) -> int:  # MMEngine's LoggerHook asks; every run stops well before
        return 10 * self.stop

    def per_step_us(self) -> float:
        """Microseconds per step between the two stamps (``nan`` if the run fell short)."""
        return (self.t1 - self.t0) / (self.stop - self.start) * 1e6


def _first(items: list[Batch]) -> Batch:
    """The collate function of a batch of one: the item itself (already a batch)."""
    return items[0]


def tiny_model() -> nn.Module:
    """``Linear(16, 16)`` from seed 0."""
    torch.manual_seed(0)
    return nn.Linear(16, 16)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# ---------------------------------------------------------------- the variants
def _plain(loader: DataLoader, total: int, work: Path) -> None:
    model = tiny_model()
    opt = _sgd(model)
    for i, (x, y) in enumerate(loader):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i + 1 == total:
            break


def _ftrain(loader: DataLoader, total: int, work: Path) -> None:
    import ftrain

    model = tiny_model()
    state = ftrain.TrainState.create(model, _sgd(model))
    step = ftrain.make_step(lambda m, b: F.mse_loss(m(b[0]), b[1]))
    ftrain.Loop(step, state, loader, ftrain.default_hooks(), max_steps=total, work_dir=work).run()


def _lightning(loader: DataLoader, total: int, work: Path) -> None:
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model()

        def training_step(self, batch: Batch, index: int) -> torch.Tensor:
            loss = F.mse_loss(self.model(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _sgd(self.model)

    trainer = L.Trainer(max_steps=total, accelerator="cpu", devices=1, default_root_dir=work,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Tiny(), loader)


def _mmengine(loader: DataLoader, total: int, work: Path) -> None:
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Tiny(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model()

        def forward(self, x: torch.Tensor, y: torch.Tensor, mode: str = "loss") -> Any:
            return {"loss": F.mse_loss(self.model(x), y)}

    optimizer = {"type": "SGD", "lr": LR, "momentum": MOMENTUM}
    runner = Runner(model=Tiny(), work_dir=str(work), train_dataloader=loader,
                    optim_wrapper={"optimizer": optimizer},
                    train_cfg={"by_epoch": False, "max_iters": total})  # fmt: skip
    runner.train()


def _accelerate(loader: DataLoader, total: int, work: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, project_dir=str(work))
    model = tiny_model()
    model, opt, data = accelerator.prepare(model, _sgd(model), loader)
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i + 1 == total:
            break


@dataclass(frozen=True)
class LoopVariant:
    """A way to train: ``run(loader, total_steps, work_dir)``; ``module``: what it needs."""

    name: str
    run: Callable[[DataLoader, int, Path], None]
    module: str | None = None
    what: str = ""


def loop_variants() -> list[LoopVariant]:
    """The plain loop (the reference), ftrain and the peers."""
    lightning = "Trainer defaults (logger, checkpoint callback), no progress bar"
    mmengine = "Runner defaults (default_hooks), by_epoch=False"
    accelerate = "Accelerator(cpu=True).prepare(model, optimizer, loader) + backward"
    return [
        LoopVariant("plain", _plain, None, "for x, y in loader: forward, backward, step"),
        LoopVariant("ftrain", _ftrain, "ftrain", "Loop + default_hooks(), a work_dir"),
        LoopVariant("lightning", _lightning, "lightning", lightning),
        LoopVariant("mmengine", _mmengine, "mmengine", mmengine),
        LoopVariant("accelerate", _accelerate, "accelerate", accelerate),
    ]


def installed(module: str | None) -> bool:
    """Whether ``module`` can be imported (``None``: nothing needed)."""
    return module is None or importlib.util.find_spec(module) is not None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The frameworks' console output and warnings go nowhere while they run."""
    import logging

    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        with contextlib.redirect_stderr(null), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            previous = logging.root.manager.disable
            logging.disable(logging.WARNING)
            try:
                yield
            finally:
                logging.disable(previous)


def _time_loop(variant: LoopVariant, cfg: PeersConfig, root: Path, r: int) -> float:
    g = torch.Generator().manual_seed(0)
    probe = Probe((torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)),
                  cfg.warmup, cfg.warmup + cfg.steps)  # fmt: skip
    loader = DataLoader(probe, batch_size=1, collate_fn=_first)  # MMEngine needs a batch_sampler
    work = root / f"{variant.name}-{r}"
    work.mkdir()
    with _quiet():
        variant.run(loader, cfg.warmup + cfg.steps + 5, work)  # the run ends after the window
    return probe.per_step_us()


def run_loops(cfg: PeersConfig, root: Path, progress: Any = None) -> dict[str, list[float]]:
    """Microseconds per step of every installed variant, one per round (rotating order)."""
    variants = [v for v in loop_variants() if installed(v.module)]
    us: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(cfg.rounds):
        for i in range(len(variants)):
            v = variants[(r + i) % len(variants)]
            us[v.name].append(_time_loop(v, cfg, root, r))
            if progress is not None:
                progress.update(1)
    return us


# ------------------------------------------------------------------ the saves
Start = Callable[[int], None]  # start(i): begin save number i (the caller is blocked meanwhile)
Wait = Callable[[], None]  # wait(): until that save is on disk


def _torch_save(state: dict[str, torch.Tensor], root: Path) -> tuple[Start, Wait]:
    return lambda i: torch.save(state, root / "torch.pth"), lambda: None


def _ftrain_save(state: dict[str, torch.Tensor], root: Path) -> tuple[Start, Wait]:
    from ftrain.persist.checkpointer import Checkpointer
    from ftrain.persist.snapshot import Snapshot

    ckpt = Checkpointer(torch.nn.Module())

    def start(i: int) -> None:
        snap = Snapshot({"format": "bench", "state": state}, i, i, 0, run_id="bench")
        ckpt.save(snap, root / "ftrain", "iter.pth", "periodic", background=True,
                  prune=lambda manifest: [])  # fmt: skip

    return start, ckpt.wait


def _lightning_save(state: dict[str, torch.Tensor], root: Path) -> tuple[Start, Wait]:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    io = AsyncCheckpointIO(TorchCheckpointIO())
    return lambda i: io.save_checkpoint({"state_dict": state}, root / "lightning.ckpt"), io.teardown


def _dcp_save(state: dict[str, torch.Tensor], root: Path) -> tuple[Start, Wait]:
    import shutil

    import torch.distributed.checkpoint as dcp

    pending: list[Any] = []

    def start(i: int) -> None:
        shutil.rmtree(root / "dcp", ignore_errors=True)
        pending.append(dcp.async_save(state, checkpoint_id=str(root / "dcp")))

    def wait() -> None:
        while pending:
            pending.pop().result()

    return start, wait


def save_variants() -> list[tuple[str, Callable[..., tuple[Start, Wait]], str | None, str]]:
    """(name, setup(state, dir) -> (start, wait), module needed, what it is)."""
    return [
        ("torch.save", _torch_save, None, "synchronous: the reference"),
        ("ftrain", _ftrain_save, "ftrain",
         "Checkpointer.save(background=True): copy to reused host buffers, write on a thread"),
        ("lightning", _lightning_save, "lightning",
         "AsyncCheckpointIO(TorchCheckpointIO()): clone, torch.save on a thread pool"),
        ("dcp", _dcp_save, None, "torch.distributed.checkpoint.async_save (one process)"),
    ]  # fmt: skip


def run_saves(cfg: PeersConfig, root: Path, progress: Any = None) -> dict[str, dict[str, list]]:
    """Blocked and completed seconds of every installed save, one of each per round."""
    from ftrain.bench.checkpoint import make_state

    state = make_state(cfg.size_mb)
    made = []
    for name, setup, module, _ in save_variants():
        if installed(module):
            (root / name).mkdir()
            made.append((name, *setup(state, root / name)))
    out: dict[str, dict[str, list]] = {name: {"blocked": [], "completed": []} for name, *_ in made}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        for r in range(cfg.rounds):
            for i in range(len(made)):
                name, start, wait = made[(r + i) % len(made)]
                t0 = time.perf_counter()
                start(r)
                out[name]["blocked"].append(time.perf_counter() - t0)
                wait()
                out[name]["completed"].append(time.perf_counter() - t0)
                if progress is not None:
                    progress.update(1)
    return out


# ---------------------------------------------------------------- the figures
def _loop_rows(us: dict[str, list[float]]) -> list[dict[str, Any]]:
    ref = us["plain"]
    rows = []
    for v in loop_variants():
        if v.name not in us:
            continue
        s = summarize(us[v.name])
        added = median_interval(paired(us[v.name], ref, "difference"))
        ratio = median_interval(paired(us[v.name], ref, "ratio"))
        rows.append({"variant": v.name, "what": v.what, "us": s.median, "us_p25": s.p25,
                     "us_p75": s.p75, "added_us": added.as_dict(), "ratio": ratio.as_dict(),
                     "times_us": us[v.name]})  # fmt: skip
    return rows


def _save_rows(saves: dict[str, dict[str, list]]) -> list[dict[str, Any]]:
    ref = saves["torch.save"]["blocked"]
    rows = []
    for name, _, _, what in save_variants():
        if name not in saves:
            continue
        b, c = saves[name]["blocked"], saves[name]["completed"]
        ratio = median_interval(paired(b, ref, "ratio"))
        rows.append({"variant": name, "what": what, "blocked_s": summarize(b).median,
                     "completed_s": summarize(c).median, "blocked_vs_torch_save": ratio.as_dict(),
                     "blocked_s_all": b, "completed_s_all": c})  # fmt: skip
    return rows


def _skipped() -> list[str]:
    names = [(v.name, v.module) for v in loop_variants()]
    names += [(n, m) for n, _, m, _ in save_variants()]
    missing = sorted({n for n, m in names if not installed(m)})
    return [f"{n}: not installed, skipped (pip install {n})" for n in missing]


def run_peers(cfg: PeersConfig, progress: Any = None, *, quick: bool = False) -> dict[str, Any]:
    """Both measurements; ``{"loop": rows, "save": rows, "notes": [...]}``.

    ``quick`` changes nothing here but the caller's defaults (fewer steps, a smaller state):
    there is no target, only figures.
    """
    n_loops = sum(installed(v.module) for v in loop_variants())
    n_saves = sum(installed(m) for _, _, m, _ in save_variants())
    if progress is not None:
        progress.total = (progress.total or 0) + cfg.rounds * (n_loops + n_saves)
    with tempfile.TemporaryDirectory(dir=cfg.directory, prefix="ftrain-peers-") as tmp:
        (Path(tmp) / "loops").mkdir()
        (Path(tmp) / "saves").mkdir()
        us = run_loops(cfg, Path(tmp) / "loops", progress)
        saves = run_saves(cfg, Path(tmp) / "saves", progress)
    notes = _skipped() + [
        f"loop: us/step between batch {cfg.warmup} and batch {cfg.warmup + cfg.steps} of one "
        "run (no set-up or tear-down), p25-p75 over the rounds; added us and time vs plain: "
        "medians of the per-round paired difference / ratio (lower is better), with their "
        "order-statistic interval",
        f"save: a {cfg.size_mb:g} MiB state of 16 float32 tensors; blocked: the caller's wait "
        "per save; vs torch.save: median of the per-round ratios (lower is better)",
    ]
    return {"loop": _loop_rows(us), "save": _save_rows(saves), "results": [], "notes": notes,
            "skipped": _skipped()}  # fmt: skip


def peers_table(out: dict[str, Any]) -> str:
    """The two tables: loop overhead, then background-save blocking."""
    from ftrain.bench.report import format_table

    def interval(iv: dict[str, float], fmt: Callable[[float], str]) -> str:
        return f"{fmt(iv['lo'])} to {fmt(iv['hi'])}" if iv["n"] else "-"

    loop = [[r["variant"], f"{r['us']:.1f}", f"{r['us_p25']:.1f}-{r['us_p75']:.1f}",
             f"{r['added_us']['median']:+.1f}", interval(r["added_us"], lambda v: f"{v:+.1f}"),
             fmt_ratio(r["ratio"]["median"])] for r in out["loop"]]  # fmt: skip
    save = [[r["variant"], f"{r['blocked_s']:.3f}", f"{r['completed_s']:.3f}",
             fmt_ratio(r["blocked_vs_torch_save"]["median"]),
             interval(r["blocked_vs_torch_save"], fmt_ratio), r["what"]]
            for r in out["save"]]  # fmt: skip
    return "\n\n".join([
        format_table(["loop", "us/step", "p25-p75", "added us", "interval", "time vs plain"],
                     [loop]),
        format_table(["save", "blocked s", "completed s", "vs torch.save", "interval", "how"],
                     [save], left=(0, 5)),
    ])  # fmt: skip
