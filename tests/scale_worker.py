"""Scenarios of tests/test_scale.py (issue 20), run by ``torchrun`` on 2 or 4 gloo ranks.

``torchrun --standalone --nproc-per-node N scale_worker.py SCENARIO OUT_DIR``

Each scenario measures what FSDP2/HSDP/DDP keep alive or send (saved tensors, gradient
storages, collectives seen by a dispatch mode) and writes ``OUT_DIR/<name>_rank<r>.json``
for the test to check against its bounds and its independent references.
"""

from __future__ import annotations

import collections
import copy
import gc
import json
import math
import sys
import warnings
from pathlib import Path

import torch
from helpers import make_batches, mse_loss
from torch.utils._python_dispatch import TorchDispatchMode

import ftrain
from ftrain import dist
from ftrain._agreement import StopVote
from ftrain._tensors import local_tensor

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
    return sum(local_tensor(p).nbytes for p in model.parameters())


_COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "broadcast", "all_to_all", "alltoall", "gather", "scatter", "barrier")  # fmt: skip


class Collectives(TorchDispatchMode):
    """Every c10d collective issued inside (DDP's reducer, FSDP2, DTensor's redistributions,
    ftrain): the op, its dtype and the bytes of its largest tensor. DTensor ops are handed
    on (``NotImplemented``) so that the collectives DTensor issues for them are seen too."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        op = func.name().split("::")[-1]
        if "c10d" in func.namespace and any(op.lstrip("_").startswith(c) for c in _COLLECTIVES):
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


# ------------------------------------------------------ accumulation (item 2)
def grad_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes alive on this rank: the sharded ``.grad`` and what FSDP2 holds
    unsharded (autograd's ``.grad`` of the unsharded parameters, and its accumulated copy in
    the reduce dtype), each storage once."""
    from torch.distributed.fsdp import FSDPModule

    tensors = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    if hasattr(fp, "_unsharded_param"):
                        tensors.append(fp._unsharded_param.grad)
                    tensors.append(fp.unsharded_accumulated_grad)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t is not None
    }
    return sum(storages.values())


def _accum_memory(batches, sync: str, mp: str | None) -> dict[str, float]:
    """Gradient bytes per rank after each non-boundary micro-batch, over the full model's."""
    model = dist.wrap(blocks(), "fsdp2", mixed_precision=mp)
    full = model_bytes(blocks())
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=4, sync=sync)
    if mp is not None:
        step = ftrain.with_amp(step, mp)
    between = []
    for b in batches[:8]:
        state, _ = step(state, shard(b))
        if step.pending(state):
            between.append(grad_bytes(state.model) / full)
    return {"max": max(between), "min": min(between), "shard": shard_bytes(model) / full}


def _run(model, step, batches, sharded: bool = True):
    """The loop over ``batches`` (a partial last window flushed: ``dist.sync_pending_grads``
    then ``step.flush`` in the loop's ``_flush``); the whole parameters and reduce-scatters."""
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    data = [shard(b) if sharded else b for b in batches]
    with Collectives() as seen:
        state = ftrain.Loop(step, state, data, hooks=[]).run()
    return full_params(state.model), sum(seen.count("reduce_scatter").values())


def _accum_equality(batches) -> dict[str, object]:
    """7 micro-batches, windows of 3, 3 and a flushed 1, against one process on the
    combined batches; and the reduce-scatters of each mode."""
    out: dict[str, object] = {}
    ref, _ = _run(blocks(), ftrain.with_grad_accum(ftrain.make_step(mse_loss), 3), batches, False)
    for sync in ("auto", "boundary"):
        step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3, sync=sync)
        params, scatters = _run(dist.wrap(blocks(), "fsdp2"), step, batches)
        out[sync] = {"diff": max_diff(params, ref), "reduce_scatters": scatters}
    out["units"] = 5  # 4 blocks and the root's head
    out["moved"] = max_diff(ref, full_params(blocks()))
    return out


def scenario_accum(out: Path) -> None:
    dist.init()
    batches = make_batches(8, batch_size=16, d_in=32, d_out=4)
    result: dict[str, object] = {
        f"{sync}_{mp}": _accum_memory(batches, sync, mp)
        for sync in ("auto", "boundary")
        for mp in (None, "bf16")
    }
    result["equality"] = _accum_equality(batches[:7])
    dump(out, "accum", result)


# ------------------------------------------------------------------ HSDP (item 3)
def summed_loss(model, batch):
    """A loss summed over the rows its mask keeps (unequal counts per rank)."""
    x, y, mask = batch
    per_row = (model(x) - y).pow(2).mean(-1)
    return ftrain.SummedLoss(per_row[mask].sum(), mask.sum())


def hsdp_batches(n: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """Global batches of 16 rows (4 per rank of 4) with a random mask; in batch 3 a kept
    row of rank 3's quarter is NaN (its window must be skipped everywhere)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        mask = torch.rand(16, generator=g) < 0.6
        if i == 3:
            x[13], mask[13] = float("nan"), True
        out.append((x, y, mask))
    return out


def hsdp_step() -> ftrain.step.Step:
    step = ftrain.with_grad_accum(ftrain.make_step(summed_loss), every=2)
    step = ftrain.with_clip(step, "norm", max_norm=0.5)
    return ftrain.with_nonfinite_check(step, "skip")


def _hsdp_train(model, batches, sharded: bool = True) -> tuple[dict, list, list]:
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    norms, skipped = [], []
    step = hsdp_step()
    for b in batches:
        state, m = step(state, shard(b) if sharded else b)
        if "grad_norm" in m:
            norms.append(float(m["grad_norm"]))
            skipped.append(bool(m["skipped"]))
    return full_params(state.model), norms, skipped


def _hsdp_placements(model) -> dict[str, object]:
    p = next(model.parameters())
    return {
        "mesh": list(p.device_mesh.shape),
        "names": list(p.device_mesh.mesh_dim_names),
        "placements": [type(pl).__name__ for pl in p.placements],
        "local": sum(local_tensor(q).numel() for q in model.parameters()),
        "total": sum(q.numel() for q in model.parameters()),
    }


def _hsdp_vote() -> dict[str, object]:
    """The stop vote over the 4 ranks (its side group): rank 2 asks at update 5."""
    clock = [0.0]
    vote = StopVote(clock=lambda: clock[0])
    for update in range(1, 200):
        clock[0] += 0.1
        if vote.update(2 if dist.rank() == 2 and update >= 5 else 0):
            return {"stopped_after": update, "votes": vote.votes}
    return {"stopped_after": None, "votes": vote.votes}


def _hsdp_checkpoint(out: Path, batches) -> None:
    """Train HSDP with checkpoints (the DCP path); rank 0 keeps the whole state to compare
    with the checkpoint resumed in one process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = dist.wrap(blocks(), "hsdp", mesh=dist.hsdp_mesh(2))
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    hooks = [ftrain.CheckpointHook(interval=2, max_keep=1)]
    data = [shard(b) for b in batches]
    state = ftrain.Loop(hsdp_step(), state, data, hooks=hooks, work_dir=out / "hsdp_run").run()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(state.model, state.optimizer, options=options)
    if dist.is_main():
        torch.save({"model": msd, "optimizer": osd, "step": state.step}, out / "hsdp_full.pt")


def scenario_hsdp(out: Path) -> None:
    """4 ranks as 2 replicas x 2 shards against DDP on the same 4 ranks and one process on
    the combined batches: SummedLoss counts, clipping's norm and the non-finite skip."""
    dist.init()
    batches = hsdp_batches()
    hsdp = dist.wrap(blocks(), "hsdp", mesh=dist.hsdp_mesh(2))
    result: dict[str, object] = {"placements": _hsdp_placements(hsdp)}
    runs = {
        "hsdp": _hsdp_train(hsdp, batches),
        "ddp": _hsdp_train(dist.wrap(blocks(), "ddp"), batches),
        "one": _hsdp_train(blocks(), batches, sharded=False),
    }
    result.update(
        vs_ddp=max_diff(runs["hsdp"][0], runs["ddp"][0]),
        vs_one=max_diff(runs["hsdp"][0], runs["one"][0]),
        moved=max_diff(runs["one"][0], full_params(blocks())),
        norms={k: v[1] for k, v in runs.items()},
        skipped={k: v[2] for k, v in runs.items()},
        vote=_hsdp_vote(),
    )
    _hsdp_checkpoint(out, batches)
    dump(out, "hsdp", result)


# ------------------------------------------------------- collectives (item 6)
def _config_step(name: str) -> ftrain.step.Step:
    step = ftrain.make_step(mse_loss)
    if "clip" in name:
        step = ftrain.with_clip(step, "norm", max_norm=1.0)
    if "fp16" in name:
        step = ftrain.with_amp(step, "fp16", loss_scale={"init_scale": 1024.0})
    if "+nf" in name:
        step = ftrain.with_nonfinite_check(step, "skip")
    return step


def _collectives_per_update(name: str, batches) -> float:
    """c10d collectives per optimizer update (gradient reduction included) of a config."""
    strategy = name.split("+")[0]
    mp = "fp16" if "fp16" in name and strategy == "fsdp2" else None
    model = dist.wrap(blocks(), strategy, mixed_precision=mp)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = _config_step(name)
    state, _ = step(state, shard(batches[0]))  # DDP's first step builds its buckets
    with Collectives() as seen:
        for b in batches:
            state, m = step(state, shard(b))
    assert not any(bool(v) for k, v in m.items() if k == "skipped")
    return len(seen.calls) / len(batches)


def _fake_vote(step_times: dict[int, float], updates: int, signal_at: int) -> dict[str, object]:
    """The vote with a fake clock per rank (``step_times[rank]`` seconds per update):
    rank 0 asks to stop at ``signal_at``; where each rank stops, after how much of its time."""
    clock = [0.0]
    vote = StopVote(clock=lambda: clock[0])
    dt = step_times[dist.rank()]
    out: dict[str, object] = {"stopped_after": None}
    for update in range(1, updates + 1):
        clock[0] += dt
        mine = 1 if dist.rank() == 0 and update >= signal_at else 0
        if vote.update(mine):
            out = {"stopped_after": update, "seconds": (update - signal_at) * dt}
            break
    return {**out, "votes": vote.votes, "every": vote.every, "elapsed": clock[0]}


def _metrics_reduction() -> dict[str, object]:
    """reduce_metrics: collectives per call, and its values against all_gather_object."""
    r = dist.rank()
    calls = []
    objects = [0]
    original = torch.distributed.all_gather_object

    def counting(*args, **kwargs):
        objects[0] += 1
        return original(*args, **kwargs)

    reduced = []
    for i in range(4):
        metrics = {"loss": torch.tensor(1.5 + r + i), "lr": 0.1, "n": 3 * r}
        if r == 0:
            metrics["only0"] = 7.0 + i
        torch.distributed.all_gather_object = counting
        try:
            with Collectives() as seen:
                reduced.append(dist.reduce_metrics(metrics, ops={"n": "sum", "lr": "max"}))
        finally:
            torch.distributed.all_gather_object = original
        calls.append(len(seen.calls))
        everyone: list = [None] * dist.world_size()
        original(everyone, {k: float(v) for k, v in metrics.items()})
    return {"calls": calls, "objects": objects[0], "reduced": reduced, "last": everyone}


def scenario_collectives(out: Path) -> None:
    dist.init()
    batches = make_batches(60, batch_size=16, d_in=32, d_out=4)
    configs = [
        "ddp", "ddp+nf", "ddp+clip", "ddp+clip+nf", "ddp+fp16", "ddp+fp16+nf",
        "fsdp2", "fsdp2+nf", "fsdp2+clip", "fsdp2+clip+nf", "fsdp2+fp16", "fsdp2+fp16+nf",
    ]  # fmt: skip
    result: dict[str, object] = {
        "per_update": {name: _collectives_per_update(name, batches) for name in configs},
        "vote": _fake_vote({0: 0.01, 1: 0.05}, updates=4000, signal_at=1234),
        "vote_no_signal": _fake_vote({0: 0.002, 1: 0.002}, updates=30000, signal_at=10**9),
        "metrics": _metrics_reduction(),
    }
    dump(out, "collectives", result)


# ---------------------------------------------------------- meta init (item 8)
class Rope(torch.nn.Module):
    """A rotary-embedding table computed in ``__init__`` (a buffer, not a parameter)."""

    def __init__(self, dim: int = 8, seq: int = 16, device: str | None = None) -> None:
        super().__init__()
        self.register_buffer("freqs", self.table(dim, seq, device), persistent=False)

    @staticmethod
    def table(dim: int, seq: int, device: str | None = None) -> torch.Tensor:
        inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, device=device).float() / dim)
        return torch.outer(torch.arange(seq, device=device).float(), inv)


class RecomputedRope(Rope):
    """The table computed again by ``reset_parameters`` (how a meta-built model gets it)."""

    def reset_parameters(self) -> None:
        self.freqs.copy_(self.table(2 * self.freqs.shape[1], self.freqs.shape[0]))


class Attention(torch.nn.Module):
    """nn.MultiheadAttention (``_reset_parameters``), a RoPE table and a head."""

    def __init__(self, rope: type[Rope] = RecomputedRope, **rope_kw) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.rope = rope(**rope_kw)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        rot = self.rope.freqs[: x.shape[1]].cos().repeat(1, 8)[:, :32]
        x = x * rot
        return self.head(self.attn(x, x, x, need_weights=False)[0]).mean(1)


def _meta_attention(rope: type[Rope] = RecomputedRope, **kw) -> torch.nn.Module:
    with torch.device("meta"):
        model = Attention(rope)
    return dist.wrap(model, "fsdp2", **kw)


def scenario_meta(out: Path) -> None:
    """FSDP2 from the meta device: MultiheadAttention's weights and a RoPE table set."""
    dist.init()
    model = _meta_attention()
    full = full_params(model)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(2, 6, 32), torch.randn(2, 4)
    state, m = ftrain.make_step(mse_loss)(state, (x, y))
    missing = ""
    try:
        _meta_attention(Rope)  # nothing sets the table
    except RuntimeError as exc:
        missing = str(exc)
    result = {
        "finite": {k: bool(torch.isfinite(v).all()) for k, v in full.items()},
        "in_proj_std": float(full["attn.in_proj_weight"].std()),
        "xavier_std": math.sqrt(6 / (32 + 96)) / math.sqrt(3),
        "in_proj_bias_zero": bool((full["attn.in_proj_bias"] == 0).all()),
        "rope": bool(torch.equal(dist.unwrap(model).rope.freqs, Rope.table(8, 16))),
        "loss": float(m["loss"]),
        "missing": missing,
    }
    dump(out, "meta", result)


SCENARIOS = {
    "amp": scenario_amp,
    "accum": scenario_accum,
    "hsdp": scenario_hsdp,
    "collectives": scenario_collectives,
    "meta": scenario_meta,
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
