"""Scenarios of tests/test_ckpt_scale.py (issue 20 item 7), run by ``torchrun`` on 2 gloo ranks.

``torchrun --standalone --nproc-per-node 2 ckpt_worker.py SCENARIO OUT_DIR [ARGS]``

``stager``: FSDP2 background saves through the run's one stager: when its copies finish
relative to the next step (an instrumented stager; events, not clocks), its host buffer
across saves (allocations, storages, bytes), what a save wrote, the seconds it blocked.
``reshard``: a one-process checkpoint resumed by 2 FSDP2 ranks (and one it cannot reshard),
DDP <-> FSDP2 on 2 ranks. Each writes ``OUT_DIR/<name>_rank<r>.json`` for the test.
"""

from __future__ import annotations

import json
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

import ftrain
from ftrain import dist
from ftrain.events import StepEnd
from ftrain.persist.stager import ShardStager

STEPS, SAVED_AT, LR = 6, 3, 0.01


# ------------------------------------------------------------------ shared
class Net(torch.nn.Module):
    """Residual blocks (FSDP2's units), a BatchNorm (buffers the forward changes), a head."""

    def __init__(self, d: int = 8, norm: bool = False, hidden: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(d, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d)
            )
            for _ in range(2)
        )
        self.norm = torch.nn.BatchNorm1d(d) if norm else torch.nn.Identity()
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def net(seed: int = 0, norm: bool = False) -> Net:
    """With ``norm`` (the stager's): a BatchNorm, and wider blocks (about 100 KB of shards and
    AdamW state per rank, so a page is a small part of the host buffer)."""
    torch.manual_seed(seed)
    return Net(norm=norm, hidden=512 if norm else 16)


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    device = next(model.parameters()).device  # a GPU under NCCL (tests/gpu)
    x, y = (t.to(device) for t in batch)
    return torch.nn.functional.mse_loss(model(x), y)


def global_batches(n: int = STEPS, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 8, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(n)
    ]


def rank_batches(r: int | None = None, n: int | None = None) -> list:
    """This rank's rows of every global batch (what one process sees whole)."""
    r = dist.rank() if r is None else r
    n = dist.world_size() if n is None else n
    return [tuple(t.chunk(n)[r] for t in b) for b in global_batches()]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it in the same order)."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def full_state(state: ftrain.TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """The model's parameters and buffers and the optimizer's per-parameter state, whole, by name."""
    model = dist.unwrap(state.model)
    out = {"model": {k: full(v) for k, v in model.state_dict().items()}, "optim": {}}
    for name, p in model.named_parameters():
        for key, v in state.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out["optim"][f"{name}.{key}"] = full(v)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (bitwise)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k], b[k].to(a[k].dtype))]


def dump(out: Path, name: str, data: object) -> None:
    with open(out / f"{name}_rank{dist.rank()}.json", "w") as f:
        json.dump(data, f)


def make_state(strategy: str, optimizer: str = "adamw", norm: bool = False) -> ftrain.TrainState:
    model = net(norm=norm)
    if strategy != "none":
        model = dist.wrap(model, strategy)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=LR)
        if optimizer == "adamw"
        else torch.optim.Adafactor(model.parameters(), lr=LR)
    )
    return ftrain.TrainState.create(model, opt)


class Record:
    """A hook keeping the whole state at ``RunBegin`` (after a resume) and after update
    ``at`` (every rank runs it: gathering shards is a collective)."""

    name = "record"
    priority = "VERY_HIGH"

    def __init__(self, at: int = SAVED_AT) -> None:
        self.at, self.begin, self.saved = at, None, None
        self.cadence = ftrain.Every(steps=at)

    def __call__(self, events):
        first = next(events)
        self.begin = full_state(first.loop.state)
        yield first
        for ev in events:
            if type(ev) is StepEnd and ev.is_update and ev.state.step == self.at:
                self.saved = full_state(ev.state)
            yield ev


# ------------------------------------------------------------------ stager
class Instrumented(ShardStager):
    """Logs when its background copies finish; they start only once the step's pre-update
    wait (the fence) asked for them, so a step that waited before its forward would stall
    here (until the gate times out) and log out of order."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log, self.gate, self.staged, self.deferred = log, threading.Event(), [], []

    def stage(self, state_dict, *, deferred=()):
        self.gate.clear()
        future = super().stage(state_dict, deferred=deferred)
        self.staged.append(future)
        return future

    def wait(self) -> None:
        self.log.append("fence")
        self.gate.set()
        super().wait()

    def run_copies(self, pairs) -> None:
        self.deferred.append(len(pairs))
        opened = self.gate.wait(timeout=120)
        super().run_copies(pairs)
        self.log.append("copied" if opened else "copied (nobody waited)")


def _local_storages(staged: dict) -> list[int]:
    out = []
    for part in staged.values():
        for v in _tensors(part):
            local = v.to_local() if hasattr(v, "to_local") else v
            out.append(local.untyped_storage().data_ptr())
    return out


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _observe(lp: ftrain.Loop, log: list[str], update_hook: bool) -> None:
    model = lp.state.model
    model.register_forward_pre_hook(lambda *a: log.append("forward"))
    if update_hook:  # eager updates only (a compiled update bypasses optimizer hooks)
        lp.state.optimizer.register_step_pre_hook(lambda *a: log.append("update"))


def _default_staging(target: dict) -> list[list[int]]:
    """What DCP's async_save stages with (a new DefaultStager per save, no pinning): the
    host storages of three saves."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    saves, alive = [], []  # each save's copy kept alive: no address can be reused
    for _ in range(3):
        stager = DefaultStager(StagingOptions(False, False, False, False))
        alive.append(stager.stage(target))
        saves.append(_local_storages(alive[-1]))
        stager.close()
    return saves


def _stager_run(out: Path, compiled: bool) -> dict[str, Any]:
    log: list[str] = []
    step = ftrain.make_step(loss_fn)
    if compiled:
        step = ftrain.with_compile(step, backend="eager")
    run_dir = out / f"stager_{'compiled' if compiled else 'eager'}"
    lp = ftrain.Loop(step, make_state("fsdp2", norm=True), rank_batches(), hooks=[],
                     max_steps=STEPS, work_dir=run_dir)  # fmt: skip
    stager = lp.checkpointer.stager = Instrumented(log)
    _observe(lp, log, update_hook=not compiled)
    lp.run(steps=2)
    saved, orders = [], []
    for n in (2, 3, 4):  # three background saves, each followed by one step
        log.clear()
        dist.sync_buffers(lp.state.model)  # equal BatchNorm statistics: what DCP keeps once
        saved.append(full_state(lp.state))
        lp.checkpointer.save(lp.snapshot(), run_dir, f"iter_{n}.pth", "periodic", background=True)
        log.append("saved")
        lp.run(steps=1)
        log.append("stepped")
        orders.append(list(log))
        lp.checkpointer.wait()
    times = lp.checkpointer.times
    res = {
        "orders": orders,
        "storages": [_local_storages(f.result()) for f in stager.staged],
        "allocations": stager.buffer.allocations,
        # copied in the background, of all the tensors staged: the buffers are not
        "deferred": stager.deferred,
        "tensors": len(_tensors(stager.staged[0].result())),
        "buffers": len(list(dist.unwrap(lp.state.model).buffers())),
        "capacity": stager.buffer.capacity,
        "state_bytes": sum(
            (t.to_local() if hasattr(t, "to_local") else t).nbytes
            for f in stager.staged[:1]
            for t in _tensors(f.result())
        ),
        "pinned": stager.buffer.pinned,
        "blocked_s": times.last.blocked_s if times.last else None,
        "fence_s": times.last.fence_s if times.last else None,
        "saves": times.saves,
    }
    res["manifest"] = (
        [e.get("blocked_s") for e in lp.checkpointer.manifest(run_dir).entries]
        if dist.rank() == 0 else []
    )  # fmt: skip
    res["written"] = _check_written(run_dir, saved)
    lp.close()
    return res


def _check_written(run_dir: Path, saved: list[dict]) -> list[list[str]]:
    """Each save read back into a fresh FSDP2 model: the names that differ from the state at
    the save (parameters, BatchNorm statistics, AdamW moments)."""
    diffs = []
    for n, want in zip((2, 3, 4), saved, strict=True):
        fresh = make_state("fsdp2", norm=True)
        lp = ftrain.Loop(ftrain.make_step(loss_fn), fresh, [], hooks=[],
                         resume=run_dir / f"iter_{n}.dcp")  # fmt: skip
        got = full_state(lp.run())
        diffs.append(equal(got["model"], want["model"]) + equal(got["optim"], want["optim"]))
    return diffs


def scenario_stager(out: Path) -> None:
    dist.init()
    res = {"eager": _stager_run(out, compiled=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # with_compile under FSDP2 may fall back, warned
        res["compiled"] = _stager_run(out, compiled=True)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = make_state("fsdp2", norm=True)
    state, _ = ftrain.make_step(loss_fn)(state, rank_batches()[0])
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    res["default_staging"] = _default_staging({"model": model_sd, "optimizer": optim_sd})
    dump(out, "stager", res)
    dist.shutdown()


# ------------------------------------------------------------------ reshard
def _resume(strategy: str, path: Path, optimizer: str = "adamw") -> dict[str, Any]:
    """Resume ``path`` with ``strategy`` on this world size and train to ``STEPS``."""
    rec = Record()
    lp = ftrain.Loop(ftrain.make_step(loss_fn), make_state(strategy, optimizer), rank_batches(),
                     hooks=[rec], max_steps=STEPS, resume=str(path))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = lp.run()
    return {
        "begin": rec.begin,
        "end": full_state(state),
        "warned": [str(w.message) for w in caught if "resumed by" in str(w.message)],
    }


def _straight(strategy: str, run_dir: Path) -> dict[str, Any]:
    """Train ``STEPS`` updates with ``strategy``, a checkpoint after update ``SAVED_AT``."""
    rec = Record()
    hooks = [rec, ftrain.CheckpointHook(interval=SAVED_AT, background=False)]
    lp = ftrain.Loop(ftrain.make_step(loss_fn), make_state(strategy), rank_batches(),
                     hooks=hooks, max_steps=STEPS, work_dir=run_dir)  # fmt: skip
    end = full_state(lp.run())
    return {"saved": rec.saved, "end": end}


def _compare(resumed: dict, saved: dict, end: dict) -> dict[str, Any]:
    return {
        "loaded_differ": equal(resumed["begin"]["model"], saved["model"])
        + equal(resumed["begin"]["optim"], saved["optim"]),
        "end_diff": max_diff(resumed["end"]["model"], end["model"]),
        "warned": resumed["warned"],
    }


def scenario_reshard(out: Path, one_process: str, adafactor: str) -> None:
    dist.init()
    ref = torch.load(Path(one_process).parent / "reference.pt", weights_only=False)
    one = _resume("fsdp2", Path(one_process))
    res = {"one_to_fsdp2": _compare(one, ref["saved"], ref["end"])}
    try:
        _resume("fsdp2", Path(adafactor), optimizer="adafactor")
        res["adafactor"] = None
    except ftrain.errors.CheckpointError as exc:
        res["adafactor"] = str(exc)
    ddp = _straight("ddp", out / "ddp")
    res["ddp_to_fsdp2"] = _compare(_resume("fsdp2", out / "ddp" / "iter_3.pth"), ddp["saved"],
                                   ddp["end"])  # fmt: skip
    fsdp = _straight("fsdp2", out / "fsdp2")
    res["fsdp2_to_ddp"] = _compare(_resume("ddp", out / "fsdp2" / "iter_3.dcp"), fsdp["saved"],
                                   fsdp["end"])  # fmt: skip
    res["ddp_vs_one"] = max_diff(ddp["end"]["model"], ref["end"]["model"])
    dump(out, "reshard", res)
    dist.shutdown()


SCENARIOS = {"stager": scenario_stager, "reshard": scenario_reshard}


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*barrier.*")
    name, out = argv[0], Path(argv[1])
    SCENARIOS[name](out, *argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
