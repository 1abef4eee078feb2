"""Small, deterministic training runs for the exact-resume tests and kill campaigns.

In a test: ``lp = build("sdl0", work_dir, resume="auto")``, then drive ``lp``.
For the resume verifier (the campaigns, tests/test_resume_campaign.py):
``verify_resume(functools.partial(verify_build, "sdl0"), ...)``.

Every configuration has a model with dropout (the RNG matters), AdamW,
gradient accumulation, and EMA, evaluation (every 2 updates), best-checkpoint,
JSONL logging, periodic (every 2 updates) and save-on-interrupt hooks. Reading
a sample takes ``FETCH_SECONDS``, so a good share of the run is data fetching.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain

BATCH = 4
FETCH_SECONDS = 0.002

#: name -> (loader, workers, batches per epoch, accumulation window, epochs)
CONFIGS = {
    "accum29": ("sdl", 0, 29, 3, 3),  # every epoch ends on a partial window (flushed)
    "sdl0": ("sdl", 0, 16, 2, 3),
    "sdl2": ("sdl", 2, 16, 2, 3),
    "plain": ("plain", 0, 16, 2, 3),
    "dl_nogen": ("dl", 0, 16, 2, 3),  # DataLoader(shuffle=True), no generator
}


class Samples(torch.utils.data.Dataset):
    """Fixed random samples; reading one takes ``FETCH_SECONDS``.

    ``trigger=(index, signum, marker)``: the first read of sample ``index``
    (in any process, once: ``marker`` is a file) sends ``signum`` to the
    training process, from a loader worker too.
    """

    def __init__(self, n: int, trigger: tuple[int, int, str] | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 2, generator=g)
        self.trigger = trigger

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if FETCH_SECONDS:
            time.sleep(FETCH_SECONDS)
        if self.trigger is not None and i == self.trigger[0]:
            marker = Path(self.trigger[2])
            if not marker.exists():
                marker.touch()
                worker = torch.utils.data.get_worker_info() is not None
                os.kill(os.getppid() if worker else os.getpid(), self.trigger[1])
        return self.x[i], self.y[i]


class PlainBatches:
    """A plain re-iterable (no ``state_dict``): batches read in a fixed order by a generator."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples) // BATCH

    def __iter__(self):
        for b in range(len(self)):
            items = [self.samples[i] for i in range(b * BATCH, (b + 1) * BATCH)]
            yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def make_data(config: str, trigger: tuple[int, int, str] | None = None):
    kind, workers, batches, _, _ = CONFIGS[config]
    samples = Samples(batches * BATCH, trigger)
    if kind == "plain":
        return PlainBatches(samples)
    if kind == "dl":
        return torch.utils.data.DataLoader(samples, batch_size=BATCH, shuffle=True)
    return StatefulDataLoader(
        samples,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(3),
    )


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def build(
    config: str,
    work_dir: str | os.PathLike,
    *,
    resume: str | None = "auto",
    trigger: tuple[int, int, str] | None = None,
    extra_hooks: tuple = (),
    auto_checkpoint: bool = True,
) -> ftrain.Loop:
    """The run of ``config`` in ``work_dir`` (same seeds every time: only resume differs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, _, _, every, epochs = CONFIGS[config]
    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=every)
    step = ftrain.with_ema(step, decay=0.9)
    g = torch.Generator().manual_seed(1)
    val = (torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g))
    hooks = [
        ftrain.EvalHook(lambda s: {"loss": loss_fn(s.model, val)}, every=2, by_epoch=False),
        ftrain.BestCheckpointHook("loss"),
        ftrain.LoggerHook(every=3, console=False),
        ftrain.CheckpointHook(interval=2, max_keep=2, background=False),
        *extra_hooks,
    ]
    if auto_checkpoint:
        hooks.append(ftrain.hooks.AutoCheckpointHook())
    return ftrain.Loop(
        step,
        ftrain.TrainState.create(model, opt),
        make_data(config, trigger),
        hooks=hooks,
        epochs=epochs,
        work_dir=work_dir,
        resume=resume,
    )


WALL_CLOCK = ("time", "data_time", "compute_time", "iter_time", "elapsed", "eta")
MACHINE = ("perf/", "memory/")  # throughput and memory tags measure the machine, not training


def _measured(key: str) -> bool:
    return key in WALL_CLOCK or key.startswith(MACHINE)


def metric_lines(work_dir: str | os.PathLike) -> list[dict]:
    """``metrics.jsonl`` without its wall-clock and machine-measurement fields."""
    import orjson

    lines = Path(work_dir, "metrics.jsonl").read_bytes().splitlines()
    return [{k: v for k, v in orjson.loads(line).items() if not _measured(k)} for line in lines]


def outcome(lp: ftrain.Loop) -> dict:
    """Everything an exact resume must reproduce (the logged lines come from the file)."""
    s = lp.state
    hooks = {h.name: h.fn for h in lp.hooks}
    best = hooks["best_loss"]
    return {
        "params": [p.detach().clone() for p in s.model.parameters()],
        "optimizer": s.optimizer.state_dict(),
        "ema": s.transforms["ema"].state_dict(),
        "counters": (s.step, s.micro_step, s.epoch),
        "best": (best.best, best.best_file),
        "metrics": metric_lines(lp.work_dir),
    }


def verify_build(config: str, work_dir: str | os.PathLike, resume: str | None) -> ftrain.Loop:
    """The run of ``config`` as :func:`ftrain.verify.verify_resume` builds it (importable by
    its subprocesses: pass ``functools.partial(verify_build, config)``)."""
    return build(config, work_dir, resume=resume)
