"""Scenarios of the export and LR-finder distributed tests, run by ``torchrun`` (gloo on CPU).

``torchrun --standalone --nproc-per-node 2 export_worker.py SCENARIO OUT_DIR [ARGS...]``

Each scenario writes ``OUT_DIR/<name>_rank<r>.json`` (and files) for ``tests/test_export.py``
and ``tests/test_lr_find.py`` to check against one process.
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
import ftrain.checkpoint
from ftrain import dist

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*barrier.*")

#: Small enough that the 4-layer model of ``export`` is written as several shards.
SHARD_SIZE = 400


def dump(out: Path, name: str, data: object) -> None:
    with open(out / f"{name}_rank{dist.rank()}.json", "w") as f:
        json.dump(data, f)


def shard(batch):
    """This rank's rows of a global batch."""
    return tuple(t.chunk(dist.world_size())[dist.rank()] for t in batch)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (FSDP2 shards gathered), by its unwrapped name."""
    out = {}
    for name, t in dist.unwrap(model).state_dict().items():
        t = t.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def scenario_export(out: Path, strategy: str) -> None:
    """Train 3 updates (with an EMA) under ``strategy``, checkpoint, export live: weights
    (sharded directory and one file) and the average."""
    dist.init()
    model = dist.wrap(make_model(0), strategy)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = ftrain.with_ema(ftrain.make_step(mse_loss), decay=0.5)
    batches = [shard(b) for b in make_batches(3, batch_size=8)]
    hooks = [ftrain.CheckpointHook(3, background=False)]
    run = out / f"run_{strategy}"
    state = ftrain.Loop(step, state, batches, hooks, epochs=1, work_dir=run).run()
    live = out / f"{strategy}_live"
    written = {
        "dir": ftrain.checkpoint.export_weights(state, live, max_shard_size=SHARD_SIZE),
        "file": ftrain.checkpoint.export_weights(state, out / f"{strategy}_one.safetensors"),
        "ema": ftrain.checkpoint.export_weights(state, out / f"{strategy}_ema", ema=True),
    }
    params = full_params(state.model)
    if dist.is_main():
        torch.save(params, out / f"{strategy}_params.pt")
    # every rank returns after the files exist
    exists = all(p.is_file() for paths in written.values() for p in paths)
    seen = sorted(p.name for p in live.iterdir()) if live.is_dir() else []
    dump(out, f"export_{strategy}", {
        "written": {k: [p.name for p in v] for k, v in written.items()},
        "exists": exists,
        "seen_after_return": seen,
        "checkpoint": sorted(p.name for p in run.iterdir()),
    })  # fmt: skip


def scenario_lr_find(out: Path) -> None:
    """``lr_find`` under DDP: every rank gets the same curve; the state is untouched."""
    dist.init()
    model = dist.wrap(make_model(0), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = full_params(state.model)
    step = ftrain.with_clip(ftrain.make_step(mse_loss), "norm", max_norm=1.0)
    batches = [shard(b) for b in make_batches(4, batch_size=16)]
    result = ftrain.lr_find(step, state, batches, min_lr=1e-3, max_lr=100.0, num_training=30)
    after = full_params(state.model)
    dump(out, "lr_find", {
        "lrs": list(result.lrs),
        "losses": list(result.losses),
        "raw": list(result.raw_losses),
        "index": result.index,
        "stop": result.stop_reason,
        "untouched": all(torch.equal(before[k], after[k]) for k in before),
        "consumed": state.is_consumed,
    })  # fmt: skip


SCENARIOS = {"export": scenario_export, "lr_find": scenario_lr_find}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TQDM_DISABLE", "1")
    name, out, *args = argv
    try:
        SCENARIOS[name](Path(out), *args)
        gc.collect()  # DDP/FSDP2 modules in reference cycles: gone before the group
        dist.barrier()
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
