"""Scenarios of tests/test_scale.py (issue 20), run by ``torchrun`` on 2 or 4 gloo ranks.

``torchrun --standalone --nproc-per-node N scale_worker.py SCENARIO OUT_DIR``

Each scenario measures what FSDP2/HSDP/DDP keep alive or send (saved tensors, gradient
storages, collectives seen by a dispatch mode) and writes ``OUT_DIR/<name>_rank<r>.json``
for the test to check against its bounds and its independent references.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch
from helpers import make_batches, mse_loss
from torch.utils._python_dispatch import TorchDispatchMode

import ftrain
from ftrain import dist

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*barrier.*")


# ------------------------------------------------------------------ utilities
def dump(out: Path, name: str, data: object) -> None:
    with open(out / f"{name}_rank{dist.rank()}.json", "w") as f:
        json.dump(data, f)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (shards gathered), by its unwrapped name."""
    out = {}
    for name, p in dist.unwrap(model).named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def shard(batch, r: int | None = None, n: int | None = None):
    """This rank's rows of a global batch."""
    r = dist.rank() if r is None else r
    n = dist.world_size() if n is None else n
    return tuple(t.chunk(n)[r] for t in batch)


class Blocks(torch.nn.Module):
    """Residual MLP blocks in a ModuleList (FSDP2's units) and a small head (the root's)."""

    def __init__(self, d: int = 32, n: int = 4, d_out: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(d, 2 * d), torch.nn.ReLU(), torch.nn.Linear(2 * d, d)
            )
            for _ in range(n)
        )
        self.head = torch.nn.Linear(d, d_out)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def blocks(seed: int = 0) -> Blocks:
    torch.manual_seed(seed)
    return Blocks()


def model_bytes(model: torch.nn.Module) -> int:
    """The whole model's parameter bytes (as the user built it)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shard_bytes(model: torch.nn.Module) -> int:
    """This rank's parameter bytes (its FSDP2 shards)."""
    return sum(dist.local_tensor(p).nbytes for p in model.parameters())


class Collectives(TorchDispatchMode):
    """Every c10d collective issued inside (DDP's reducer, FSDP2, DTensor, ftrain): the op,
    its dtype and the bytes of its largest tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in func.namespace:
            tensors = [
                t
                for a in args
                for t in (a if isinstance(a, (list, tuple)) else [a])
                if isinstance(t, torch.Tensor)
            ]
            big = max(tensors, key=lambda t: t.nbytes) if tensors else None
            dtype = str(big.dtype).removeprefix("torch.") if big is not None else "-"
            self.calls.append((func.name(), dtype, big.nbytes if big is not None else 0))
        return func(*args, **(kwargs or {}))

    def count(self, kind: str = "") -> dict[str, int]:
        return dict(collections.Counter(f"{n}:{d}" for n, d, _ in self.calls if kind in n))

    def nbytes(self, kind: str) -> dict[str, int]:
        out: dict[str, int] = collections.defaultdict(int)
        for n, d, b in self.calls:
            if kind in n:
                out[d] += b
        return dict(out)


# ------------------------------------------------------------------ amp (item 1)
def _from_param(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter, or views / one dtype cast of one (autograd's record)."""
    fn = t.grad_fn
    if fn is None:
        return t.requires_grad
    while fn is not None:
        kind = type(fn).__name__
        if kind == "AccumulateGrad":
            return True
        nxt = [f for f, _ in fn.next_functions if f is not None]
        view_or_cast = kind.startswith(("TBackward", "ViewBackward", "ToCopyBackward"))
        if len(nxt) != 1 or not view_or_cast:
            return False
        fn = nxt[0]
    return False


def copies_loss(record: list[int]):
    """An MSE loss function that records, between forward and backward, the bytes of
    low-precision parameter copies saved for backward whose storage is still allocated."""

    def loss_fn(model, batch):
        saved: list[torch.Tensor] = []

        def pack(t):
            if t.dtype in (torch.bfloat16, torch.float16) and _from_param(t):
                saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = mse_loss(model, batch)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        record.append(sum(storages.values()))
        return loss

    return loss_fn


def _amp_copies(batches) -> dict[str, object]:
    """bf16 parameter copies alive between forward and backward, relative to the shard:
    autocast over fp32 FSDP2 weights (before) and with_amp over the policy (after)."""
    before: list[int] = []
    model = dist.wrap(blocks(), "fsdp2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies_loss(before)(model, batches[0]).backward()
    after: list[int] = []
    model = dist.wrap(blocks(), "fsdp2", mixed_precision="bf16")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    step = ftrain.with_amp(ftrain.make_step(copies_loss(after)), "bf16")
    for b in batches[:3]:
        state, _ = step(state, b)
    shard = shard_bytes(model)
    refused = ""
    try:  # autocast over fp32 FSDP2 weights is refused before the first forward
        plain = dist.wrap(blocks(), "fsdp2")
        step(ftrain.TrainState.create(plain, torch.optim.SGD(plain.parameters(), lr=0.1)),
             batches[0])  # fmt: skip
    except ValueError as exc:
        refused = str(exc)
    return {"shard": shard, "before": before[0] / shard, "after": max(after) / shard,
            "refused": refused}  # fmt: skip


def _amp_collectives(batch) -> dict[str, object]:
    """dtypes and bytes of FSDP2's all-gathers and reduce-scatters for one step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    bf16 = torch.bfloat16
    for name, mp in (
        ("none", None),
        ("bf16", "bf16"),
        ("bf16_reduce_bf16", MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)),
    ):
        model = dist.wrap(blocks(), "fsdp2", mixed_precision=mp)
        with Collectives() as seen, torch.autocast("cpu", dtype=bf16):
            mse_loss(model, batch).backward()
        out[name] = {"gather": seen.nbytes("allgather"), "reduce": seen.nbytes("reduce_scatter")}
    return out


def _policy_reference(batches, lr: float) -> dict[str, torch.Tensor]:
    """FSDP2's policy written as a plain loop: each rank's half batch forward and backward
    in bf16 (fp32 weights rounded to bf16, inputs cast), its gradient cast to fp32, the
    ranks' gradients averaged in fp32, SGD on the fp32 weights."""
    master = blocks()
    n = dist.world_size()
    for batch in batches:
        grads = []
        for r in range(n):
            x, y = shard(batch, r, n)
            work = copy.deepcopy(master).to(torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.nn.functional.mse_loss(work(x.to(torch.bfloat16)), y).backward()
            grads.append([p.grad.float() for p in work.parameters()])
        with torch.no_grad():
            for i, p in enumerate(master.parameters()):
                p -= lr * (sum(g[i] for g in grads) / n)
    return full_params(master)


def _train(model, step, batches, lr: float, sharded: bool = True):
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=lr))
    for b in batches:
        state, _ = step(state, shard(b) if sharded else b)
    return full_params(state.model)


def _amp_equality(batches) -> dict[str, float]:
    lr = 0.05
    step = ftrain.with_amp(ftrain.make_step(mse_loss), "bf16")
    fsdp = _train(dist.wrap(blocks(), "fsdp2", mixed_precision="bf16"), step, batches, lr)
    one_bf16 = _train(blocks(), step, batches, lr, sharded=False)
    one_fp32 = _train(blocks(), ftrain.make_step(mse_loss), batches, lr, sharded=False)
    return {
        "vs_policy_loop": max_diff(fsdp, _policy_reference(batches, lr)),
        "vs_one_process_bf16": max_diff(fsdp, one_bf16),
        "bf16_vs_fp32": max_diff(one_bf16, one_fp32),
        "moved": max_diff(one_fp32, full_params(blocks())),
    }


def _fp16_skip(batches) -> dict[str, object]:
    """fp16 policy and loss scaling: an overflow on rank 1 only is skipped by every rank."""
    r = dist.rank()
    model = dist.wrap(blocks(), "fsdp2", mixed_precision="fp16")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    step = ftrain.with_amp(ftrain.make_step(mse_loss), "fp16", loss_scale={"init_scale": 1024.0})
    skipped, scales, unchanged = [], [], []
    for i, b in enumerate(batches):
        x, y = shard(b)
        if i == 2 and r == 1:
            x = x * 6e4  # overflows fp16 on this rank only
        before = full_params(state.model)
        state, m = step(state, (x, y))
        skipped.append(bool(m["skipped"]))
        scales.append(float(m["loss_scale"]))
        unchanged.append(max_diff(before, full_params(state.model)) == 0.0)
    return {"skipped": skipped, "scales": scales, "unchanged": unchanged}


def scenario_amp(out: Path) -> None:
    dist.init()
    batches = make_batches(6, batch_size=16, d_in=32, d_out=4)
    result = {
        "copies": _amp_copies([shard(b) for b in batches]),
        "collectives": _amp_collectives(shard(batches[0])),
        "equality": _amp_equality(batches),
        "fp16": _fp16_skip(batches),
    }
    dump(out, "amp", result)


SCENARIOS = {
    "amp": scenario_amp,
}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    name, out = argv[:2]
    try:
        SCENARIOS[name](Path(out), *argv[2:])
        gc.collect()
        dist.barrier()
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
