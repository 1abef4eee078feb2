"""Run directories (issue 23 item 3, persistence part of item 7): a lock on every directory
a run writes to, stale manifests, orphans, a loop replaced by a newer one, interrupted
writes, errors naming the file.

Each test checks the files on disk (their listing, the manifest, the metadata a checkpoint
records) or a run that never stopped; kills are injected at a chosen point (a patched
RunDir method raising or exiting there), never timed.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from helpers import make_batches, make_model, mse_loss, read_jsonl

import ftrain
from ftrain.errors import CheckpointError
from ftrain.persist.rundir import RunDir

ROOT = Path(ftrain.__file__).parent.parent  # the ftrain under test, for subprocesses


class Killed(BaseException):
    """Stands for SIGKILL at a chosen point: nothing of the run's cleanup may save it."""


def new_state(seed=0):
    model = make_model(seed)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))


def loop(work_dir, hooks, *, resume=None, n=6, state=None, **kw):
    return ftrain.Loop(ftrain.make_step(mse_loss), state or new_state(), make_batches(n), hooks,
                       work_dir=work_dir, resume=resume, **kw)  # fmt: skip


def params(state):
    return [p.detach().clone() for p in state.model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(params(a), params(b), strict=True))


def listing(d):
    return sorted(p.name for p in Path(d).iterdir() if p.name != ".ftrain.lock")


def manifest(d):
    return orjson.loads((Path(d) / "manifest.json").read_bytes())


def names(d):
    return [e["name"] for e in manifest(d)["files"]]


def meta(path):
    return ftrain.checkpoint.load_checkpoint(path)["meta"]


def kill_at(monkeypatch, owner, method, when):
    """Make ``owner.method`` raise :class:`Killed` on the first call where ``when(*args)``."""
    real = getattr(owner, method)

    def patched(self, *args, **kwargs):
        if when(*args) and not getattr(patched, "fired", False):
            patched.fired = True
            raise Killed(f"{method}{args[:1]}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, patched)
    return patched


# ------------------------------------------------------------------ locks
def test_a_directory_that_is_only_an_out_dir_is_locked_against_a_loop_of_this_process(tmp_path):
    out = tmp_path / "ckpt"
    first = loop(tmp_path / "a", [ftrain.CheckpointHook(2, out_dir=out, background=False)])
    first.run(steps=2)  # paused: it holds its directories
    before = {p.name: p.read_bytes() for p in out.glob("*.pth")}
    second = loop(tmp_path / "b", [ftrain.CheckpointHook(2, out_dir=out)], resume="auto")
    with pytest.raises(CheckpointError) as info:
        second.run()
    msg = str(info.value)
    assert f"{out} is in use by another run (pid {os.getpid()} on" in msg
    assert f"work_dir {tmp_path / 'a'}" in msg and "another loop of this process" in msg
    assert second.state.step == 0 and second.resumed_from is None  # refused before resuming
    assert {p.name: p.read_bytes() for p in out.glob("*.pth")} == before
    first.close()
    assert (
        loop(tmp_path / "b", [ftrain.CheckpointHook(2, out_dir=out)], resume="auto").run().step == 6
    )


_HOLDER = """
import sys
sys.path.insert(0, {tests!r})
import torch, ftrain
from helpers import make_batches, make_model, mse_loss

def hold(events):
    for ev in events:
        yield ev
        if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == 2:
            print("holding", flush=True)
            sys.stdin.readline()  # the test says when to go on

model = make_model(0)
state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
hooks = [ftrain.CheckpointHook(2, out_dir=sys.argv[2], background=False),
         ftrain.hook(hold, priority="LOWEST")]
ftrain.Loop(ftrain.make_step(mse_loss), state, make_batches(6), hooks,
            work_dir=sys.argv[1]).run()
print("done", flush=True)
"""


def test_a_directory_that_is_only_an_out_dir_is_locked_against_another_process(tmp_path):
    out, work = tmp_path / "ckpt", tmp_path / "a"
    script = _HOLDER.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", script, str(work), str(out)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "holding"  # iter_2 written, run live
        second = loop(tmp_path / "b", [ftrain.CheckpointHook(2, out_dir=out)], resume="auto")
        with pytest.raises(CheckpointError) as info:
            second.run()
        msg = str(info.value)
        assert f"{out} is in use by another run (pid {holder.pid} on" in msg
        assert f"work_dir {work}" in msg and "another work_dir (or out_dir)" in msg
        assert second.resumed_from is None and second.state.step == 0  # nothing of it read
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "done"
    finally:
        holder.kill()
        holder.wait()
    assert names(out) == ["iter_2.pth", "iter_4.pth", "iter_6.pth"]


def test_a_directory_reached_by_two_paths_is_locked_once(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run", target_is_directory=True)
    held = []

    def look(events):
        first = next(events)
        held.extend(first.run.checkpointer.locked)
        yield first
        yield from events

    hooks = [ftrain.CheckpointHook(2, out_dir=tmp_path / "link"), ftrain.hook(look)]
    assert loop(tmp_path / "run", hooks).run().step == 6  # not refused by its own lock
    assert held == [os.path.realpath(tmp_path / "run")]
    assert names(tmp_path / "run") == ["iter_2.pth", "iter_4.pth", "iter_6.pth"]


def test_a_lock_path_that_is_a_directory_is_named_and_left_alone(tmp_path):
    (tmp_path / ".ftrain.lock").mkdir()
    with pytest.raises(CheckpointError, match=r"lock file .*\.ftrain\.lock is a directory"):
        loop(tmp_path, [ftrain.CheckpointHook(2)]).run()
    assert (tmp_path / ".ftrain.lock").is_dir() and listing(tmp_path) == []


# ------------------------------------------------------------ bad arguments
def test_empty_and_non_path_directories_are_refused_naming_the_argument(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"Loop: work_dir='' is empty: it would write into"):
        loop("", [ftrain.CheckpointHook(2)])
    with pytest.raises(TypeError, match=r"Loop: work_dir must be a directory path .* got 123"):
        loop(123, [ftrain.CheckpointHook(2)])
    for hook in (ftrain.CheckpointHook, ftrain.hooks.AutoCheckpointHook):
        with pytest.raises(ValueError, match=rf"{hook.__name__}: out_dir=' ' is empty"):
            hook(out_dir=" ")
        with pytest.raises(TypeError, match=rf"{hook.__name__}: out_dir must be .* got 5"):
            hook(out_dir=5)
    with pytest.raises(ValueError, match=r"BestCheckpointHook: out_dir='' is empty"):
        ftrain.BestCheckpointHook("acc", out_dir="")
    assert listing(tmp_path) == []  # nothing written into the current directory


def test_resume_given_a_run_directory_says_so_and_how_to_resume_from_it(tmp_path):
    loop(tmp_path / "run", [ftrain.CheckpointHook(2)]).run()
    with pytest.raises(CheckpointError) as info:
        loop(tmp_path / "new", [], resume=tmp_path / "run")
    msg = str(info.value)
    assert "is a directory, not a checkpoint" in msg and "killed" not in msg
    assert f"work_dir={str(tmp_path / 'run')!r} and resume='auto'" in msg
    assert f"resume={str(tmp_path / 'run' / 'iter_6.pth')!r}" in msg  # the newest


def test_a_full_disk_names_the_file_and_the_free_space(tmp_path, monkeypatch):
    real = RunDir.write_bytes

    def full(self, name, data):
        if name == "manifest.json" and (self.path / "iter_4.pth").exists():
            tmp = self.path / f".manifest.json.tmp-{os.getpid()}"
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        return real(self, name, data)

    monkeypatch.setattr(RunDir, "write_bytes", full)
    with pytest.raises(CheckpointError) as info:
        loop(tmp_path, [ftrain.CheckpointHook(2, background=False)]).run()
    msg = str(info.value)
    assert f"Cannot write {tmp_path / 'manifest.json'} (saving iter_4.pth): the disk of " in msg
    assert "MiB free" in msg and "intact: iter_2.pth" in msg


# ---------------------------------------------------------- interrupted writes
def _interrupt_inside(monkeypatch, name, interrupt):
    """Call ``interrupt()`` once inside ``torch.save``, a few records into checkpoint ``name``
    (its temporary file half written)."""
    import ftrain.persist.files as files

    real, fired = files._HashingWriter.write, []

    def write(self, data):
        if f".{name}{files.TMP_MARK}" in str(self.f.name) and self.size > 100 and not fired:
            fired.append(name)
            interrupt()
        return real(self, data)

    monkeypatch.setattr(files._HashingWriter, "write", write)


def _double_ctrl_c():
    signal.raise_signal(signal.SIGINT)  # held by the loop until a safe point
    signal.raise_signal(signal.SIGINT)  # a second one acts at once: inside the write


def test_ctrl_c_during_a_write_is_an_interruption_naming_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    _interrupt_inside(monkeypatch, "iter_4.pth", _double_ctrl_c)
    hooks = [ftrain.CheckpointHook(2, background=False), ftrain.hooks.AutoCheckpointHook()]
    with pytest.raises(KeyboardInterrupt) as info:  # before: CheckpointError "disk is full"
        loop(tmp_path, hooks).run()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"Interrupted while writing checkpoint {tmp_path / 'iter_4.pth'}" in notes
    assert "previous good checkpoint there is iter_2.pth" in notes and "disk" not in notes
    assert listing(tmp_path) == ["interrupted.pth", "iter_2.pth", "manifest.json"]
    assert meta(tmp_path / "interrupted.pth")["step"] == 4  # the state the cut write held
    resumed = loop(tmp_path, hooks[:1], resume="auto")
    assert same(resumed.run(), loop(tmp_path / "straight", []).run())


_INTERRUPTED = """
import sys, signal
sys.path.insert(0, {tests!r})
import torch, ftrain
import ftrain.persist.files as files
from ftrain.loop.signals import TerminatedError
from helpers import make_batches, make_model, mse_loss

real = files._HashingWriter.write
def write(self, data):  # inside torch.save, a few records into iter_4.pth
    if ".iter_4.pth.tmp" in str(self.f.name) and self.size > 100:
        if sys.argv[2] == "int":
            signal.raise_signal(signal.SIGINT); signal.raise_signal(signal.SIGINT)
        else:
            raise TerminatedError()  # what a SIGTERM raises where the loop does not hold it
    return real(self, data)
files._HashingWriter.write = write
model = make_model(0)
state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
ftrain.Loop(ftrain.make_step(mse_loss), state, make_batches(6),
            [ftrain.CheckpointHook(2, background=False), ftrain.hooks.AutoCheckpointHook()],
            work_dir=sys.argv[1]).run()
"""


# a script's Ctrl-C exits 130 with one line, no traceback (issue 21 item 1; was -SIGINT)
@pytest.mark.parametrize("kind, status", [("int", 130), ("term", 75)])
def test_an_interrupted_write_keeps_the_exit_status_of_the_interruption(tmp_path, kind, status):
    script = _INTERRUPTED.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), kind], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == status, done.stderr[-3000:]  # before: 1, "the disk is full"
    assert "Interrupted while writing checkpoint" in done.stderr
    assert "previous good checkpoint there is iter_2.pth" in done.stderr
    assert "is full" not in done.stderr and "CheckpointError:" not in done.stderr
    assert "interrupted.pth" in names(tmp_path)


def test_a_double_ctrl_c_in_the_first_window_leaves_no_orphan_log_line(tmp_path, monkeypatch):
    # the first Ctrl-C stops the run at micro-batch 2 of 4 (step 0); the second lands while
    # interrupted.pth is written: it is finished (a step-0 checkpoint), so the next run
    # resumes from it and the logger cuts its step-0 line
    _interrupt_inside(monkeypatch, "interrupted.pth", lambda: signal.raise_signal(signal.SIGINT))
    calls = []

    def loss(model, batch):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return mse_loss(model, batch)

    def run(work_dir, loss_fn):
        step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=4)
        hooks = ftrain.default_hooks(log_every=1, progress=False, summary=False)
        lp = ftrain.Loop(step, new_state(), make_batches(8), hooks, work_dir=work_dir,
                         resume="auto")  # fmt: skip
        return lp, lp.run()

    with pytest.warns(UserWarning, match="Interrupted again while saving interrupted.pth"):
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, loss)
    assert meta(tmp_path / "interrupted.pth")["step"] == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]  # the partial
    lp, end = run(tmp_path, mse_loss)
    assert lp.resumed_from == tmp_path / "interrupted.pth"
    _, straight = run(tmp_path / "straight", mse_loss)
    assert same(end, straight)
    got, want = (read_jsonl(d / "metrics.jsonl") for d in (tmp_path, tmp_path / "straight"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


# ----------------------------------------------------------- stale manifests
def test_each_checkpoint_records_its_run_step_and_generation_and_the_manifest_counts(tmp_path):
    lp = loop(tmp_path, [ftrain.CheckpointHook(1, max_keep=2)])
    lp.run()
    m = manifest(tmp_path)
    assert m["run"] == lp.run_id and m["generation"] == 6  # one write per save
    assert [(e["name"], e["generation"]) for e in m["files"]] == [("iter_5.pth", 5),
                                                                  ("iter_6.pth", 6)]  # fmt: skip
    assert meta(tmp_path / "iter_6.pth") == {
        "name": "iter_6.pth", "kind": "periodic", "run": lp.run_id, "step": 6, "micro_step": 6,
        "epoch": 0, "dir": m["dir"], "generation": 6,
    }  # fmt: skip


def test_a_rolled_back_manifest_is_detected_and_newer_checkpoints_never_overwritten(tmp_path):
    def hooks():
        return [ftrain.CheckpointHook(2, max_keep=None)]

    loop(tmp_path, hooks(), max_steps=2).run()
    old = (tmp_path / "manifest.json").read_bytes()  # a backup taken at step 2
    loop(tmp_path, hooks(), resume="auto", max_steps=6).run()
    newer = {n: (tmp_path / n).read_bytes() for n in ("iter_4.pth", "iter_6.pth")}
    (tmp_path / "manifest.json").write_bytes(old)  # the backup restored over the newer one
    with pytest.warns(UserWarning, match="is older than checkpoints"):
        with pytest.raises(CheckpointError, match=r"holds checkpoints of another run.*iter_6"):
            loop(tmp_path, hooks()).run()  # a fresh run would write iter_2... over them
    assert {n: (tmp_path / n).read_bytes() for n in newer} == newer
    (tmp_path / "manifest.json").write_bytes(old)  # restored again
    lp = loop(tmp_path, hooks(), resume="auto", epochs=2)
    with pytest.warns(
        UserWarning,
        match=r"manifest.json \(generation 1\) is older than .*"
        r"iter_4.pth \(step 4, generation 2\), iter_6.pth",
    ):
        end = lp.run()  # fmt: skip
    assert lp.resumed_from.name == "iter_6.pth"  # before: iter_2, overwriting iter_4 and 6
    assert same(end, loop(tmp_path / "straight", [], epochs=2).run())
    assert names(tmp_path) == [f"iter_{n}.pth" for n in range(2, 13, 2)]


def test_a_rebuilt_manifest_orders_by_step_never_by_file_time(tmp_path):
    loop(tmp_path, [ftrain.CheckpointHook(2, max_keep=None)]).run()
    (tmp_path / "manifest.json").unlink()
    for age, n in enumerate((2, 4, 6)):  # iter_6 the oldest file, iter_2 the newest
        os.utime(tmp_path / f"iter_{n}.pth", (1e9 - age * 1000, 1e9 - age * 1000))
    lp = loop(tmp_path, [], resume="auto", epochs=2)
    with pytest.warns(UserWarning, match=r"missing: rebuilt .* by their steps \(newest: iter_6"):
        end = lp.run()
    assert lp.resumed_from.name == "iter_6.pth"  # before: iter_2 (the newest file time)
    assert same(end, loop(tmp_path / "straight", [], epochs=2).run())
    assert [e["name"] for e in manifest(tmp_path)["files"]] == ["iter_2.pth", "iter_4.pth",
                                                                "iter_6.pth"]  # fmt: skip


def test_resume_picks_the_newest_step_across_directories_not_the_newest_time(tmp_path):
    out = tmp_path / "ckpt"

    def stop_at_5(events):
        for ev in events:
            yield ev
            if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == 5:
                raise KeyboardInterrupt

    def hooks():
        return [ftrain.CheckpointHook(2, out_dir=out), ftrain.hooks.AutoCheckpointHook()]

    with pytest.raises(KeyboardInterrupt):
        loop(tmp_path, [*hooks(), ftrain.hook(stop_at_5, priority="HIGH")]).run()
    m = manifest(out)
    for e in m["files"]:
        e["time"] += 3600  # out_dir's files written "later" than work_dir's interrupted.pth
    (out / "manifest.json").write_bytes(orjson.dumps(m))
    lp = loop(tmp_path, hooks(), resume="auto", epochs=2)
    end = lp.run()
    assert lp.resumed_from == tmp_path / "interrupted.pth"  # step 5; before: ckpt/iter_4.pth
    assert same(end, loop(tmp_path / "straight", [], epochs=2).run())


# ------------------------------------------------------------------ orphans
def _foreign_files(tmp_path, d):
    """An unknown file and another directory's checkpoint, copied into ``d``."""
    (d / "notes.pth").write_bytes(b"not a checkpoint")
    loop(tmp_path / "elsewhere", [ftrain.CheckpointHook(6)]).run()
    shutil.copy(tmp_path / "elsewhere" / "iter_6.pth", d / "copied_iter_6.pth")


def test_orphans_of_a_kill_between_the_manifest_write_and_the_deletes_are_collected(
    tmp_path, monkeypatch
):
    d = tmp_path / "run"
    hooks = [ftrain.CheckpointHook(1, max_keep=2, background=False)]
    kill_at(monkeypatch, RunDir, "delete", lambda name: name == "iter_1.pth")
    with pytest.raises(Killed):  # at iter_3's commit: the manifest dropped iter_1, not deleted
        loop(d, hooks).run()
    monkeypatch.undo()
    assert names(d) == ["iter_2.pth", "iter_3.pth"] and (d / "iter_1.pth").exists()
    _foreign_files(tmp_path, d)
    seen = []

    def look(events):
        seen.append(listing(d))  # at the start, before any save
        yield from events

    lp = loop(d, [*hooks, ftrain.hook(look)], resume="auto", epochs=2)
    end = lp.run()
    assert "iter_1.pth" not in seen[0]  # collected on the next start (before: kept for good)
    assert listing(d) == ["copied_iter_6.pth", "iter_11.pth", "iter_12.pth", "manifest.json",
                          "notes.pth"]  # fmt: skip
    assert same(end, loop(tmp_path / "straight", [], epochs=2).run())


def test_orphans_are_collected_after_each_commit_and_other_runs_files_never(tmp_path):
    d = tmp_path / "run"
    loop(d, [ftrain.CheckpointHook(1, max_keep=None)], max_steps=2).run()  # run A: iter_1, 2
    m = manifest(d)
    m["files"] = [e for e in m["files"] if e["name"] != "iter_1.pth"]  # run A's, unlisted
    (d / "manifest.json").write_bytes(orjson.dumps(m))
    loop(tmp_path / "b", [ftrain.CheckpointHook(2)], max_steps=2).run()  # run B's iter_2

    def orphan_at_4(events):  # an orphan of run B (the run now) appears mid-run
        for ev in events:
            yield ev
            if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == 4:
                shutil.copy(d / "iter_3.pth", d / "iter_3_copy.pth")

    hooks = [ftrain.CheckpointHook(1, max_keep=None, background=False),
             ftrain.hook(orphan_at_4, priority="LOWEST")]  # fmt: skip
    seen = []

    def look(events):
        for ev in events:
            yield ev
            if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == 5:
                seen.append(listing(d))  # iter_5 committed (the checkpoint hook runs first)

    hooks.append(ftrain.hook(look, priority="LOWEST"))
    b = loop(d, hooks, resume=tmp_path / "b" / "iter_2.pth", max_steps=6)  # B into A's dir
    b.run()
    assert "iter_3_copy.pth" not in seen[0]  # collected by iter_5's commit, no restart needed
    assert "iter_1.pth" in listing(d)  # run A's unlisted file: never B's to delete


def test_max_keep_never_prunes_another_runs_files_in_the_directory(tmp_path):
    # another run's checkpoint resumed into a directory holding its own run's files
    here, there = tmp_path / "here", tmp_path / "there"
    loop(here, [ftrain.CheckpointHook(1, max_keep=None)], max_steps=3).run()
    own = {n: (here / n).read_bytes() for n in ("iter_1.pth", "iter_2.pth", "iter_3.pth")}
    loop(there, [ftrain.CheckpointHook(10)], max_steps=10).run()
    hooks = [ftrain.CheckpointHook(1, max_keep=1)]
    lp = loop(here, hooks, resume=there / "iter_10.pth", max_steps=13)
    lp.run()
    assert [n for n in own if not (here / n).exists()] == []  # no run filter: all 3 pruned
    assert {n: (here / n).read_bytes() for n in own} == own
    assert names(here) == ["iter_1.pth", "iter_2.pth", "iter_3.pth", "iter_13.pth"]


def test_the_manifest_is_written_before_any_file_it_drops_is_deleted(tmp_path, monkeypatch):
    d = tmp_path / "run"
    hooks = [ftrain.CheckpointHook(1, max_keep=2, background=False)]
    written = []

    def when(name, data):  # the manifest write of iter_3's commit, which drops iter_1
        written.append(name)
        return name == "manifest.json" and b"iter_3.pth" in data

    kill_at(monkeypatch, RunDir, "write_bytes", when)
    with pytest.raises(Killed):
        loop(d, hooks).run()
    monkeypatch.undo()
    # the kill left the old manifest: every file it names is there (iter_1 not yet deleted)
    assert names(d) == ["iter_1.pth", "iter_2.pth"]
    assert all((d / n).exists() for n in names(d))
    lp = loop(d, hooks, resume="auto", epochs=2)
    with pytest.warns(UserWarning, match=r"older than checkpoints .*iter_3.pth"):
        end = lp.run()  # iter_3 was complete on disk: taken in and resumed from
    assert lp.resumed_from.name == "iter_3.pth"
    assert listing(d) == ["iter_11.pth", "iter_12.pth", "manifest.json"]
    assert same(end, loop(tmp_path / "straight", [], epochs=2).run())


# ----------------------------------------------------- a loop replaced by a newer one
def test_a_loop_closed_by_a_newer_loop_in_its_directory_refuses_to_run(tmp_path):
    def cell():
        lp = loop(tmp_path, [ftrain.CheckpointHook(2), ftrain.hooks.AutoCheckpointHook()],
                  resume="auto", epochs=2)  # fmt: skip
        lp.run(steps=3)
        return lp

    first = cell()
    with pytest.warns(UserWarning, match="Closing a paused run"):
        second = cell()  # the notebook cell run again
    second.run()
    files = {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")}
    for start in (first.run, lambda: next(iter(first))):
        with pytest.raises(RuntimeError, match=rf"closed by a newer run in {tmp_path} "):
            start()  # before: it ran on from step 3 and wrote over the newer run's files
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")} == files
    assert same(second.state, loop(tmp_path / "straight", [], epochs=2).run())


def test_a_finished_loop_refuses_to_run_again_after_a_newer_one_used_its_directory(tmp_path):
    hooks = [ftrain.CheckpointHook(2)]
    first = loop(tmp_path, hooks, max_steps=4)
    first.run()
    loop(tmp_path, [ftrain.CheckpointHook(2)], resume="auto", max_steps=6).run()
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")}
    first.max_steps = 8
    with pytest.raises(RuntimeError, match="closed by a newer run"):
        first.run()
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")} == before
    again = loop(tmp_path / "other", [], max_steps=2)
    again.run()
    again.max_steps = 4
    assert again.run().step == 4  # no newer loop there: it continues
