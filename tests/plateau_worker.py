"""The plateau rule under DDP, run by ``torchrun`` (2 processes, gloo on the CPU).

``torchrun --standalone --nproc-per-node 2 plateau_worker.py OUT_DIR``: each rank's evaluation
returns its own metric; ``EvalHook`` averages them over the ranks, so every rank lowers its
learning rates at the same evaluations. Each rank writes the lrs of its updates.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import dist
from ftrain import schedules as S

warnings.filterwarnings("ignore", category=FutureWarning)

SEQUENCE = [1.0, 0.9, 0.9, 0.9, 0.85, 0.85, 0.85, 0.85, 0.84, 0.84, 0.84, 0.7]  # the ranks' mean
SPREAD = 0.25  # rank 0 sees mean + SPREAD, rank 1 mean - SPREAD
PLATEAU = dict(factor=0.5, patience=1, cooldown=1, threshold=0.02, min_value=[0.004, 0.1])
LRS = (0.05, 0.5)


def main(out: Path) -> None:
    dist.init()
    rank = dist.rank()
    torch.manual_seed(0)
    inner = make_model(0)
    model = dist.wrap(inner, "ddp")
    groups = [{"params": inner.fc1.parameters()}, {"params": inner.fc2.parameters(), "lr": LRS[1]}]
    state = ftrain.TrainState.create(model, torch.optim.SGD(groups, lr=LRS[0]))
    step = ftrain.with_schedule(
        ftrain.make_step(mse_loss), plateau=S.plateau("val_loss", **PLATEAU)
    )

    def evaluate(state):
        own = SEQUENCE[state.epoch - 1] + (SPREAD if rank == 0 else -SPREAD)
        return {"val_loss": own}

    seen = []

    def record(events):
        for ev in events:
            if type(ev).__name__ == "StepEnd" and ev.is_update:
                seen.append([g["lr"] for g in ev.state.optimizer.param_groups])
            yield ev

    batches = make_batches(6)[rank::2]
    hooks = [ftrain.EvalHook(evaluate), ftrain.hook(record)]
    final = ftrain.Loop(step, state, batches, hooks, epochs=len(SEQUENCE)).run()
    plateau = final.transforms["schedule"].plateau
    with open(out / f"plateau_rank{rank}.json", "w") as f:
        json.dump({"lrs": seen, "best": plateau.best, "observed": plateau.observed}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        main(Path(sys.argv[1]))
        dist.barrier()
    finally:
        dist.shutdown()
