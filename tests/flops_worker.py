"""FLOP counting under DDP and FSDP2 on 2 gloo ranks (tests/test_mfu.py; issue 20.10).

``torchrun --standalone --nproc-per-node 2 flops_worker.py OUT_DIR``

Rank 0 counts the FLOPs of a DDP and an FSDP2 model while rank 1 waits on the store (no
collective of its own): a collective issued by the count would wait for rank 1 until the
group's timeout and fail the launch. Writes ``OUT_DIR/flops.json`` (rank 0).
"""

from __future__ import annotations

import copy
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
from helpers import make_batches, make_model, mse_loss
from torch.utils.flop_counter import FlopCounterMode

from ftrain import dist
from ftrain.hooks.monitor import count_flops


def real_count(model: torch.nn.Module, batch) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        torch.autograd.grad(mse_loss(model, batch), list(model.parameters()))
    return int(counter.get_total_flops())


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init(timeout=60)
    plain = make_model(0)
    batch = make_batches(1)[0]
    ddp = dist.wrap(copy.deepcopy(plain), "ddp")
    fsdp2 = dist.wrap(copy.deepcopy(plain), "fsdp2")
    assert dist.strategy(ddp) == "ddp" and dist.strategy(fsdp2) == "fsdp2"
    store = tdist.distributed_c10d._get_default_store()  # noqa: SLF001 - the test's rendezvous
    if dist.rank() == 0:
        res = {
            "plain": count_flops(mse_loss, plain, batch),
            "plain_real": real_count(plain, batch),
            "ddp": count_flops(mse_loss, ddp, batch),
            "fsdp2": count_flops(mse_loss, fsdp2, batch),
            "full_numel": sum(p.numel() for p in plain.parameters()),
            "fsdp2_shard_numel": sum(p.to_local().numel() for p in fsdp2.parameters()),
        }
        (out / "flops.json").write_text(json.dumps(res))
        store.set("counted", "1")
    else:
        store.wait(["counted"])  # no collective here while rank 0 counts
    del ddp, fsdp2
    gc.collect()
    dist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
