"""CUDA/NCCL checks run by torchrun (tests/gpu/test_cuda_paths.py, benchmarks/gpu_check.sh).

``torchrun --standalone --nproc-per-node N tests/gpu/nccl_check.py MODE OUT_DIR``

* ``offload`` (1 process): FSDP2 with CPU offload gets CUDA autocast.
* ``agree`` (2 processes, 2 GPUs): the gloo checks of tests/test_dist.py's
  ``agree`` scenario on NCCL: a NaN loss on rank 1 is skipped by every rank
  (DDP, FSDP2), a summed loss over unequal micro-batches and ranks equals the
  full batch's token mean, the FSDP2 EMA stays sharded and swaps in, and
  ``clone()`` of an FSDP2 state continues like the original.

Each mode asserts inside and writes ``OUT_DIR/<mode>_rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

import ftrain
from ftrain import dist
from ftrain.transforms.ema import swap_ema


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in dist.unwrap(model).named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.to("cpu", copy=True)
    return out


def max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def batches(n: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 8, generator=g).to(device), torch.randn(8, 4, generator=g).to(device))
        for _ in range(n)
    ]


def mode_offload(out: Path) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    info = dist.init()
    assert info.device.type == "cuda", info
    torch.manual_seed(0)
    model = dist.wrap(MLP(), "fsdp2", offload_policy=CPUOffloadPolicy(), mixed_precision="bf16")
    local_device = next(model.parameters()).to_local().device.type
    seen = []

    def loss_fn(m, batch):
        seen.append(torch.is_autocast_enabled("cuda"))
        x, y = batch
        return torch.nn.functional.mse_loss(m(x).float(), y)

    step = ftrain.with_amp(ftrain.make_step(loss_fn), "bf16")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for b in batches(2, info.device):
        state, m = step(state, b)
    res = {
        "param_device": local_device,
        "amp_device": state.transforms["amp"].device_type,
        "cuda_autocast": seen,
        "loss_finite": bool(torch.isfinite(m["loss"])),
    }
    assert res["param_device"] == "cpu" and res["amp_device"] == "cuda", res
    assert all(seen) and res["loss_finite"], res
    return res


def mode_agree(out: Path) -> dict:
    info = dist.init()
    r, device = info.rank, info.device
    assert info.backend == "nccl" and device.type == "cuda", info
    res: dict = {}
    data = batches(3, device)

    def half(b):
        return tuple(t.chunk(2)[r] for t in b)

    # a NaN loss on rank 1 only: every rank skips, replicas equal a run without that batch
    def nan_loss(m, batch):
        x, y, bad = batch
        loss = torch.nn.functional.mse_loss(m(x), y)
        return loss * float("nan") if bad else loss

    torch.manual_seed(0)
    base = MLP().to(device)
    ref = copy.deepcopy(base)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in (0, 2):
        torch.nn.functional.mse_loss(ref(data[i][0]), data[i][1]).backward()
        ropt.step()
        ropt.zero_grad()
    for strategy in ("ddp", "fsdp2"):
        model = dist.wrap(copy.deepcopy(base), strategy)
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = ftrain.with_nonfinite_check(ftrain.make_step(nan_loss), "skip")
        skipped = []
        for i, b in enumerate(data):
            state, m = step(state, (*half(b), i == 1 and r == 1))
            skipped.append(bool(m["skipped"]))
        diff = max_diff(full_params(state.model), full_params(ref))
        res[f"skip/{strategy}"] = {"skipped": skipped, "vs_ref": diff}
        assert skipped == [False, True, False] and diff < 1e-5, (strategy, skipped, diff)

    # a summed loss: the update is the token mean over micro-batches and ranks
    g = torch.Generator().manual_seed(1)
    lengths = [[1, 7], [5, 2], [8, 3]]
    micro = []
    for pair in lengths:
        per_rank = []
        for n in pair:
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            mask = torch.zeros(8, dtype=torch.bool)
            mask[:n] = True
            per_rank.append((x.to(device), y.to(device), mask.to(device)))
        micro.append(per_rank)

    def summed(m, batch):
        x, y, mask = batch
        return ftrain.SummedLoss((m(x) - y).pow(2).mean(-1)[mask].sum(), mask.sum())

    model = dist.wrap(copy.deepcopy(base), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = ftrain.with_grad_accum(ftrain.make_step(summed), every=3)
    for pair in micro:
        state, _ = step(state, pair[r])
    ref = copy.deepcopy(base)
    xs = torch.cat([x[mk] for pair in micro for x, _, mk in pair])
    ys = torch.cat([y[mk] for pair in micro for _, y, mk in pair])
    (ref(xs) - ys).pow(2).mean(-1).mean().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    res["tokens"] = max_diff(full_params(state.model), full_params(ref))
    assert res["tokens"] < 1e-5, res

    # FSDP2: the EMA stays sharded and swaps in; clone() continues like the original
    model = dist.wrap(copy.deepcopy(base), "fsdp2")
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    plain = ftrain.make_step(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    plain = ftrain.with_ema(plain, decay=0.7)
    state = ftrain.Loop(plain, state, [half(b) for b in data[:2]], hooks=[], epochs=1).run()
    assert all(hasattr(v, "device_mesh") for v in state.transforms["ema"].params.values())
    x = data[2][0]
    with torch.no_grad():
        before = state.model(x)
        with swap_ema(state):
            swapped = state.model(x)
        after = state.model(x)
    res["ema_swap_changed"] = float((swapped - before).abs().max())
    res["ema_restored"] = float((after - before).abs().max())
    assert res["ema_swap_changed"] > 0 and res["ema_restored"] == 0.0, res
    clone = state.clone()
    state, _ = plain(state, half(data[2]))
    clone, _ = plain(clone, half(data[2]))
    res["clone"] = max_diff(full_params(state.model), full_params(clone.model))
    assert res["clone"] < 1e-6 and dist.strategy(clone.model) == "fsdp2", res
    return res


def main(argv: list[str]) -> None:
    mode, out = argv
    try:
        res = {"offload": mode_offload, "agree": mode_agree}[mode](Path(out))
        with open(Path(out) / f"{mode}_rank{dist.rank()}.json", "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
