"""Issue 20 item 7: checkpoints at scale.

One host allocation for a background save's copy (views into it, reused, at most 1.25x the
state), device copies waited for by their event (faked on the CPU), the seconds a save
holds training (recorded, logged, warned about above 10% of the time between saves), the
pre-update wait of a background FSDP2 save (also under ``with_compile``), and, on 2 gloo
ranks (``tests/ckpt_worker.py``): the FSDP2 stager's copies overlapping the next step, its
one reused buffer, and whole checkpoints (one process, DDP) resharded into FSDP2 and back.
"""

from __future__ import annotations

import doctest
import importlib
import json
import math
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss, read_jsonl

import ftrain
from ftrain.persist.checkpointer import Checkpointer
from ftrain.persist.hostbuffer import MAX_SLACK, HostBuffer
from ftrain.persist.snapshot import Snapshot
from ftrain.state import add_reader

TESTS = Path(__file__).parent
WORKER = TESTS / "ckpt_worker.py"


def launch(scenario: str, out: Path, *args: str, nproc: int = 2, timeout: float = 900) -> None:
    """Run a ckpt_worker scenario under torchrun; fail with its output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), scenario, str(out), *args]  # fmt: skip
    root = str(TESTS.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path,
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {scenario} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def results(out: Path, name: str, nproc: int = 2) -> list[dict]:
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(nproc)]


def test_doctests():
    for name in ("hostbuffer", "stager", "savetime", "reshard", "writer"):
        module = importlib.import_module(f"ftrain.persist.{name}")
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, name


# ------------------------------------------------------ one host allocation
def transformer_state() -> dict[str, torch.Tensor]:
    """The tensors of a small transformer layer and its AdamW state: sizes no power of two."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=96, nhead=4, dim_feedforward=200)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(5, 2, 96)).sum().backward()
    opt.step()
    state = dict(layer.state_dict())
    for i, s in enumerate(opt.state.values()):
        state.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return state


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_background_copies_share_one_allocation_reused_across_saves(tmp_path):
    state = transformer_state()
    snap = Snapshot({"format": "demo", "state": state}, step=0, micro_step=0, epoch=0)
    ckpt = Checkpointer(torch.nn.Module())
    seen, at_save = [], []
    for i in range(3):
        at_save.append({k: v.clone() for k, v in state.items()})
        ckpt.save(snap, tmp_path, f"iter_{i}.pth", "periodic", background=True)
        ckpt.wait()
        views = ckpt.host_buffer.current
        seen.append([v.untyped_storage().data_ptr() for v in views])
        for t in state.values():
            if t.is_floating_point():
                t.add_(1)  # training goes on between saves
    buf, total = ckpt.host_buffer, nbytes(state.values())
    # one allocation, made by the first save; every view a slice of it, each its own storage
    assert buf.allocations == 1 and seen[0] == seen[1] == seen[2]
    base = min(seen[0])
    ends = [v.untyped_storage().data_ptr() + v.untyped_storage().nbytes() for v in views]
    assert base + buf.capacity >= max(ends) and len(set(seen[0])) == len(views) == len(state)
    assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in views)
    # bytes held: the state's, page-rounded (<= 1.25x); pinned tensor by tensor, the pinned
    # caching allocator would round each to a power of two
    per_tensor = sum(2 ** math.ceil(math.log2(max(1, nbytes([t])))) for t in state.values())
    print(f"\nstate {total} B; one buffer {buf.capacity} B ({buf.capacity / total:.3f}x); "
          f"per-tensor power-of-two pinning {per_tensor} B ({per_tensor / total:.3f}x)")  # fmt: skip
    assert total <= buf.capacity <= MAX_SLACK * total and per_tensor > MAX_SLACK * total
    for i in range(3):  # each save wrote the state as it was then
        saved = ftrain.checkpoint.load_checkpoint(tmp_path / f"iter_{i}.pth")["state"]
        for k, v in at_save[i].items():
            assert torch.equal(saved[k], v) and saved[k].stride() == state[k].stride(), k
    ckpt.close()
    assert buf.current == [] and buf.capacity == 0


def test_layout_packs_without_gaps_keeps_strides_and_reallocates_only_beyond_the_slack():
    buf = HostBuffer(pin=None)
    a = [torch.ones(3, dtype=torch.bool), torch.ones(5, dtype=torch.float64), torch.ones(2, 3).t()]
    views = buf.views(a)
    assert [v.dtype for v in views] == [t.dtype for t in a]
    assert views[2].stride() == (1, 3) and buf.nbytes == nbytes(a) == 3 + 40 + 24
    ptrs = sorted(v.data_ptr() for v in views)
    assert ptrs[0] % 8 == 0 and views[1].data_ptr() % 8 == 0  # widest first: aligned
    assert buf.views([t.clone() for t in a]) is views  # same layout: the same views
    buf.views([torch.ones(4, 4)])  # smaller, but the buffer is kept while within 1.25x...
    assert buf.allocations == 1
    big = [torch.ones(2**16)]
    buf.views(big)  # ... and a larger state gets a new allocation
    assert buf.allocations == 2 and buf.capacity >= nbytes(big)
    buf.views([torch.ones(2**10)])  # far smaller: not held at 64x the bytes
    assert buf.allocations == 3 and buf.capacity <= MAX_SLACK * 4096


def test_the_buffer_is_pinned_once_and_unpinned_with_the_run(tmp_path):
    calls = []

    def pin(address, size):
        calls.append(("pin", address, size))
        return lambda: calls.append(("unpin", address, size))

    ckpt = Checkpointer(torch.nn.Module())
    ckpt.host_buffer = HostBuffer(pin=pin)
    state = transformer_state()
    for i in range(3):
        snap = Snapshot({"format": "demo", "state": state}, step=i, micro_step=i, epoch=0)
        ckpt.save(snap, tmp_path, f"iter_{i}.pth", "periodic", background=True)
    ckpt.wait()
    base = min(v.data_ptr() for v in ckpt.host_buffer.current)
    assert calls == [("pin", base, ckpt.host_buffer.capacity)] and ckpt.host_buffer.pinned
    ckpt.close()
    assert calls[1:] == [("unpin", base, calls[0][2])]


class FakeEvent:
    """Stands for the CUDA event recorded after the device copies."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append(f"event waited on {threading.current_thread().name}")


def test_the_writer_waits_for_the_copies_event_not_the_device(tmp_path, monkeypatch):
    import ftrain.persist.files as files
    import ftrain.persist.writer as writer

    log: list[str] = []
    live = {"w": torch.arange(4.0)}

    def record(sources):  # called once the copies are queued: the views hold them
        assert torch.equal(ckpt.host_buffer.current[0], live["w"])
        log.append("event recorded")
        return [FakeEvent(log)]

    real = files.stage_atomic

    def stage(obj, path):
        log.append("write")
        return real(obj, path)

    monkeypatch.setattr(writer, "record_copies", record)
    monkeypatch.setattr(files, "stage_atomic", stage)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("device sync"))
    ckpt = Checkpointer(torch.nn.Module())
    snap = Snapshot({"format": "demo", "state": live}, step=1, micro_step=1, epoch=0)
    ckpt.save(snap, tmp_path, "a.pth", "periodic", background=True)
    ckpt.close()
    assert log == ["event recorded", "event waited on ftrain-checkpoint", "write"]


# ------------------------------------------------------ blocked seconds
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_blocked_seconds_are_recorded_and_warned_above_a_tenth_of_the_interval(
    tmp_path, monkeypatch
):
    import ftrain.persist.files as files

    clock = FakeClock()
    real = files.stage_atomic

    def slow_write(obj, path):  # a synchronous write taking 20 s of the fake clock
        clock.now += 20.0
        return real(obj, path)

    monkeypatch.setattr(files, "stage_atomic", slow_write)
    ckpt = Checkpointer(torch.nn.Linear(2, 1), clock=clock)

    def save(step):
        snap = Snapshot({"format": "demo"}, step=step, micro_step=step, epoch=0)
        return ckpt.save(snap, tmp_path, f"iter_{step}.pth", "periodic")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(1)  # the first save: no interval to judge against
        clock.now = 180.0
        entry = save(2)  # 20 s of the 180 s since the first save began: 11%
        clock.now = 1000.0
        clock.now = 200.0
        save(3)  # 20 s of 20 s: warned once per run
    blocked = [str(w.message) for w in caught if "blocked training" in str(w.message)]
    assert len(blocked) == 1, blocked
    assert "iter_2.pth blocked training for 20.00 s, 11% of the 180 s" in blocked[0]
    assert "Save less often (a longer interval)" in blocked[0]
    assert entry["blocked_s"] == 20.0 and ckpt.times.last.blocked_s == 20.0
    assert ckpt.times.saves == 3 and ckpt.times.blocked_s == 60.0
    manifest = ckpt.manifest(tmp_path)
    assert [e["blocked_s"] for e in manifest.entries] == [20.0, 20.0, 20.0]


def test_a_save_waiting_for_the_previous_write_says_so(tmp_path, monkeypatch):
    import ftrain.persist.files as files

    gate, writing = threading.Event(), threading.Event()
    real = files.stage_atomic

    def gated(obj, path):
        writing.set()
        gate.wait()
        return real(obj, path)

    monkeypatch.setattr(files, "stage_atomic", gated)
    ckpt = Checkpointer(torch.nn.Module())
    waits, waiting = [], threading.Event()
    monkeypatch.setattr(ckpt.times, "waited", lambda *a: waits.append(a))
    wait = ckpt.wait

    def waiting_wait(*args):
        waiting.set()
        wait(*args)

    monkeypatch.setattr(ckpt, "wait", waiting_wait)

    def save(step):
        snap = Snapshot({"format": "demo", "x": torch.ones(3)}, step=step, micro_step=step, epoch=0)
        ckpt.save(snap, tmp_path, f"iter_{step}.pth", "periodic", background=True)

    save(1)
    writing.wait()  # the write of iter_1 runs (held)
    waiting.clear()
    second = threading.Thread(target=save, args=(2,))
    second.start()
    waiting.wait()  # iter_2 waits for it
    gate.set()
    second.join()
    wait()  # iter_2 written
    ckpt.save(Snapshot({"format": "demo"}, 3, 3, 0), tmp_path, "iter_3.pth", "periodic")
    ckpt.close()
    # iter_2 found iter_1 still writing and waited; iter_3 found nothing running
    assert [(name, previous) for name, previous, _ in waits] == [("iter_2.pth", "iter_1.pth")]

    # what it says (the seconds from a fake clock)
    from ftrain.persist.savetime import SaveClock

    clock = FakeClock()
    times = SaveClock(clock)
    times.start(step=4)
    with pytest.warns(UserWarning, match=r"iter_4.pth waited 3.50 s for the previous") as w:
        times.waited("iter_4.pth", "iter_3.pth", 3.5)
    assert "(iter_3.pth)" in str(w[0].message) and "faster storage" in str(w[0].message)


def test_the_logger_shows_the_seconds_saves_blocked(tmp_path):
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    hooks = [ftrain.LoggerHook(every=2, progress=False), ftrain.CheckpointHook(interval=3)]
    lp = ftrain.Loop(ftrain.make_step(mse_loss), state, make_batches(8), hooks, epochs=1,
                     work_dir=tmp_path)  # fmt: skip
    lp.run()
    lines = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl")}
    # saves after updates 3 and 6 (the logger runs before them at the same update): shown at
    # the next log, 4 and 8; the last save (8) is after the last log
    shown = sorted(s for s, r in lines.items() if "perf/ckpt_blocked_s" in r)
    assert shown == [4, 8] and all(lines[s]["perf/ckpt_blocked_s"] > 0 for s in shown)
    entries = lp.checkpointer.manifest(tmp_path).entries
    assert [e["name"] for e in entries] == ["iter_3.pth", "iter_6.pth", "iter_8.pth"]
    assert all(e["blocked_s"] > 0 for e in entries)


# ------------------------------------------------------ the pre-update wait
@pytest.mark.parametrize("compiled", [False, True])
def test_a_registered_copy_finishes_before_the_update_changes_the_weights(compiled):
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_clip(ftrain.make_step(mse_loss), "norm", max_norm=1.0)
    if compiled:  # its update runs compiled: no optimizer hook sees it
        step = ftrain.with_compile(step, backend="eager")
    batches = make_batches(3)
    state, _ = step(state, batches[0])  # compiled: the programs exist now
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def reader():  # a background copy's wait: the weights must still be those it copies
        seen.append(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))

    add_reader(state, reader)
    state, _ = step(state, batches[1])
    assert seen == [True]  # called once, before the update
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    state, _ = step(state, batches[2])
    assert seen == [True]  # one-shot


def test_swapping_in_the_ema_or_loading_waits_for_a_registered_copy():
    from ftrain.transforms.ema import swap_ema

    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = ftrain.with_ema(ftrain.make_step(mse_loss)).init(state)
    seen = []
    add_reader(state, lambda: seen.append("swap"))
    with swap_ema(state):
        pass
    saved = ftrain.checkpoint.state_dict(state)
    add_reader(state, lambda: seen.append("load"))
    ftrain.checkpoint.load_state_dict(state, saved)
    assert seen == ["swap", "load"]


# ------------------------------------------------------ 2 gloo ranks
@pytest.mark.dist
def test_fsdp2_background_saves_overlap_the_next_step_with_one_reused_buffer(tmp_path):
    launch("stager", tmp_path)
    for r, res in enumerate(results(tmp_path, "stager")):
        for kind in ("eager", "compiled"):
            run = res[kind]
            # the copies of the parameters and AdamW state finish while the next step runs:
            # after its forward, when its update asks for them (events, not clocks); the
            # compiled update is not seen by optimizer hooks, the order up to it is the same
            want = ["saved", "forward", "fence", "copied"]
            want += ["update", "stepped"] if kind == "eager" else ["stepped"]
            assert run["orders"] == [want] * 3, (r, kind, run["orders"])
            # the parameters' shards and AdamW's state in the background; the BatchNorm
            # statistics (which the next forward changes) before save() returned
            assert run["buffers"] == 3 and run["deferred"] == [run["tensors"] - 3] * 3, run
            # one host buffer for the run: allocated by the first save, the same storages after
            assert run["allocations"] == 1 and len(set(map(tuple, run["storages"]))) == 1
            assert 10**5 < run["state_bytes"] <= run["capacity"] <= 1.25 * run["state_bytes"]
            # each save holds the state at the save: weights, AdamW moments, and the BatchNorm
            # statistics the next forward changed (copied before it ran)
            assert run["written"] == [[], [], []], (r, kind, run["written"])
            assert run["saves"] == 3 and run["blocked_s"] > 0 and run["fence_s"] >= 0
            if r == 0:
                assert len(run["manifest"]) == 3 and all(b > 0 for b in run["manifest"])
        # before: DCP's default staging allocates new host memory for every tensor, every save
        # (three saves' copies alive at once: none shares a storage with another save's)
        before = res["default_staging"]
        assert (
            len(set(before[0]) & set(before[1])) == 0 and len(set(before[1]) & set(before[2])) == 0
        )
        print(f"\nrank {r}: host allocations per save: DCP default {len(before[0])}, "
              f"ftrain stager 0 (1 at the first save); host bytes "
              f"{res['eager']['capacity']} for {res['eager']['state_bytes']} B of shards; "
              f"blocked {res['eager']['blocked_s']:.4f} s + {res['eager']['fence_s']:.4f} s "
              "before the next update")  # fmt: skip


def one_process_run(directory: Path, optimizer: str) -> Path:
    """Train in this process (no torchrun) with a checkpoint after update 3; keep the whole
    state then and at the end beside it."""
    from ckpt_worker import SAVED_AT, STEPS, Record, full_state, global_batches, loss_fn, make_state

    rec = Record()
    hooks = [rec, ftrain.CheckpointHook(interval=SAVED_AT, background=False)]
    lp = ftrain.Loop(ftrain.make_step(loss_fn), make_state("none", optimizer), global_batches(),
                     hooks=hooks, max_steps=STEPS, work_dir=directory)  # fmt: skip
    end = full_state(lp.run())
    torch.save({"saved": rec.saved, "end": end}, directory / "reference.pt")
    return directory / f"iter_{SAVED_AT}.pth"


@pytest.mark.dist
def test_whole_checkpoints_reshard_into_fsdp2_and_sharded_ones_into_ddp(tmp_path):
    one = one_process_run(tmp_path / "one", "adamw")
    factored = one_process_run(tmp_path / "adafactor", "adafactor")
    launch("reshard", tmp_path, str(one), str(factored))
    for res in results(tmp_path, "reshard"):
        # 1 process -> 2 FSDP2 ranks: the shards hold bitwise the weights and AdamW state of
        # the one-process run after the load; training goes on equal to its continuation
        # (the same combined batches) within fp32 rounding of the mean over 2 ranks
        one_to = res["one_to_fsdp2"]
        assert one_to["loaded_differ"] == [] and one_to["end_diff"] <= 1e-6, one_to
        assert any("written by 1 process(es) and is resumed by 2" in w for w in one_to["warned"])
        # DDP <-> FSDP2 on 2 ranks, both ways
        for way in ("ddp_to_fsdp2", "fsdp2_to_ddp"):
            assert res[way]["loaded_differ"] == [] and res[way]["end_diff"] <= 1e-6, res[way]
        assert res["ddp_vs_one"] <= 1e-6
        # what cannot be resharded: Adafactor's factored moments are not shaped like their
        # parameter
        msg = res["adafactor"]
        assert msg is not None and "written by 1 process(es) with whole tensors" in msg, msg
        assert "FSDP2 over 2 process(es)" in msg, msg
        assert "row_var" in msg or "col_var" in msg, msg
        assert "Resume with the number of processes" in msg and "load_weights" in msg
        print(f"\nend diffs: 1->FSDP2 {one_to['end_diff']:.2e}, DDP->FSDP2 "
              f"{res['ddp_to_fsdp2']['end_diff']:.2e}, FSDP2->DDP "
              f"{res['fsdp2_to_ddp']['end_diff']:.2e}")  # fmt: skip
