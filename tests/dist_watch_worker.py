"""Distributed scenarios of issue 16 (profiler traces, logged throughput), run by ``torchrun``.

``torchrun --standalone --nproc-per-node 2 dist_watch_worker.py SCENARIO OUT_DIR``
(2 processes, gloo on CPU; a separate file from dist_worker.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import dist

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*barrier.*")


def scenario_profile(out: Path) -> None:
    dist.init()
    model = dist.wrap(make_model(0), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    prof = ftrain.hooks.ProfilerHook(start=2, wait=1, warmup=1, active=2, out_dir=out / "profile")
    hooks = [
        ftrain.TimerHook(skip_first_k=0),
        ftrain.LoggerHook(every=4, progress=False, tensorboard=False, jsonl=out / "m.jsonl"),
        prof,
    ]
    batches = make_batches(8)[dist.rank() :: 2]
    ftrain.Loop(ftrain.make_step(mse_loss), state, batches * 2, hooks, max_steps=8).run()
    with open(out / f"profile_rank{dist.rank()}.json", "w") as f:
        json.dump({"traces": [str(p) for p in prof.traces]}, f)


SCENARIOS = {"profile": scenario_profile}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TQDM_DISABLE", "1")
    name, out = argv
    try:
        SCENARIOS[name](Path(out))
        gc.collect()
        dist.barrier()
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
