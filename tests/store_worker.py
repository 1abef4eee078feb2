"""Distributed runs whose work_dir is on S3 (tests/test_object_store.py), 2 gloo ranks.

``torchrun --standalone --nproc-per-node 2 store_worker.py OUT ENDPOINT URL``

For DDP and FSDP2 in turn: a straight run on a local directory; a run on the S3 URL stopped
after its update 4 (a DDP checkpoint: rank 0's file and each rank's own; an FSDP2 one: a DCP
prefix written by every rank through fsspec, plus ``ftrain.pth`` and each rank's own file);
a resume from the URL. Writes ``OUT/store_<strategy>_rank<r>.json``: the largest difference
from the straight run, where it resumed from, and (rank 0) the objects in the bucket.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import s3fs
import torch
from dist_worker import full_params, max_diff, shard
from helpers import make_batches, make_model, mse_loss
from store_train import options

import ftrain
from ftrain import dist
from ftrain.events import StepEnd
from ftrain.persist.location import StoreURL


class StopAfter:
    """Raise once update ``at`` is checkpointed (every rank: the hook runs last)."""

    priority = "LOWEST"
    name = "stop"

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, events):
        for ev in events:
            yield ev
            if isinstance(ev, StepEnd) and ev.state.step == self.at:
                raise RuntimeError(f"stopped after update {self.at}")


def build(work_dir, strategy: str, resume, hooks=()):
    model = dist.wrap(make_model(0), strategy)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    batches = [shard(b) for b in make_batches(6, batch_size=8)]
    return ftrain.Loop(ftrain.make_step(mse_loss), state, batches,
                       [ftrain.CheckpointHook(2, max_keep=None), *hooks], epochs=2,
                       work_dir=work_dir, resume=resume)  # fmt: skip


def scenario(out: Path, url: StoreURL, strategy: str) -> dict:
    straight = full_params(build(out / f"straight_{strategy}", strategy, None).run().model)
    run_url = url / strategy
    try:
        build(run_url, strategy, None, [StopAfter(4)]).run()
    except RuntimeError as exc:
        assert "stopped after update 4" in str(exc), exc
    lp = build(run_url, strategy, "auto")
    resumed = full_params(lp.run().model)
    result = {"diff": max_diff(resumed, straight), "resumed_from": str(lp.resumed_from)}
    if dist.is_main():
        fs = s3fs.S3FileSystem(**url.storage_options)
        prefix = f"{url.url[len('s3://') :]}/{strategy}/"
        result["objects"] = sorted(p[len(prefix) :] for p in fs.find(prefix))
    return result


def main(out: str, endpoint: str, url: str) -> None:
    torch.set_num_threads(1)
    dist.init()
    where = StoreURL(url, storage_options=options(endpoint))
    try:
        for strategy in ("ddp", "fsdp2"):
            result = scenario(Path(out), where, strategy)
            with open(Path(out) / f"store_{strategy}_rank{dist.rank()}.json", "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
