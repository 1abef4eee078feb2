"""A small GAN on a 2-D mixture of eight Gaussians: two optimizers in one TrainState.

The generator and the discriminator each have their own optimizer, loss, fp16 loss scaler,
learning-rate schedule and gradient clipping; the generator also keeps a weight average.
One ``ftrain.Loop`` trains both, one discriminator update then one generator update per
batch, on the CPU in a few seconds::

    python examples/gan.py runs/gan        # trains; run it again to resume from a checkpoint

``tests/test_multi_optimizer.py`` checks it against the same GAN written as a plain PyTorch
loop (bitwise), and that a run resumed from a mid-run checkpoint ends bitwise as an
uninterrupted one.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain import schedules as S
from ftrain.transforms.ema import swap_ema

SEED, POINTS, BATCH, EPOCHS, NOISE = 0, 1024, 64, 100, 4
UPDATES = EPOCHS * POINTS // BATCH  # rounds (one update of each optimizer per batch)
LR_D = S.cosine(1e-3, total=UPDATES, final_ratio=0.1)  # the discriminator's learning rate
LR_G = S.warmup(S.constant(1e-3), iters=20)  # the generator's
CLIP_D, CLIP_G, EMA_DECAY = 1.0, 5.0, 0.99


def modes(k: int = 8, radius: float = 2.0) -> torch.Tensor:
    """The centres of the mixture: ``k`` points on a circle."""
    angles = torch.arange(k, dtype=torch.float64) * (2 * math.pi / k)
    return (radius * torch.stack([angles.cos(), angles.sin()], 1)).float()


def mixture(n: int = POINTS, seed: int = SEED, std: float = 0.1) -> TensorDataset:
    """``n`` points drawn from the eight Gaussians (a fixed data set)."""
    g = torch.Generator().manual_seed(seed)
    centres = modes()[torch.randint(0, len(modes()), (n,), generator=g)]
    return TensorDataset(centres + std * torch.randn(n, 2, generator=g))


def loader(seed: int = SEED) -> StatefulDataLoader:
    """Shuffled batches; the Loop seeds the shuffle with ``seed + epoch`` each epoch."""
    g = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(mixture(), batch_size=BATCH, shuffle=True, generator=g)


def make_model(seed: int = SEED) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(
        torch.nn.Linear(NOISE, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 2),
    )  # fmt: skip
    disc = torch.nn.Sequential(
        torch.nn.Linear(2, 64), torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 64),
        torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 1),
    )  # fmt: skip
    return torch.nn.ModuleDict({"gen": gen, "disc": disc})


def make_optimizers(model: torch.nn.ModuleDict) -> dict[str, torch.optim.Optimizer]:
    return {
        "gen": torch.optim.Adam(model["gen"].parameters(), lr=1e-3, betas=(0.5, 0.999)),
        "disc": torch.optim.Adam(model["disc"].parameters(), lr=1e-3, betas=(0.5, 0.999)),
    }


def d_loss(model: torch.nn.ModuleDict, batch: list[torch.Tensor]) -> torch.Tensor:
    """The discriminator's loss: real points are 1, generated ones 0."""
    (real,) = batch
    fake = model["gen"](torch.randn(len(real), NOISE)).detach()
    real_logits, fake_logits = model["disc"](real), model["disc"](fake)
    return F.binary_cross_entropy_with_logits(
        real_logits, torch.ones_like(real_logits)
    ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))


def g_loss(model: torch.nn.ModuleDict, batch: list[torch.Tensor]) -> torch.Tensor:
    """The generator's (non-saturating) loss: its points should be taken for real."""
    (real,) = batch
    logits = model["disc"](model["gen"](torch.randn(len(real), NOISE)))
    return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def make_step() -> ftrain.step.Step:
    """One round: a discriminator update, then a generator update, each with its own
    fp16 loss scaler, schedule and clipping; an average of the generator's weights."""
    d_step = ftrain.make_step(d_loss, optimizer="disc")
    d_step = ftrain.with_clip(ftrain.with_amp(d_step, "fp16"), "norm", max_norm=CLIP_D)
    d_step = ftrain.with_schedule(d_step, lr=LR_D)
    g_step = ftrain.make_step(g_loss, optimizer="gen")
    g_step = ftrain.with_clip(ftrain.with_amp(g_step, "fp16"), "norm", max_norm=CLIP_G)
    g_step = ftrain.with_ema(ftrain.with_schedule(g_step, lr=LR_G), decay=EMA_DECAY)
    return d_step.then(g_step)


def build(
    work_dir: str | None = None, resume: str | bool | None = "auto", *, hooks=None, **run
) -> ftrain.Loop:
    """The run: ``ftrain.Loop`` over a fresh model, optimizers and loader (``run``:
    ``epochs=``/``max_steps=``, default ``EPOCHS``)."""
    model = make_model()
    state = ftrain.TrainState.create(model, make_optimizers(model))
    if hooks is None:
        hooks = ftrain.default_hooks(log_every=400, checkpoint_every=400, progress=False)
    run = run or {"epochs": EPOCHS}
    resume = resume if work_dir is not None else None
    return ftrain.Loop(make_step(), state, loader(), hooks, work_dir=work_dir, resume=resume, **run)


@torch.no_grad()
def coverage(state: ftrain.TrainState, n: int = 2000, near: float = 0.3) -> tuple[int, float]:
    """Modes the averaged generator reaches, and the share of its points near a mode."""
    g = torch.Generator().manual_seed(1)
    with swap_ema(state, "gen") as model:
        points = model["gen"](torch.randn(n, NOISE, generator=g))
    dist, nearest = torch.cdist(points, modes()).min(1)
    hit = dist < near
    return len(set(nearest[hit].tolist())), float(hit.float().mean())


def main(work_dir: str | None = None) -> ftrain.TrainState:
    state = build(work_dir).run()
    reached, share = coverage(state)
    print(f"step {state.step}: the averaged generator reaches {reached}/8 modes, "
          f"{share:.0%} of its points within 0.3 of one")  # fmt: skip
    return state


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
