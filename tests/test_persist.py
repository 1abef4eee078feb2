"""ftrain.persist: run directories that never lose a run, clear errors, one home (issue 12).

Each test checks files on disk or a plain-PyTorch reference; the distributed
rules are in tests/test_dist.py (2 processes, gloo).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import orjson
import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.errors import CheckpointError

ROOT = Path(__file__).parent.parent


def new_state(seed=0, hidden=16, opt="sgd"):
    model = make_model(seed, d_hidden=hidden)
    if opt == "sgd":
        o = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        o = torch.optim.AdamW(model.parameters(), lr=0.01)
    return ftrain.TrainState.create(model, o)


def fit(work_dir, *, steps=None, epochs=1, n=6, hooks=None, resume=None, state=None, **kw):
    if hooks is None:
        hooks = [ftrain.CheckpointHook(2, max_keep=None)]
    return ftrain.Loop(
        ftrain.make_step(mse_loss), state or new_state(), make_batches(n), hooks,
        work_dir=work_dir, resume=resume, epochs=epochs, max_steps=steps, **kw,
    ).run()  # fmt: skip


def flip_tensor_byte(path):
    """Flip one bit inside the largest tensor record of a torch.save file (CRC-covered bytes)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(Path(path).read_bytes())
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 1
    Path(path).write_bytes(bytes(data))


def manifest(d):
    return orjson.loads((d / "manifest.json").read_bytes())["files"]


def params(state):
    return [p.detach().clone() for p in state.model.parameters()]


# ------------------------------------------------------------------ one home
def test_dist_is_a_leaf_and_import_ftrain_stays_cheap():
    import ast

    tree = ast.parse((ROOT / "ftrain" / "dist.py").read_text())
    top = tree.body  # module level: a leaf imports nothing of ftrain (SyncBuffersHook, a hook,
    # is only re-exported lazily from ftrain.hooks.sync_buffers)
    imported = {n.module for n in top if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("ftrain")} == set()
    code = "import sys, ftrain; print('torch.distributed.checkpoint' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    inner = torch.nn.Linear(2, 1)
    assert ftrain.dist.unwrap(torch.compile(torch.nn.DataParallel(inner), backend="eager")) is inner


def test_checkpoint_keys_never_carry_wrapper_prefixes_and_load_into_any_wrapper(tmp_path):
    model = make_model(0)
    compiled = torch.compile(torch.nn.DataParallel(model), backend="eager")
    assert "_orig_mod.module.fc1.weight" in compiled.state_dict()
    state = ftrain.TrainState.create(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    state = fit(tmp_path / "a", state=state, steps=4)
    saved = ftrain.checkpoint.load_checkpoint(tmp_path / "a" / "iter_4.pth")
    assert sorted(saved["state"]["model"]) == sorted(make_model(0).state_dict())
    # into a plain model (resume), and into a compiled one (weights)
    plain = new_state(1)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), plain, [], [], work_dir=tmp_path / "a",
                     resume=tmp_path / "a" / "iter_4.pth")  # fmt: skip
    resumed = lp.run()
    for a, b in zip(params(resumed), params(state), strict=True):
        assert torch.equal(a, b)
    other = torch.compile(make_model(2), backend="eager")
    assert ftrain.checkpoint.load_weights(other, tmp_path / "a" / "iter_4.pth") == ([], [])
    assert torch.equal(other._orig_mod.fc1.weight, model.fc1.weight)


class _HoldsAModule(torch.nn.Module):
    """A model whose own submodule is called ``module`` (as DDP's wrapper's is)."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.module(x)


def test_a_submodule_called_module_keeps_its_keys(tmp_path):
    # a review found every "module." stripped, so such a model could not resume
    torch.manual_seed(0)
    model = _HoldsAModule()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.make_step(mse_loss)
    for batch in make_batches(2):
        state, _ = step(state, batch)
    saved = ftrain.checkpoint.state_dict(state)
    assert sorted(saved["model"]) == ["module.bias", "module.weight"]
    torch.manual_seed(1)
    other = _HoldsAModule()
    fresh = ftrain.TrainState.create(other, torch.optim.SGD(other.parameters(), lr=0.1))
    fresh = ftrain.checkpoint.load_state_dict(fresh, saved)
    for a, b in zip(fresh.model.parameters(), state.model.parameters(), strict=True):
        assert torch.equal(a, b)
    path = tmp_path / "w.pth"
    torch.save({"module.weight": saved["model"]["module.weight"] + 1,
                "module.bias": saved["model"]["module.bias"]}, path)  # fmt: skip
    assert ftrain.checkpoint.load_weights(other, path) == ([], [])
    assert torch.equal(other.module.weight, saved["model"]["module.weight"] + 1)
    # a DDP-era file of a plain model ("module." on every key) still loads into it
    plain = torch.nn.Linear(8, 4)
    torch.save({"module.weight": torch.ones(4, 8), "module.bias": torch.zeros(4)}, path)
    assert ftrain.checkpoint.load_weights(plain, path) == ([], [])
    assert torch.equal(plain.weight, torch.ones(4, 8))


# ------------------------------------------------------------ run directories
_HOLD = """
import sys, time
from ftrain.persist.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_process_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {holder.pid} on"):
            fit(tmp_path)
        assert not list(tmp_path.glob("*.pth"))  # refused before writing anything
    finally:
        holder.kill()  # SIGKILL: the lock file stays, its holder is dead
        holder.wait()
    assert (tmp_path / ".ftrain.lock").exists()
    state = fit(tmp_path)
    assert state.step == 6 and not (tmp_path / ".ftrain.lock").exists()  # removed at the end


def test_resume_auto_without_a_manifest_continues_from_the_newest_file_that_verifies(tmp_path):
    straight = fit(tmp_path / "straight", epochs=2)
    fit(tmp_path / "run")  # iter_2, 4, 6
    (tmp_path / "run" / "manifest.json").unlink()
    flip_tensor_byte(tmp_path / "run" / "iter_6.pth")  # a bit flip in the newest file
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(6),
                     [ftrain.CheckpointHook(2, max_keep=None)], epochs=2,
                     work_dir=tmp_path / "run", resume="auto")  # fmt: skip
    with pytest.warns(UserWarning, match="manifest.json is missing: rebuilt"):
        state = lp.run()
    assert lp.resumed_from.name == "iter_4.pth"  # not step 0, not the corrupt iter_6
    assert state.step == 12
    for a, b in zip(params(state), params(straight), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"files": {"a": 1}}', b'{"files": [1, 2]}', b'{"files": [{"step": 2}]}',
     b'{"files": [{"name": "iter_2.pth", "step": "two"}]}', b"[]"],
)  # fmt: skip
def test_a_malformed_manifest_is_rebuilt_with_a_warning(tmp_path, content):
    fit(tmp_path)
    (tmp_path / "manifest.json").write_bytes(content)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(6), [],
                     work_dir=tmp_path, resume="auto", epochs=2)  # fmt: skip
    with pytest.warns(UserWarning, match="is (malformed|unreadable): rebuilt it from the 3"):
        lp.run()
    assert lp.resumed_from.name == "iter_6.pth"
    assert [e["name"] for e in manifest(tmp_path)] == ["iter_2.pth", "iter_4.pth", "iter_6.pth"]


def test_every_load_verifies_the_checksum(tmp_path):
    fit(tmp_path)
    path = tmp_path / "iter_4.pth"
    flip_tensor_byte(path)
    with pytest.raises(CheckpointError, match="iter_4.pth is corrupt"):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(6), [],
                   work_dir=tmp_path, resume=path, epochs=2).run()  # fmt: skip
    (tmp_path / "manifest.json").unlink()  # no recorded checksum: the zip's CRC-32s
    with pytest.raises(CheckpointError, match="iter_4.pth is corrupt"):
        ftrain.checkpoint.load_checkpoint(path)


def test_an_unreadable_newest_file_falls_back_to_the_previous_good_one(tmp_path, monkeypatch):
    import ftrain.persist.files as files

    fit(tmp_path)
    real = files.sha256_of

    def unreadable(path):
        if Path(path).name == "iter_6.pth":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(files, "sha256_of", unreadable)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(6), [],
                     work_dir=tmp_path, resume="auto")  # fmt: skip
    with pytest.warns(UserWarning, match="Skipping checkpoint .*iter_6.pth.*Permission denied"):
        lp.run()
    assert lp.resumed_from.name == "iter_4.pth"


def test_when_no_checkpoint_loads_auto_refuses_to_restart_from_step_0(tmp_path):
    fit(tmp_path)
    for p in tmp_path.glob("iter_*.pth"):
        p.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="Skipping"):
        with pytest.raises(CheckpointError, match="none loads.*overwrite them"):
            fit(tmp_path, resume="auto")
    assert all(p.read_bytes() == b"garbage" for p in tmp_path.glob("iter_*.pth"))


def test_resume_auto_also_looks_in_the_checkpoint_hooks_out_dir(tmp_path):
    out = tmp_path / "ckpts"

    def hooks():
        return [ftrain.CheckpointHook(2, out_dir=out)]

    fit(tmp_path / "work", hooks=hooks())
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(6), hooks(),
                     work_dir=tmp_path / "work", resume="auto", epochs=2)  # fmt: skip
    assert lp.run().step == 12 and lp.resumed_from == out / "iter_6.pth"


def test_orphans_of_a_kill_are_collected(tmp_path):
    fit(tmp_path, hooks=[ftrain.CheckpointHook(1, max_keep=None)])  # iter_1 ... iter_6
    # a kill between writing a file and pruning: 6 files of this run, max_keep=2
    (tmp_path / ".iter_7.pth.tmp-12345").write_bytes(b"half")
    (tmp_path / ".iter_8.dcp.tmp-12345").mkdir()
    fit(tmp_path, hooks=[ftrain.CheckpointHook(100, max_keep=2, save_last=False)],
        resume="auto", epochs=1)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_5.pth", "iter_6.pth", "manifest.json",
    ]  # fmt: skip


def test_writer_threads_end_with_their_run(tmp_path):
    before = threading.active_count()
    for i in range(30):
        fit(tmp_path / str(i), n=2, hooks=[ftrain.CheckpointHook(1)])
    assert threading.active_count() <= before
    assert not [t for t in threading.enumerate() if t.name == "ftrain-checkpoint"]


def test_an_unwritable_directory_fails_before_step_1(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    calls = []

    def loss(model, batch):
        calls.append(1)
        return mse_loss(model, batch)

    with pytest.raises(CheckpointError, match=r"file/run cannot be a run directory: .*work_dir"):
        ftrain.Loop(ftrain.make_step(loss), new_state(), make_batches(2),
                   [ftrain.CheckpointHook(1)], work_dir=tmp_path / "file" / "run").run()  # fmt: skip
    assert calls == []


# ---------------------------------------------------------------- clear errors
def _steps_taken(fn):
    calls = []

    def loss(model, batch):
        calls.append(1)
        return mse_loss(model, batch)

    return loss, calls


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"n": 4}, r"iter_6.pth was written for data of 6 batches per epoch.*has 4.*same data"),
        ({"opt": "adamw"}, r"iter_6.pth was written with optimizer SGD.*uses AdamW.*load_weights"),
        ({"hidden": 32}, r"iter_6.pth does not fit.*fc1.weight: saved \(16, 8\), model \(32, 8\)"),
    ],
)
def test_resuming_into_a_changed_setup_names_the_file_what_differs_and_the_fix(
    tmp_path, change, pattern
):
    fit(tmp_path)
    loss, calls = _steps_taken(mse_loss)
    state = new_state(hidden=change.get("hidden", 16), opt=change.get("opt", "sgd"))
    with pytest.raises(CheckpointError, match=pattern):
        ftrain.Loop(ftrain.make_step(loss), state, make_batches(change.get("n", 6)), [],
                   work_dir=tmp_path, resume="auto", epochs=2).run()  # fmt: skip
    assert calls == []  # before step 1


def test_disk_full_is_one_checkpoint_error_naming_the_directory_space_and_good_files(
    tmp_path, monkeypatch
):
    import ftrain.persist.files as files

    real = files.stage_atomic

    def full(obj, path):
        if Path(path).name not in ("iter_2.pth",):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64")
        return real(obj, path)

    monkeypatch.setattr(files, "stage_atomic", full)
    hooks = [ftrain.CheckpointHook(2, background=False), ftrain.hooks.AutoCheckpointHook()]
    with pytest.warns(UserWarning, match="Not saving a checkpoint.*interrupted.pth: the disk"):
        with pytest.raises(CheckpointError) as info:
            fit(tmp_path, hooks=hooks)
    msg = str(info.value)
    assert type(info.value) is CheckpointError
    assert f"iter_4.pth: the disk of {tmp_path} is full (" in msg and "MiB free" in msg
    assert "intact: iter_2.pth" in msg and "resume='auto'" in msg
    assert [e["name"] for e in manifest(tmp_path)] == ["iter_2.pth"]


def evaluating_every_2(losses):
    """A hook adding an ``Evaluated`` with the next of ``losses`` after every 2nd update."""
    values = iter(losses)

    def evaluate(events):
        for ev in events:
            yield ev
            if isinstance(ev, ftrain.events.StepEnd) and ev.state.step % 2 == 0:
                metrics = {"val/loss": next(values)}
                yield ftrain.events.Evaluated(ev.loop, ev.state, metrics, by_epoch=False)

    return evaluate


def test_an_interrupt_during_the_best_write_keeps_exactly_one_committed_best(tmp_path, monkeypatch):
    import ftrain.persist.files as files

    real = files.stage_atomic
    hits = []

    def interrupted_once(obj, path):
        if Path(path).name == "best_val_loss_iter_4.pth" and not hits:
            hits.append(path)
            raise KeyboardInterrupt  # Ctrl-C lands while the best file is written
        return real(obj, path)

    monkeypatch.setattr(files, "stage_atomic", interrupted_once)
    evaluate = evaluating_every_2([3.0, 2.0, 1.0])

    def hooks():
        return [ftrain.hook(evaluate, priority="HIGH"), ftrain.BestCheckpointHook("val/loss"),
                ftrain.hooks.AutoCheckpointHook()]  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path, hooks=hooks())
    best = sorted(p.name for p in tmp_path.glob("best_*"))
    assert best == ["best_val_loss_iter_4.pth"]  # the new best was committed, the old removed
    saved = ftrain.checkpoint.load_checkpoint(tmp_path / "interrupted.pth")
    assert saved["hooks"]["best_val_loss"] == {"best": 2.0, "best_file": best[0]}
    kinds = [(e["name"], e["kind"]) for e in manifest(tmp_path)]
    assert ("best_val_loss_iter_4.pth", "best") in kinds and len(kinds) == 2


def test_stale_best_files_left_by_a_kill_are_removed_on_resume(tmp_path):
    evaluate = evaluating_every_2([3.0, 2.0, 1.0, 0.5, 0.4, 0.3])

    def hooks():
        return [ftrain.hook(evaluate, priority="HIGH"), ftrain.BestCheckpointHook("val/loss"),
                ftrain.CheckpointHook(2)]  # fmt: skip

    fit(tmp_path, hooks=hooks())
    # a kill after a new best file was recorded but before the old one was deleted
    entries = manifest(tmp_path)
    best = next(e for e in entries if e["kind"] == "best")
    stale = {**best, "name": "best_val_loss_iter_2.pth", "seq": -1}
    (tmp_path / stale["name"]).write_bytes((tmp_path / best["name"]).read_bytes())
    (tmp_path / "manifest.json").write_bytes(orjson.dumps({"files": [stale, *entries]}))
    fit(tmp_path, hooks=hooks(), resume="auto", epochs=2)
    assert sorted(p.name for p in tmp_path.glob("best_*")) == ["best_val_loss_iter_12.pth"]


# ------------------------------------------------------------------------ RNG
class _FakeCuda:
    def __init__(self, monkeypatch, count):
        self.set = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d=0: self.set.append((d, s)))


def test_cuda_rng_of_a_rank_goes_to_the_device_of_its_local_rank(monkeypatch):
    from ftrain.persist.rng import restore_rng

    fake = _FakeCuda(monkeypatch, 4)
    restore_rng({"cuda_device": {"index": 0, "state": "s"}}, local_rank=3)
    assert fake.set == [(3, "s")]
    monkeypatch.setenv("LOCAL_RANK", "2")
    restore_rng({"cuda_device": {"index": 0, "state": "t"}})
    assert fake.set[-1] == (2, "t")


def test_cuda_rng_with_another_device_count_warns_what_is_not_restored(monkeypatch):
    from ftrain.persist.rng import restore_rng

    fake = _FakeCuda(monkeypatch, 2)
    with pytest.warns(UserWarning, match=r"3 device\(s\), and 2 are visible: the states of "
                                         r"devices \[2\] are not restored"):  # fmt: skip
        restore_rng({"cuda": ["a", "b", "c"]})
    assert fake.set == [(0, "a"), (1, "b")]
    fake.set.clear()
    with pytest.warns(UserWarning, match=r"devices \[1\] keep their current states"):
        restore_rng({"cuda": ["a"]})
    assert fake.set == [(0, "a")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_rng({"cuda": ["a", "b"]})  # same count: silent


def test_persist_doctests():
    import doctest
    import importlib

    for name in ("files", "manifest", "writer", "lock", "rng", "checkpointer", "resume",
                 "weights", "agree", "state", "rundir", "snapshot"):  # fmt: skip
        module = importlib.import_module(f"ftrain.persist.{name}")
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, name


def _record_saves(monkeypatch, second):
    """Record the order of two background saves: a's write is blocked on a gate that only the
    second save (run on the thread ``second[0]``) opens when it waits for a. If the second
    save copied its snapshot (into a's buffers) or wrote before waiting, the order shows it,
    whatever the machine's speed. Returns the order and an event set once a's write began."""
    import ftrain.persist.checkpointer as checkpointer
    import ftrain.persist.files as files
    from ftrain.persist.writer import AsyncWriter

    order, gate, entered = [], threading.Event(), threading.Event()
    real_stage, real_wait = files.stage_atomic, AsyncWriter.wait
    real_copy_to_host = checkpointer.copy_to_host

    def gated(obj, path):
        order.append(f"write {Path(path).name}")
        if Path(path).name == "a.pth":
            entered.set()
            gate.wait()
        out = real_stage(obj, path)
        order.append(f"wrote {Path(path).name}")
        return out

    def wait(self):
        if threading.current_thread() is second[0] and not gate.is_set():
            order.append("b waits")
            gate.set()
        return real_wait(self)

    def copy_to_host(obj, buffer):
        if threading.current_thread() is second[0]:
            order.append("copy b")
        return real_copy_to_host(obj, buffer)

    monkeypatch.setattr(files, "stage_atomic", gated)
    monkeypatch.setattr(AsyncWriter, "wait", wait)
    monkeypatch.setattr(checkpointer, "copy_to_host", copy_to_host)
    return order, entered


def test_one_background_save_in_flight_and_host_buffers_reused(tmp_path, monkeypatch):
    import ftrain.persist.checkpointer as checkpointer
    from ftrain.bench.checkpoint import make_state
    from ftrain.persist.snapshot import Snapshot

    second = [None]
    order, entered = _record_saves(monkeypatch, second)
    state = make_state(1)
    snap = Snapshot({"format": "bench", "state": state}, step=0, micro_step=0, epoch=0)
    ckpt = checkpointer.Checkpointer(torch.nn.Module())
    ckpt.save(snap, tmp_path, "a.pth", "periodic", background=True)  # returns: the copy is made
    first = [t.data_ptr() for t in ckpt.host_buffer.current]
    original = {k: v.clone() for k, v in state.items()}
    for t in state.values():
        t.add_(1)  # training goes on: the write holds the snapshot, not the live tensors
    second[0] = threading.Thread(
        target=ckpt.save, args=(snap, tmp_path, "b.pth", "periodic"), kwargs={"background": True}
    )
    entered.wait()  # a's write is under way (and held)
    second[0].start()
    second[0].join()
    assert [
        t.data_ptr() for t in ckpt.host_buffer.current
    ] == first  # b's copy went into a's buffers
    ckpt.close()
    assert order == ["write a.pth", "b waits", "wrote a.pth", "copy b", "write b.pth",
                     "wrote b.pth"]  # one save in flight  # fmt: skip
    assert ckpt.host_buffer.current == []  # freed with the run
    a = ftrain.checkpoint.load_checkpoint(tmp_path / "a.pth")["state"]
    b = ftrain.checkpoint.load_checkpoint(tmp_path / "b.pth")["state"]
    for k, v in state.items():
        assert torch.equal(b[k], v) and torch.equal(a[k], original[k])


def test_a_rank_captures_the_cuda_state_of_its_own_device(monkeypatch):
    import ftrain.persist.rng as rng

    monkeypatch.setattr(rng, "_cuda_ready", lambda: True)
    monkeypatch.setattr(rng, "_distributed", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d="cuda": f"state of {d}")
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("all devices"))
    assert rng.capture_rng()["cuda_device"] == {"index": 1, "state": "state of 1"}


def test_a_ddp_checkpoint_of_the_previous_format_still_loads(tmp_path):
    # ftrain 0.1.0 wrote every rank's part into rank 0's file ("ranks"); it still resumes
    fit(tmp_path, hooks=[ftrain.CheckpointHook(4)], steps=4)
    saved = torch.load(tmp_path / "iter_4.pth", weights_only=False)
    state = saved["state"]
    part = {"rng": state["rng"], "grads": state["grads"], "transforms": state["transforms"],
            "data": saved["data"]}  # fmt: skip
    saved["ranks"] = [part, part]
    saved["dist"] = {"world_size": 2, "strategy": "ddp"}
    old = tmp_path / "old" / "iter_4.pth"
    ftrain.persist.files.save_atomic(saved, old)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(6), [],
                     work_dir=tmp_path / "old", resume=old, max_steps=6)  # fmt: skip
    with pytest.warns(UserWarning, match="written by 2 process"):
        assert lp.run().step == 6


# ----------------------------------------------------------------- bad input
def _loop(work_dir, resume=None, **kw):
    return ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(6),
        hooks=[ftrain.CheckpointHook(2, max_keep=None)], work_dir=work_dir, resume=resume, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("spelling", ["Auto", "AUTO", " auto"])
def test_resume_auto_in_any_case_continues_the_run(tmp_path, spelling):
    first = _loop(tmp_path, max_steps=4).run()
    resumed = _loop(tmp_path, resume=spelling)
    end = resumed.run()
    assert resumed.resumed_from == tmp_path / "iter_4.pth"
    assert end.step == 6 and first.step == 4
    straight = _loop(tmp_path / "straight").run()  # one run, never stopped
    for a, b in zip(straight.model.parameters(), end.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_with_an_unknown_value_names_the_valid_ones(tmp_path):
    # refused when the Loop is built: nothing trained, nothing written
    with pytest.raises(CheckpointError, match=r"resume='latest': no checkpoint at .*'auto'.*None"):
        _loop(tmp_path, resume="latest")
    assert not list(tmp_path.glob("*.pth"))
    with pytest.raises(TypeError, match=r"resume=3 is not understood: resume takes 'auto'"):
        _loop(tmp_path, resume=3)
    with pytest.raises(ValueError, match=r"resume='auto' needs work_dir="):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(2), resume="Auto")


def test_a_work_dir_that_is_a_file_is_named_and_left_alone(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    for work_dir in (path, path / "run"):
        with pytest.raises(CheckpointError, match=r"notes\.txt is a file .*Pass a directory path"):
            _loop(work_dir).run()
    assert path.read_text() == "keep me"
