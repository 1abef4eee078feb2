"""What the stop vote (preemption under torch.distributed) costs per optimizer update.

::

    python benchmarks/preempt_vote.py                                  # one process
    torchrun --standalone --nproc-per-node 2 benchmarks/preempt_vote.py   # 2 gloo ranks

A tiny DDP step (``Linear(16, 16)``, batch 8, MSE: the step is nearly all
overhead) trained by ``ftrain.Loop(...).run()`` without hooks, ``--updates`` updates per
timing, repeats alternating with the vote on and off (off: the loop made as
in one process, which never votes). Prints the median µs per update of each
and their difference. In one process there is no vote: it prints the loop's
µs per update only (compare with the commit before the vote).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ftrain
from ftrain import dist
from ftrain._agreement import StopVote
from ftrain.loop.signals import Signals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--interval", type=float, default=0.1)  # StopVote.interval
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    info = dist.init()
    if info.world_size > 1:
        StopVote.interval = args.interval
    torch.manual_seed(0)
    model = dist.wrap(torch.nn.Linear(16, 16), "ddp")
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    data = [batch] * args.updates
    step = ftrain.make_step(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    start_voting = getattr(Signals, "start_voting", None)  # (None before the vote existed)

    def no_vote(self: Signals) -> None:
        self.requested, self.vote = 0, None

    def timed(vote: bool) -> float:
        if info.world_size > 1:
            Signals.start_voting = start_voting if vote else no_vote  # type: ignore[method-assign]
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
        dist.barrier()
        t0 = time.perf_counter()
        ftrain.Loop(step, state, data, hooks=[], epochs=1).run()
        return (time.perf_counter() - t0) / args.updates * 1e6

    timed(True)  # warm-up (and the vote's gloo group)
    on, off = [], []
    for _ in range(args.repeats):
        if info.world_size > 1:
            on.append(timed(True))
        off.append(timed(False))
    if start_voting is not None:
        Signals.start_voting = start_voting  # type: ignore[method-assign]
    if dist.is_main():
        base = statistics.median(off)
        if info.world_size == 1:
            print(f"1 process: {base:.1f} µs/update (no vote)")
        else:
            voted = statistics.median(on)
            print(
                f"{info.world_size} ranks ({info.backend}): {voted:.1f} µs/update with the vote, "
                f"{base:.1f} without: +{voted - base:.1f} µs/update "
                f"(a vote every {args.interval * 1e3:g} ms of updates)"
            )
    dist.shutdown()


if __name__ == "__main__":
    main()
