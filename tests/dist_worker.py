"""Scenarios of the distributed tests, run by ``torchrun`` (2 processes, gloo on CPU).

``torchrun --standalone --nproc-per-node 2 dist_worker.py SCENARIO OUT_DIR [ARGS...]``

Each scenario asserts what it can inside the processes (a failed assertion
fails the launch) and writes ``OUT_DIR/<name>_rank<r>.json`` / ``.pt`` for
the test to check. Models are tiny and every process uses one thread.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from helpers import MLP, make_batches, make_model, mse_loss
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain import dist
from ftrain._agreement import StopVote
from ftrain.events import EpochEnd, StepEnd
from ftrain.transforms.ema import ema_state_dict, swap_ema

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*barrier.*")


# ------------------------------------------------------------------ utilities
def dump(out: Path, name: str, data: object) -> None:
    with open(out / f"{name}_rank{dist.rank()}.json", "w") as f:
        json.dump(data, f)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2 shards gathered), by its unwrapped name."""
    out = {}
    for name, p in dist.unwrap(model).named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def shard(batch, r: int | None = None, n: int | None = None):
    """This rank's rows of a global batch."""
    r = dist.rank() if r is None else r
    n = dist.world_size() if n is None else n
    return tuple(t.chunk(n)[r] for t in batch)


def run_steps(step, state, batches):
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
    dist.sync_pending_grads(state.model)  # a partial window skipped the all-reduce
    state, m = step.flush(state)
    if m:
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def reference(step, model, batches):
    """Single-process training on the combined (global) batches."""
    opt_model = copy.deepcopy(model)
    state = ftrain.TrainState.create(opt_model, torch.optim.SGD(opt_model.parameters(), lr=0.1))
    return run_steps(step, state, batches)


# ------------------------------------------------------------------ scenarios
def scenario_basics(out: Path) -> None:
    """init() from torchrun's env, reduce_metrics, SyncBuffersHook."""
    info = dist.init()
    assert (info.rank, info.world_size, info.local_rank) == (
        int(os.environ["RANK"]),
        2,
        int(os.environ["LOCAL_RANK"]),
    ), info
    assert info.backend == "gloo" and info.device.type == "cpu", info
    assert dist.init() == info  # idempotent
    r = dist.rank()
    metrics = {"loss": torch.tensor(1.0 + r), "acc": 0.5 * r, "skipped": r, "vec": torch.ones(3)}
    if r == 0:
        metrics["only0"] = 7
    reduced = dist.reduce_metrics(metrics, ops={"skipped": "sum"})
    maxed = dist.reduce_metrics({"loss": 1.0 + r}, "max")

    # BatchNorm statistics drift apart under FSDP2 (and DDP with broadcast_buffers=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    model = dist.wrap(model, "ddp", broadcast_buffers=False)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(r)
    data = [(torch.randn(8, 4, generator=g) * (1 + 3 * r), torch.randn(8, 2, generator=g))] * 3
    before: dict[str, torch.Tensor] = {}

    def capture(events):  # runs before SyncBuffersHook (priority HIGH) at EpochEnd
        for ev in events:
            if isinstance(ev, EpochEnd):
                bn = dist.unwrap(ev.loop.state.model)[1]
                before["mean"] = bn.running_mean.clone()
            yield ev

    state = ftrain.Loop(
        ftrain.make_step(mse_loss),
        state,
        data,
        hooks=[ftrain.hook(capture, priority="VERY_HIGH"), dist.SyncBuffersHook()],
        epochs=1,
    ).run()
    bn = dist.unwrap(state.model)[1]
    local_before = before["mean"]
    all_before = [torch.zeros_like(local_before) for _ in range(2)]
    torch.distributed.all_gather(all_before, local_before)
    after = [torch.zeros_like(bn.running_mean) for _ in range(2)]
    torch.distributed.all_gather(after, bn.running_mean)
    dump(
        out,
        "basics",
        {
            "reduced": reduced,
            "maxed": maxed,
            "buffers_differed": float((all_before[0] - all_before[1]).abs().max()),
            "buffers_after_diff": float((after[0] - after[1]).abs().max()),
            "buffers_vs_mean": float((bn.running_mean - sum(all_before) / 2).abs().max()),
            "counter": int(bn.num_batches_tracked),
            "logged": _logged_over_ranks(out),
        },
    )


def _logged_over_ranks(out: Path) -> list[list[str]]:
    """Train with LoggerHook where each rank's loss differs; the files rank 1 changed.

    The loss is ``1 + 99 * rank`` (logged: the mean, 50.5), evaluation gives
    ``10 * rank`` (5.0). The console/progress settings differ per rank: the
    logs (collectives) must still happen at the same events on every rank.
    """
    r = dist.rank()
    work_dir = out / "logged"
    changes = _audit(work_dir)
    model = dist.wrap(make_model(0), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))

    def loss_fn(m, batch):
        x, _ = batch
        return m(x).sum() * 0 + (1.0 + 99.0 * r), {"rank": torch.tensor(float(r))}

    hooks = [
        ftrain.TimerHook(),
        ftrain.EvalHook(lambda s: {"score": 10.0 * r}, every=1),
        ftrain.LoggerHook(every=2, progress=r == 0, console=r == 0, desc=f"rank {r}"),
    ]
    data = [shard(b) for b in make_batches(3, batch_size=8)]
    ftrain.Loop(
        ftrain.make_step(loss_fn), state, data, hooks=hooks, epochs=2, work_dir=work_dir
    ).run()
    return changes[:]


def scenario_ddp_vs_single(out: Path) -> None:
    """DDP on 2 ranks equals one process on the combined batch (clip: global norm)."""
    dist.init()
    batches = make_batches(6, batch_size=8)
    base = make_model(0)
    step = ftrain.with_clip(ftrain.make_step(mse_loss), "norm", max_norm=0.5)
    model = dist.wrap(copy.deepcopy(base), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, metrics = run_steps(step, state, [shard(b) for b in batches])
    ref_state, ref_metrics = reference(step, base, batches)
    dump(
        out,
        "ddp_vs_single",
        {
            "max_diff": max_diff(full_params(state.model), full_params(ref_state.model)),
            "moved": max_diff(full_params(state.model), full_params(base)),
            "grad_norms": [m["grad_norm"] for m in metrics],
            "ref_grad_norms": [m["grad_norm"] for m in ref_metrics],
        },
    )


def scenario_nosync(out: Path) -> None:
    """Accumulation skips the all-reduce on non-boundary micro-batches; same result."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import ftrain.transforms.accum as accum_mod

    dist.init()
    batches = make_batches(7, batch_size=8)  # 2 full windows of 3 + a flushed partial one
    base = make_model(0)
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)

    def train(no_sync_enabled: bool):
        model = dist.wrap(copy.deepcopy(base), "ddp")
        calls = [0]

        def counting(process_group, bucket):
            calls[0] += 1
            return allreduce_hook(process_group, bucket)

        model.register_comm_hook(None, counting)
        original = accum_mod.no_sync
        if not no_sync_enabled:
            accum_mod.no_sync = lambda m: contextlib.nullcontext()
        try:
            state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
            # the loop flushes the partial window (after reducing its gradients)
            state = ftrain.Loop(step, state, [shard(b) for b in batches], hooks=[], epochs=2).run()
        finally:
            accum_mod.no_sync = original
        return full_params(state.model), calls[0]

    with_nosync, calls_nosync = train(True)
    without, calls_without = train(False)
    ref_model = copy.deepcopy(base)
    ref_state = ftrain.TrainState.create(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1))
    ref_state = ftrain.Loop(step, ref_state, batches, hooks=[], epochs=2).run()
    dump(
        out,
        "nosync",
        {
            "allreduces_with_no_sync": calls_nosync,
            "allreduces_without": calls_without,
            "diff_vs_without": max_diff(with_nosync, without),
            "diff_vs_single": max_diff(with_nosync, full_params(ref_state.model)),
        },
    )


@contextlib.contextmanager
def count_reduce_scatters():
    """Count the reduce-scatter collectives issued inside (FSDP2 reduces gradients so)."""
    calls = [0]
    names = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
    originals = {n: getattr(torch.distributed, n) for n in names if hasattr(torch.distributed, n)}

    def counting(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    for n, fn in originals.items():
        setattr(torch.distributed, n, counting(fn))
    try:
        yield calls
    finally:
        for n, fn in originals.items():
            setattr(torch.distributed, n, fn)


def fsdp2_reduce_scatters(out: Path, base, batches) -> dict[str, object]:
    """Reduce-scatters of FSDP2 accumulation (every=3 over 7 micro-batches), with and
    without skipping the gradient sync between boundaries (opt-in: sync="boundary");
    the same parameters."""
    import ftrain.transforms.accum as accum_mod

    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3, sync="boundary")
    result: dict[str, object] = {}
    params = {}
    for skip in (True, False):
        model = dist.wrap(copy.deepcopy(base), "fsdp2")
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        original = accum_mod.no_sync
        if not skip:
            accum_mod.no_sync = lambda m: contextlib.nullcontext()
        try:
            with count_reduce_scatters() as calls:
                state, _ = run_steps(step, state, batches)
        finally:
            accum_mod.no_sync = original
        key = "with_skip" if skip else "without_skip"
        result[key] = calls[0]
        params[key] = full_params(state.model)
    result["units"] = sum(
        1 for m in base.modules() if any(True for _ in m.parameters(recurse=False))
    )
    result["diff"] = max_diff(params["with_skip"], params["without_skip"])
    return result


def scenario_fsdp2_vs_ddp(out: Path) -> None:
    """FSDP2 training matches DDP (AdamW, accumulation, each clip mode)."""
    dist.init()
    batches = [shard(b) for b in make_batches(7, batch_size=8)]  # windows of 3, 3, then 1
    base = make_model(0)
    result: dict[str, object] = {"reduce_scatters": fsdp2_reduce_scatters(out, base, batches)}
    for mode, kw in (
        ("norm", {"max_norm": 0.3}),
        ("moving_average", {"tolerance": 1.2}),
        ("value", {"clip_value": 0.01}),
    ):
        step = ftrain.with_clip(
            ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3), mode, **kw
        )
        runs = {}
        for strategy in ("ddp", "fsdp2"):
            model = dist.wrap(copy.deepcopy(base), strategy)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
            state, metrics = run_steps(step, ftrain.TrainState.create(model, opt), batches)
            if strategy == "fsdp2":
                assert dist.strategy(model) == "fsdp2" and dist.is_sharded(model)
                local = sum(p.to_local().numel() for p in model.parameters())
                assert local < sum(p.numel() for p in base.parameters()), "not sharded"
            runs[strategy] = (full_params(state.model), [m.get("grad_norm") for m in metrics])
        result[mode] = {
            "max_diff": max_diff(runs["ddp"][0], runs["fsdp2"][0]),
            "moved": max_diff(runs["ddp"][0], full_params(base)),
            "ddp_norms": runs["ddp"][1],
            "fsdp2_norms": runs["fsdp2"][1],
        }
    dump(out, "fsdp2_vs_ddp", result)


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class Net(torch.nn.Module):
    """Blocks in a ModuleList (FSDP2's default units), with dropout."""

    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def scenario_checkpoint_plans(out: Path) -> None:
    """Activation checkpointing under DDP and FSDP2 with the user's own module names.

    Each plan (names, a pattern, a dynamic plan; the static ones monitored)
    trains like the same wrapper without checkpointing (dropout included: the
    RNG is replayed), resolves to the names one process resolves, and the
    accountant measures the same bytes as on the plain model.
    """
    from ftrain.memory import dynamic, measure_activations, pattern
    from ftrain.memory.plans import resolve_plan

    dist.init()
    r = dist.rank()
    torch.manual_seed(0)
    base = Net()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    batches = [shard(b) for b in batches]
    plans = {
        "names": ["blocks.0"],
        "pattern": pattern(under="blocks", level=1),
        "dynamic": dynamic(2000, warmup_iters=1, candidates=pattern(under="blocks", level=1)),
    }

    def train(strategy, plan):
        model = dist.wrap(copy.deepcopy(base), strategy)
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
        if plan is not None:  # monitored: the accountant runs under the wrapper too
            step = ftrain.with_activation_checkpoint(step, plan, monitor=True)
        torch.manual_seed(10 + r)  # each rank its own dropout masks
        metrics = []
        for b in batches:
            state, m = step(state, b)
            metrics.append({k: float(v) for k, v in m.items()})
        return state, metrics

    result: dict[str, object] = {}
    x = batches[0][0]
    for strategy in ("ddp", "fsdp2"):
        ref_state, _ = train(strategy, None)
        ref = full_params(ref_state.model)
        for name, plan in plans.items():
            state, metrics = train(strategy, plan)
            ck = state.transforms["activation_checkpoint"]
            result[f"{strategy}/{name}"] = {
                "diff": max_diff(ref, full_params(state.model)),
                "moved": max_diff(ref, full_params(base)),
                "modules": list(ck.modules),
                "single_process_modules": list(resolve_plan(plan, base)),
                "checkpointed": [m["checkpointed_modules"] for m in metrics],
                "activation_bytes": [m.get("activation_bytes") for m in metrics],
                "fitted": None if ck.planner is None else ck.planner.fitted,
            }
        # the accountant on the wrapped model measures what it does on the plain one
        model = dist.wrap(copy.deepcopy(base), strategy)
        plain = copy.deepcopy(base)
        result[f"{strategy}/measured"] = [
            measure_activations(m, lambda m=m: m(x).sum(), time=False).total_bytes
            for m in (model, plain)
        ]
    dump(out, "checkpoint_plans", result)


class Probe(torch.nn.Module):
    """An MLP plus a parameter whose gradient is ``s``: an inf lands in one shard."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.probe = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, s):
        return self.net(x), (self.probe * s).sum()


def probe_loss(model, batch):
    x, y, s = batch
    out, extra = model(x, s)
    return torch.nn.functional.mse_loss(out, y) + extra


def scenario_amp_skip(out: Path) -> None:
    """An fp16 overflow on one rank (one shard) is skipped by every rank."""
    dist.init()
    r = dist.rank()
    batches = []
    for i, (x, y) in enumerate(make_batches(4, batch_size=8)):
        s = torch.zeros(4)
        if i == 1 and r == 1:
            s[3] = 3e38  # its gradient overflows: probe[3] lives in rank 1's FSDP2 shard
        batches.append((*shard((x, y)), s))
    torch.manual_seed(0)
    base = Probe()
    step = ftrain.with_amp(ftrain.make_step(probe_loss), "fp16", loss_scale={"init_scale": 256.0})
    result = {}
    for strategy in ("ddp", "fsdp2"):  # FSDP2 computes in fp16 itself (with_amp requires it)
        mp = "fp16" if strategy == "fsdp2" else None
        model = dist.wrap(copy.deepcopy(base), strategy, mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = ftrain.TrainState.create(model, opt)
        skipped, scales, unchanged = [], [], []
        for b in batches:
            before = full_params(state.model)
            state, m = step(state, b)
            skipped.append(bool(m["skipped"]))
            scales.append(float(m["loss_scale"]))
            unchanged.append(max_diff(before, full_params(state.model)) == 0.0)
        result[strategy] = {
            "skipped": skipped,
            "scales": scales,
            "unchanged": unchanged,
            "params": {k: v.tolist() for k, v in full_params(state.model).items()},
        }
    # Without DTensor's reduction rank 0 would not see the overflow: its shard is finite.
    model = dist.wrap(copy.deepcopy(base), "fsdp2")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe_loss(model, batches[1]).mul(256.0).backward()
    local_finite = bool(torch.isfinite(model.probe.grad.to_local()).all())
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler.unscale_(opt)
    found = float(sum(scaler._found_inf_per_device(opt).values()))
    result["shard"] = {"local_finite": local_finite, "found_inf": found}
    dump(out, "amp_skip", result)


class Raise:
    """Raise at the ``StepEnd`` of micro-batch ``at`` (on every rank)."""

    priority = "HIGH"
    name = "raise"

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.state.micro_step == self.at:
                raise RuntimeError(f"stop at micro-step {self.at}")
            yield ev


def _audit(work_dir: Path) -> list[list[str]]:
    """Record every file-system change this process makes under ``work_dir``."""
    root = str(work_dir.resolve())
    changes: list[list[str]] = []
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    events = {"os.rename", "os.replace", "os.remove", "os.unlink", "os.mkdir", "os.rmdir"}
    events |= {"shutil.rmtree", "os.truncate"}

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            written = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & writing
            )
            if not written:
                return
        elif event not in events:
            return
        else:
            path = args[0]
        if isinstance(path, bytes):
            path = path.decode()
        if isinstance(path, (str, os.PathLike)):
            full = os.path.abspath(os.fspath(path))
            if full.startswith(root):
                changes.append([event, os.path.relpath(full, root)])

    sys.addaudithook(hook)
    return changes


def _forbid_tensors_in_objects() -> list[str]:
    """Fail if a tensor is sent through an object collective (issue 12: per-rank files)."""
    import torch.distributed as tdist

    sent: list[str] = []

    def has_tensor(obj) -> bool:
        if isinstance(obj, torch.Tensor):
            return True
        if isinstance(obj, dict):
            return any(has_tensor(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(has_tensor(v) for v in obj)
        return False

    for name in ("gather_object", "all_gather_object", "broadcast_object_list"):
        original = getattr(tdist, name)

        def checked(*args, _original=original, _name=name, **kwargs):
            key, at = ("object_list", 0) if _name == "broadcast_object_list" else ("obj", 0)
            if _name == "all_gather_object":
                at = 1
            payload = args[at] if len(args) > at else kwargs.get(key)
            assert not has_tensor(payload), f"a tensor sent through {_name}"
            sent.append(_name)
            return _original(*args, **kwargs)

        setattr(tdist, name, checked)
    return sent


def scenario_resume(out: Path, strategy: str, phase: str) -> None:
    """Train 3 epochs; ``phase`` "straight+crash" runs it whole and stopped, "resume" restarts.

    DDP stops mid accumulation window (AutoCheckpointHook saves every rank's
    partial gradients); FSDP2 stops at an update (a sharded checkpoint).
    """
    dist.init()
    r = dist.rank()
    every, stop_at = 3, (8 if strategy == "ddp" else 9)
    sent = _forbid_tensors_in_objects()

    def build(work_dir: Path, resume: bool, crash: bool):
        torch.manual_seed(0)
        model = dist.wrap(make_model(0, dropout=0.2), strategy)
        torch.manual_seed(100 + r)  # each rank draws its own dropout masks
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g)
        )
        sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=5)
        loader = StatefulDataLoader(
            data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(1)
        )
        step = ftrain.with_clip(
            ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=every), max_norm=1.0
        )
        hooks = [
            ftrain.TimerHook(),
            ftrain.LoggerHook(every=2, progress=False, console=False),
            ftrain.CheckpointHook(interval=1, max_keep=2),
            ftrain.hooks.AutoCheckpointHook(agree_timeout=30),
        ]
        if crash:
            hooks.append(Raise(stop_at))
        return ftrain.Loop(
            step,
            ftrain.TrainState.create(model, opt),
            loader,
            hooks=hooks,
            epochs=3,
            work_dir=work_dir,
            resume="auto" if resume else None,
        )

    result: dict[str, object] = {"rank": r}
    runs = out / "runs"  # the work directories; everything else goes to `out`
    if phase == "straight+crash":
        changes = _audit(runs)
        lp = build(runs / "straight", resume=False, crash=False)
        state = lp.run()
        torch.save(full_params(state.model), out / f"straight_rank{r}.pt")
        result["straight_steps"] = [state.step, state.micro_step]
        if strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            msd, osd = get_state_dict(state.model, state.optimizer, options=options)
            if dist.is_main():
                torch.save({"model": msd, "optimizer": osd}, out / "straight_full.pt")
        crash = build(runs / "crash", resume=False, crash=True)
        try:
            crash.run()
        except RuntimeError as exc:
            result["stopped"] = str(exc)
        result["changes"] = changes[:]
    else:
        changes = _audit(runs)
        lp = build(runs / "crash", resume=True, crash=False)
        state = lp.run()
        result["resumed_from"] = str(lp.resumed_from)
        torch.save(full_params(state.model), out / f"resumed_rank{r}.pt")
        result["resumed_steps"] = [state.step, state.micro_step]
        result["changes"] = changes[:]
    result["object_collectives"] = len(sent)
    dump(out, f"resume_{strategy}_{phase}", result)


def scenario_persist(out: Path, strategy: str) -> None:
    """The run protocol on 2 ranks: refusal, manifest rebuild, a bad rank file (issue 12)."""
    from ftrain.errors import CheckpointError

    dist.init()
    r = dist.rank()

    def build(work_dir: Path, resume, epochs: int = 1):
        torch.manual_seed(0)
        model = dist.wrap(make_model(0), strategy)
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        batches = [shard(b) for b in make_batches(6, batch_size=8)]
        hooks = [ftrain.CheckpointHook(2, max_keep=None)]
        return ftrain.Loop(ftrain.make_step(mse_loss), state, batches, hooks, epochs=epochs,
                           work_dir=work_dir, resume=resume)  # fmt: skip

    run = out / "run"
    build(run, None).run()  # iter_2, 4, 6
    try:
        build(run, None).run()
        refused = ""
    except CheckpointError as exc:  # on every rank: no rank is left waiting in a collective
        refused = str(exc)
    dist.barrier()
    suffix = ".dcp" if strategy == "fsdp2" else ".pth"
    rank1 = run / "iter_6.dcp" / "rank1.pth" if strategy == "fsdp2" else run / "iter_6.pth.rank1"
    if r == 0:
        (run / "manifest.json").unlink()
        data = rank1.read_bytes()
        rank1.write_bytes(data[: len(data) // 2])  # rank 1's part of the newest is truncated
    dist.barrier()
    lp = build(run, "auto", epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = lp.run()
    resumed = full_params(state.model)
    straight = full_params(build(out / "straight", None, epochs=2).run().model)
    dump(out, f"persist_{strategy}", {
        "refused": refused,
        "resumed_from": lp.resumed_from.name,
        "suffix": suffix,
        "step": state.step,
        "diff": max_diff(resumed, straight),
        "warnings": [str(w.message) for w in caught],
    })  # fmt: skip


def scenario_lonely(out: Path) -> None:
    """Only rank 0 fails: AutoCheckpointHook must give up saving, not hang."""
    dist.init()
    r = dist.rank()

    class RaiseOnRank0(Raise):
        def __call__(self, events):
            for ev in events:
                if r == 0 and isinstance(ev, StepEnd) and ev.state.micro_step == self.at:
                    raise RuntimeError("rank 0 alone")
                yield ev

    model = dist.wrap(make_model(0), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    hooks = [RaiseOnRank0(2), ftrain.hooks.AutoCheckpointHook(agree_timeout=2)]
    batches = [shard(b) for b in make_batches(6, batch_size=8)]
    lp = ftrain.Loop(ftrain.make_step(mse_loss), state, batches, hooks=hooks, work_dir=out / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            lp.run()
        except RuntimeError as exc:
            dump(out, "lonely", {"error": str(exc), "warnings": [str(w.message) for w in caught]})
            os._exit(3)  # a failed rank: torchrun stops the others


def scenario_reshard(out: Path, checkpoint: str) -> None:
    """Load a sharded checkpoint of another world size; compare with its full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    dist.init()
    model = dist.wrap(make_model(0, dropout=0.2), "fsdp2")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    lp = ftrain.Loop(step, ftrain.TrainState.create(model, opt), [], hooks=[], resume=checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = lp.run()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(state.model, state.optimizer, options=options)
    full = torch.load(out / "straight_full.pt", weights_only=False)
    model_diff = max(float((msd[k] - full["model"][k]).abs().max()) for k in full["model"])
    optim_diff = max(
        float((v - full["optimizer"]["state"][name][k]).abs().max())
        for name, st in osd["state"].items()
        for k, v in st.items()
    )
    dump(
        out,
        "reshard",
        {
            "world_size": dist.world_size(),
            "local_numel": sum(p.to_local().numel() for p in state.model.parameters()),
            "model_diff": model_diff,
            "optim_diff": optim_diff,
            "optim_names": sorted(osd["state"]) == sorted(full["optimizer"]["state"]),
            "step": state.step,
            "warned": any("resumed by" in str(w.message) for w in caught),
        },
    )


# ------------------------------------------------------- ranks agree (issue 13)
def _gathered(value: list[float]) -> list[list[float]]:
    """Every rank's list (same length on every rank)."""
    t = torch.tensor(value, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.world_size())]
    torch.distributed.all_gather(out, t)
    return [o.tolist() for o in out]


def _flat(params: dict[str, torch.Tensor]) -> list[float]:
    return torch.cat([v.reshape(-1) for v in params.values()]).tolist()


def _agree_nonfinite(result: dict) -> None:
    """A NaN loss / an infinite gradient on rank 1 only: every rank skips (or raises)."""
    from ftrain.errors import NonFiniteLossError

    r = dist.rank()
    batches = make_batches(3, batch_size=8)
    base = make_model(0)

    def loss_fn(model, batch):
        x, y, kind = batch
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if kind == "nan":
            loss = loss * float("nan")
        elif kind == "inf_grad":  # a term that is 0 (finite loss) with an infinite derivative
            loss = loss + (out - out.detach()).sqrt().sum()
        return loss

    ref_model = copy.deepcopy(base)
    ref = ftrain.TrainState.create(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1))
    plain = ftrain.make_step(mse_loss)
    for i in (0, 2):  # the middle update is skipped
        ref, _ = plain(ref, batches[i])
    ref_params = full_params(ref.model)
    for strategy in ("ddp", "fsdp2"):
        for kind in ("nan", "inf_grad"):
            for clip in (False, True):
                step = ftrain.with_nonfinite_check(ftrain.make_step(loss_fn), "skip")
                if clip:  # the decision reuses the norm clipping computed
                    step = ftrain.with_clip(step, max_norm=1e6)
                model = dist.wrap(copy.deepcopy(base), strategy)
                state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
                skipped = []
                calls = [0]
                original = torch.distributed.all_reduce

                def counting(*args, _calls=calls, _original=original, **kwargs):
                    _calls[0] += 1
                    return _original(*args, **kwargs)

                torch.distributed.all_reduce = counting  # the flag's own all-reduces
                try:
                    for i, b in enumerate(batches):
                        bad = kind if (i == 1 and r == 1) else ""
                        state, m = step(state, (*shard(b), bad))
                        skipped.append(bool(m["skipped"]))
                finally:
                    torch.distributed.all_reduce = original
                params = full_params(state.model)
                key = f"skip/{strategy}/{kind}" + ("/clip" if clip else "")
                result[key] = {
                    "skipped": skipped,
                    "count": state.transforms["nonfinite"].skipped,
                    "finite": all(bool(torch.isfinite(v).all()) for v in params.values()),
                    "vs_ref": max_diff(params, ref_params),
                    "flag_all_reduces": calls[0],
                    "local": _gathered(_flat({k: v for k, v in params.items()})),
                }
        # raise: every rank raises, naming rank 1; the state continues
        step = ftrain.with_nonfinite_check(ftrain.make_step(loss_fn), "raise")
        model = dist.wrap(copy.deepcopy(base), strategy)
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        state, _ = step(state, (*shard(batches[0]), ""))
        try:
            step(state, (*shard(batches[1]), "nan" if r == 1 else ""))
            message = None
        except NonFiniteLossError as exc:
            message = str(exc)
            state = exc.state
        state, _ = step(state, (*shard(batches[2]), ""))  # training goes on, together
        result[f"raise/{strategy}"] = {
            "message": message,
            "vs_ref": max_diff(full_params(state.model), ref_params),
        }


def _agree_eval(result: dict, out: Path) -> None:
    """Evaluation metrics reduced before best-checkpoint and early-stopping hooks see them."""
    r = dist.rank()
    model = dist.wrap(make_model(0), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
    scores = {0: [3.0, 2.0, 1.0, 0.0, -1.0, -2.0], 1: [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]}
    # means over the ranks: 1.5, 2.0, 2.5, 3.0...: only the first is the best (min)
    ev = ftrain.EvalHook(lambda s: {"val_loss": scores[r][s.epoch - 1]})
    early = ftrain.EarlyStoppingHook("val_loss", patience=2)
    best = ftrain.BestCheckpointHook("val_loss")
    data = [shard(b) for b in make_batches(2, batch_size=8)]
    state = ftrain.Loop(
        ftrain.make_step(mse_loss),
        state,
        data,
        hooks=[ev, early, best],
        epochs=6,
        work_dir=out / "agree_eval",
    ).run()
    result["eval"] = {
        "epochs": state.epoch,
        "best": best.best,
        "metrics": ev.metrics,
        "early_best": early.best,
    }


def _agree_summed_loss(result: dict, out: Path) -> None:
    """SummedLoss(loss_sum, n_tokens), unequal micro-batches on 2 ranks == one full-batch mean."""
    r = dist.rank()
    g = torch.Generator().manual_seed(3)
    # per (window, micro-step, rank): a number of valid tokens (the rest is padding)
    lengths = [[[1, 7], [5, 2], [8, 3]], [[2, 2], [6, 1], [4, 8]]]
    seq, d = 8, 8
    data = []
    for window in lengths:
        w = []
        for micro in window:
            per_rank = []
            for n in micro:
                x = torch.randn(seq, d, generator=g)
                y = torch.randn(seq, 4, generator=g)
                mask = torch.zeros(seq, dtype=torch.bool)
                mask[:n] = True
                per_rank.append((x, y, mask))
            w.append(per_rank)
        data.append(w)
    base = make_model(0)

    def loss_fn(model, batch):
        x, y, mask = batch
        per_token = (model(x) - y).pow(2).mean(-1)
        return ftrain.SummedLoss(per_token[mask].sum(), mask.sum())

    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=3)
    model = dist.wrap(copy.deepcopy(base), "ddp")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
    batches = [micro[r] for window in data for micro in window]
    log_dir = out / "agree_tokens"
    state = ftrain.Loop(
        step,
        state,
        batches,
        hooks=[ftrain.LoggerHook(every=1, progress=False, console=False)],
        epochs=1,
        work_dir=log_dir,
    ).run()
    # the plain full-batch loop: per window, the mean over every valid token of both ranks
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for window in data:
        xs = torch.cat([b[0][b[2]] for micro in window for b in micro])
        ys = torch.cat([b[1][b[2]] for micro in window for b in micro])
        loss = (ref(xs) - ys).pow(2).mean(-1).mean()
        ref_losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    # what a mean of per-micro-batch means would have done (the HF #34191 bug)
    naive = copy.deepcopy(base)
    nopt = torch.optim.SGD(naive.parameters(), lr=0.5)
    for window in data:
        total = 0
        for micro in window:
            for x, y, mask in micro:
                total = total + (naive(x) - y).pow(2).mean(-1)[mask].mean() / 6
        total.backward()
        nopt.step()
        nopt.zero_grad()
    logged = []
    if dist.is_main():
        logged = [
            json.loads(line)["loss"]
            for line in (log_dir / "metrics.jsonl").open()
            if "loss" in json.loads(line)
        ]
    result["tokens"] = {
        "vs_ref": max_diff(full_params(state.model), full_params(ref)),
        "naive_vs_ref": max_diff(full_params(naive), full_params(ref)),
        "logged": logged,
        "ref_losses": ref_losses,
    }


def _agree_ema_clone(result: dict) -> None:
    """with_ema and TrainState.clone() under DDP and FSDP2 (no deepcopy of the wrapper)."""
    batches = [shard(b) for b in make_batches(4, batch_size=8)]
    base = make_model(0)
    x_eval = make_batches(1, batch_size=4, seed=9)[0][0]
    outs = {}
    for strategy in (None, "ddp", "fsdp2"):
        model = (
            copy.deepcopy(base) if strategy is None else dist.wrap(copy.deepcopy(base), strategy)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        state = ftrain.TrainState.create(model, opt)
        step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
        step = ftrain.with_ema(step, decay=0.7)
        # one process trains on the whole batches, the ranks on their halves
        data = make_batches(4, batch_size=8) if strategy is None else batches
        state = ftrain.Loop(step, state, data[:3], hooks=[], epochs=1).run()
        # a partial window is pending (3 micro-batches, every=2): clone carries it over
        clone = state.clone()
        assert clone.model is not state.model
        state, _ = step.flush(state) if strategy is None else _flush(step, state)
        clone, _ = step.flush(clone) if strategy is None else _flush(step, clone)
        with swap_ema(state):
            with torch.no_grad():
                swapped = state.model(x_eval).detach()
        with torch.no_grad():
            after = state.model(x_eval).detach()
        averaged = ema_state_dict(state)  # a collective under FSDP2: every rank gathers
        sharded = strategy == "fsdp2" and all(
            hasattr(v, "device_mesh") for v in state.transforms["ema"].params.values()
        )
        outs[strategy or "single"] = {
            "params": full_params(state.model),
            "clone": full_params(clone.model),
            "ema": averaged,
            "swapped": swapped,
            "after": after,
            "sharded": sharded,
            "clone_type": type(dist.unwrap(clone.model)).__name__,
            "clone_strategy": dist.strategy(clone.model),
        }
    single = outs["single"]
    for strategy in ("ddp", "fsdp2"):
        o = outs[strategy]
        ema_vs_single = max(
            float((o["ema"][k] - single["ema"][k]).abs().max()) for k in single["ema"]
        )
        result[f"ema/{strategy}"] = {
            "params_vs_single": max_diff(o["params"], single["params"]),
            "clone_vs_original": max_diff(o["clone"], o["params"]),
            "ema_vs_single": ema_vs_single,
            "swapped_vs_single": float((o["swapped"] - single["swapped"]).abs().max()),
            "after_vs_single": float((o["after"] - single["after"]).abs().max()),
            "swap_changed": float((o["swapped"] - o["after"]).abs().max()),
            "sharded": o["sharded"],
            "clone_strategy": o["clone_strategy"],
        }


def _agree_ema_resume(result: dict, out: Path) -> None:
    """An FSDP2 EMA in a checkpoint resumes exactly (every rank's shards saved)."""
    r = dist.rank()

    def run(work_dir: str, epochs: int, resume: bool):
        model = dist.wrap(make_model(0), "fsdp2")
        state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        data = [shard(b, r) for b in make_batches(3)]
        state = ftrain.Loop(
            ftrain.with_ema(ftrain.make_step(mse_loss), decay=0.7),
            state,
            data,
            hooks=[ftrain.CheckpointHook(interval=1, by_epoch=True)],
            epochs=epochs,
            work_dir=out / "ema_runs" / work_dir,
            resume="auto" if resume else None,
        ).run()
        return ema_state_dict(state), state.transforms["ema"].updates

    straight, n = run("straight", 2, False)
    run("split", 1, False)
    resumed, m = run("split", 2, True)
    result["ema_resume"] = {"updates": [n, m], "diff": max_diff(straight, resumed)}


def _flush(step, state):
    dist.sync_pending_grads(state.model)
    return step.flush(state)


def _agree_meta_init(result: dict) -> None:
    """FSDP2 from the meta device: only shards are allocated, then initialised."""
    with torch.device("meta"):
        model = MLP()
    model = dist.wrap(model, "fsdp2")
    params = list(model.parameters())
    local = sum(p.to_local().numel() for p in params)
    total = sum(p.numel() for p in params)
    full = full_params(model)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, m = ftrain.make_step(mse_loss)(state, shard(make_batches(1)[0]))
    # a model built on the CPU is not moved to the device whole before sharding
    moved = []
    original_to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        moved.append(type(self).__name__)
        return original_to(self, *args, **kwargs)

    torch.nn.Module.to = recording_to
    try:
        dist.wrap(MLP(), "fsdp2")
    finally:
        torch.nn.Module.to = original_to
    result["meta"] = {
        "moved_whole": moved,
        "local": local,
        "total": total,
        "device": str(params[0].to_local().device),
        "finite": all(bool(torch.isfinite(v).all()) for v in full.values()),
        "nonzero": all(float(v.abs().sum()) > 0 for k, v in full.items() if "weight" in k),
        "loss": float(m["loss"]),
    }


def _agree_independent(result: dict) -> None:
    """A plain (unwrapped) model under the process group trains on its own, with no collective.

    Each rank: a summed loss over its own unequal micro-batches, accumulated, with the
    non-finite check; a NaN loss on rank 1 only skips rank 1's update, not rank 0's.
    """
    r = dist.rank()
    g = torch.Generator().manual_seed(10 + r)  # each rank its own data
    lengths = [[1, 5], [6, 2], [3, 4]] if r == 0 else [[2, 6], [1, 1], [5, 3]]
    windows = []
    for window in lengths:
        w = []
        for n in window:
            mask = torch.zeros(6, dtype=torch.bool)
            mask[:n] = True
            w.append((torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g), mask))
        windows.append(w)
    bad = (1, 0) if r == 1 else None  # (window, micro-batch) whose loss is NaN on rank 1

    def loss_fn(model, batch):
        x, y, mask, nan = batch
        total = (model(x) - y).pow(2).mean(-1)[mask].sum()
        return ftrain.SummedLoss(total * float("nan") if nan else total, mask.sum())

    base = make_model(0)
    model = copy.deepcopy(base)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = ftrain.with_nonfinite_check(
        ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2), "skip"
    )
    calls = [0]
    originals = {n: getattr(torch.distributed, n) for n in ("all_reduce", "all_gather")}

    def counting(name):
        def call(*args, **kwargs):
            calls[0] += 1
            return originals[name](*args, **kwargs)

        return call

    for n in originals:
        setattr(torch.distributed, n, counting(n))
    skipped = []
    try:
        for i, window in enumerate(windows):
            for j, (x, y, mask) in enumerate(window):
                state, m = step(state, (x, y, mask, bad == (i, j)))
            skipped.append(bool(m["skipped"]))
    finally:
        for n, f in originals.items():
            setattr(torch.distributed, n, f)
    # the plain one-process loop on this rank's data: per window, the mean over its tokens
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i, window in enumerate(windows):
        if bad is not None and bad[0] == i:
            continue
        xs = torch.cat([x[m] for x, _, m in window])
        ys = torch.cat([y[m] for _, y, m in window])
        (ref(xs) - ys).pow(2).mean(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    result["independent"] = {
        "vs_ref": max_diff(full_params(state.model), full_params(ref)),
        "skipped": skipped,
        "collectives": calls[0],
    }


def scenario_agree(out: Path) -> None:
    """Issue 13: every rank takes the same decision; sharded models everywhere."""
    dist.init()
    result: dict[str, object] = {}
    _agree_nonfinite(result)
    _agree_eval(result, out)
    _agree_summed_loss(result, out)
    _agree_independent(result)
    _agree_ema_clone(result)
    _agree_ema_resume(result, out)
    _agree_meta_init(result)
    dump(out, "agree", result)


def scenario_slurm(out: Path) -> None:
    """Started as a Slurm task (only SLURM_* variables): init() finds the others."""
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ
    info = dist.init()
    t = torch.tensor([float(info.rank + 1)])
    torch.distributed.all_reduce(t)
    dump(
        out,
        "slurm",
        {
            "rank": info.rank,
            "world_size": info.world_size,
            "local_rank": info.local_rank,
            "sum": float(t),
            "master": os.environ["MASTER_ADDR"],
            "port": os.environ["MASTER_PORT"],
        },
    )


# ------------------------------------------------- per-rank checkpoint state
class RandomOrder:
    """A plain re-iterable (no ``state_dict``): each epoch's order is drawn from torch's
    global RNG when iteration starts (like a DataLoader shuffling without a generator);
    each rank has rows of its own."""

    def __init__(self, n: int, rank: int) -> None:
        g = torch.Generator().manual_seed(50 + rank)
        self.x = torch.randn(n, 4, 8, generator=g) * (1 + 3 * rank)
        self.y = torch.randn(n, 4, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        order = torch.randperm(len(self.x)).tolist()
        return iter([(self.x[i], self.y[i]) for i in order])


class RecordBatches:
    """The first number of every batch trained on, by update (every StepEnd)."""

    name = "record_batches"

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def __call__(self, events):
        for ev in events:
            if isinstance(ev, StepEnd):
                self.seen[ev.state.step] = float(ev.batch[0][0, 0])
            yield ev


class RankNote:
    """A user's hook with state of each rank's own (``local_state_keys``) and a shared part."""

    name = "rank_note"
    local_state_keys = ("mine",)

    def __init__(self) -> None:
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return {"mine": f"rank {dist.rank()}", "shared": "same"}

    def load_state_dict(self, saved: dict) -> None:
        self.loaded = dict(saved)

    def __call__(self, events):
        yield from events


def _train_lines(work_dir: Path) -> list[list[float]]:
    path = work_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.open()]
    return [[r["step"], r["loss"]] for r in lines if "loss" in r]


def _ranklocal_resume(out: Path, strategy: str) -> dict[str, object]:
    """Stop at update 3, resume from iter_2 (mid epoch): logs, batches and weights as straight."""
    r = dist.rank()

    def build(work_dir: Path, resume, crash: bool):
        torch.manual_seed(0)
        model = dist.wrap(make_model(0, dropout=0.2), strategy)
        torch.manual_seed(10 + r)  # a seed per rank: dropout masks and each epoch's order
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        record = RecordBatches()
        note = record.note = RankNote()
        hooks = [
            ftrain.LoggerHook(every=4, progress=False, console=False, tensorboard=False),
            ftrain.CheckpointHook(2),
            record,
            note,
        ]
        if crash:
            hooks.append(Raise(3))
        lp = ftrain.Loop(ftrain.make_step(mse_loss), ftrain.TrainState.create(model, opt),
                         RandomOrder(5, r), hooks=hooks, epochs=2, work_dir=work_dir,
                         resume=resume)  # fmt: skip
        return lp, record

    runs = out / f"ranklocal_{strategy}"
    lp, straight = build(runs / "straight", None, False)
    params = full_params(lp.run().model)
    lp, _ = build(runs / "crash", None, True)
    try:
        lp.run()
    except RuntimeError as exc:
        assert "stop at micro-step 3" in str(exc), exc
    lp, resumed = build(runs / "crash", "auto", False)
    state = lp.run()
    assert lp.resumed_from.name.startswith("iter_2"), lp.resumed_from
    return {
        "straight_batches": [straight.seen[k] for k in sorted(straight.seen)],
        "resumed_batches": [resumed.seen[k] for k in sorted(resumed.seen)],
        "resumed_steps": sorted(resumed.seen),
        "straight_lines": _train_lines(runs / "straight"),
        "resumed_lines": _train_lines(runs / "crash"),
        "diff": max_diff(full_params(state.model), params),
        "note": resumed.note.loaded,
    }


def _ranklocal_failed_save(out: Path, strategy: str, steps: int) -> dict[str, object]:
    """Rank 0's background write of iter_2 fails: every rank raises at the same point."""
    import errno

    from ftrain.errors import CheckpointError
    from ftrain.persist.rundir import RunDir

    r = dist.rank()
    torch.manual_seed(0)
    model = dist.wrap(make_model(0), strategy)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [shard(b) for b in make_batches(steps, batch_size=8)]
    lp = ftrain.Loop(ftrain.make_step(mse_loss), state, batches, hooks=[ftrain.CheckpointHook(2)],
                     work_dir=out / f"failed_{strategy}_{steps}")  # fmt: skip
    name = "commit_dir" if strategy == "fsdp2" else "stage"  # both in the background write
    original = getattr(RunDir, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected write failure")
        return original(*args, **kwargs)

    if r == 0:
        setattr(RunDir, name, failing)
    error, at = None, None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lp.run()
    except CheckpointError as exc:
        error, at = str(exc), lp.state.step
    finally:
        setattr(RunDir, name, original)
    return {
        "error": error,
        "at": at,
        "warned": [str(w.message) for w in caught if "injected" in str(w.message)],
    }


def scenario_ranklocal(out: Path) -> None:
    """Per-rank state in checkpoints: the logger's window, the epoch-start RNG, save errors."""
    dist.init(timeout=30)  # a rank left waiting in a collective fails in 30 s, not 30 min
    result: dict[str, object] = {}
    for strategy in ("ddp", "fsdp2"):
        result[f"resume/{strategy}"] = _ranklocal_resume(out, strategy)
        dump(out, "ranklocal", result)
    for strategy, steps in (("ddp", 6), ("ddp", 2), ("fsdp2", 6)):
        result[f"failed/{strategy}/{steps}"] = _ranklocal_failed_save(out, strategy, steps)
        dump(out, "ranklocal", result)


def scenario_preempt(out: Path, phase: str) -> None:
    """Signals that reach one rank, or the ranks at different updates: all stop together.

    ``phase`` "signal": an uninterrupted run; SIGTERM to rank 1 only, then
    SIGINT to rank 0 only (each caught here, then resumed to the end); last
    SIGTERM to rank 0 at one update and to rank 1 at the next, not caught:
    the process exits with its status. "resume": that last run resumed.
    The signal is sent from inside the loss function of micro-step ``c``
    (2 micro-steps per update). Voting after every update
    (``StopVote.interval = 0``), every rank must stop after update
    ``ceil(c / 2) + 1``, the update after the one the first signal reached;
    the last run votes as by default, every 10 ms of updates (steps slowed
    to about 2 ms): the ranks stop together, a few updates later.
    """
    import math
    import random
    import signal
    import time

    dist.init()
    r = dist.rank()
    rng = random.Random(13)
    c_one, c_int, c_both = rng.randint(3, 9), rng.randint(3, 9), rng.randint(3, 9)

    def build(work_dir: Path, kill: tuple[int, int] | None = None, slow: bool = False):
        torch.manual_seed(0)
        model = dist.wrap(make_model(0, dropout=0.2), "ddp")
        torch.manual_seed(100 + r)  # each rank draws its own dropout masks
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(96, 8, generator=g), torch.randn(96, 4, generator=g)
        )
        sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=5)
        loader = StatefulDataLoader(
            data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(1)
        )
        calls = [0]

        def loss_fn(m, batch):
            calls[0] += 1
            if slow:
                time.sleep(0.002)
            if kill is not None and calls[0] == kill[0]:
                os.kill(os.getpid(), kill[1])  # lands in the middle of a step
            return mse_loss(m, batch)

        step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2)
        hooks = [ftrain.CheckpointHook(interval=3, max_keep=1), ftrain.hooks.AutoCheckpointHook()]
        return ftrain.Loop(
            step, ftrain.TrainState.create(model, opt), loader, hooks=hooks, epochs=2,
            work_dir=work_dir, resume="auto",
        )  # fmt: skip

    def stopped(work_dir: Path, kill, catch) -> dict[str, object]:
        lp = build(work_dir, kill)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                lp.run()
                raised = None
            except catch as exc:
                raised = exc
        return {
            "raised": type(raised).__name__,
            "code": getattr(raised, "code", None),
            "at": [lp.state.step, lp.state.micro_step],
            "warnings": [str(w.message) for w in caught],
        }

    def resumed(work_dir: Path) -> float:
        lp = build(work_dir)
        state = lp.run()
        assert lp.resumed_from is not None and lp.resumed_from.name == "interrupted.pth"
        return max_diff(full_params(state.model), torch.load(out / f"straight_rank{r}.pt"))

    result: dict[str, object] = {"rank": r}
    StopVote.interval = 0.0  # a vote after every update: the stop update is known
    if phase == "signal":
        state = build(out / "straight").run()
        torch.save(full_params(state.model), out / f"straight_rank{r}.pt")
        one = (c_one, signal.SIGTERM) if r == 1 else None
        result["one"] = stopped(out / "one", one, SystemExit)
        result["one"]["expected"] = math.ceil(c_one / 2) + 1
        result["one"]["diff"] = resumed(out / "one")
        sigint = (c_int, signal.SIGINT) if r == 0 else None
        result["int"] = stopped(out / "int", sigint, KeyboardInterrupt)
        result["int"]["expected"] = math.ceil(c_int / 2) + 1
        result["int"]["diff"] = resumed(out / "int")
        result["both_first"] = math.ceil(c_both / 2)  # the update rank 0's signal reached
        dump(out, "preempt_signal", result)
        StopVote.interval = 0.01  # as by default: votes every few updates
        build(out / "both", (c_both + 2 * r, signal.SIGTERM), slow=True).run()  # exits
        dump(out, "preempt_signal", {"finished": True})  # (not reached)
    else:
        result["diff"] = resumed(out / "both")
        dump(out, "preempt_resume", result)


SCENARIOS = {
    "preempt": scenario_preempt,
    "lonely": scenario_lonely,
    "persist": scenario_persist,
    "reshard": scenario_reshard,
    "basics": scenario_basics,
    "ddp_vs_single": scenario_ddp_vs_single,
    "nosync": scenario_nosync,
    "fsdp2_vs_ddp": scenario_fsdp2_vs_ddp,
    "amp_skip": scenario_amp_skip,
    "resume": scenario_resume,
    "checkpoint_plans": scenario_checkpoint_plans,
    "agree": scenario_agree,
    "slurm": scenario_slurm,
    "ranklocal": scenario_ranklocal,
}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TQDM_DISABLE", "1")
    name, out, *args = argv
    try:
        SCENARIOS[name](Path(out), *args)
        gc.collect()  # DDP/FSDP2 modules in reference cycles: gone before the group
        dist.barrier()  # nobody tears the group down while another rank still uses it
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
