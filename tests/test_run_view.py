"""The run's written-down interface (issue 23, item 6): what hooks and the checkpointer read.

References: the loop's own configuration, an uninterrupted run (for a save made by a user
hook through ``run.checkpointer.save(run.snapshot(), ...)``), and the source files
(no untyped loop, no probing of it, file access only through the run directory).
"""

import re
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.events import EpochEnd, RunBegin, StepEnd
from ftrain.hooks.base import OutputDir
from ftrain.persist.checkpointer import Checkpointer
from ftrain.persist.snapshot import Snapshot
from ftrain.run import Run

ROOT = Path(__file__).resolve().parent.parent


def new_state():
    model = make_model()
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def accum_step():
    return ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)


def test_the_loop_is_a_run_and_every_event_carries_it(tmp_path):
    seen = []

    def look(events):
        for ev in events:
            seen.append((ev.run, ev.loop))
            yield ev

    lp = ftrain.Loop(accum_step(), new_state(), make_batches(4), [look], work_dir=tmp_path)
    assert isinstance(lp, Run)
    assert isinstance(lp.checkpointer, Checkpointer)  # made with the loop, before it runs
    ckpt = lp.checkpointer
    lp.run()
    assert seen and all(run is lp and loop is lp for run, loop in seen)
    assert lp.checkpointer is ckpt


def test_a_hook_reads_the_run_through_the_typed_view(tmp_path):
    got = {}

    def read(events):
        for ev in events:
            run: Run = ev.run
            if isinstance(ev, RunBegin):
                got["begin"] = (run.work_dir, run.max_steps, run.epochs, run.batches_per_epoch,
                                run.resumed_from, run.in_epoch, run.state.step)  # fmt: skip
                got["timers"] = run.hooks.of_type(ftrain.TimerHook)
            elif isinstance(ev, StepEnd) and ev.state.micro_step == 3:
                got["mid"] = (run.in_epoch, run.batch_in_epoch, run.totals.micro_batches)
                got["snapshot"] = run.snapshot()
            elif isinstance(ev, EpochEnd):
                got["end"] = (run.in_epoch, run.batch_in_epoch, run.step.pending(run.state))
                run.request_stop("enough")
            yield ev

    timer = ftrain.TimerHook()
    lp = ftrain.Loop(accum_step(), new_state(), make_batches(5), [read, timer, ftrain.LoggerHook(console=False)],
                     epochs=3, work_dir=tmp_path)  # fmt: skip
    lp.run()
    assert got["begin"] == (tmp_path, None, 3, 5, None, False, 0)
    assert got["timers"] == [timer]
    assert got["mid"] == (True, 3, 3)
    snap = got["snapshot"]
    assert isinstance(snap, Snapshot) and (snap.step, snap.micro_step, snap.epoch) == (1, 3, 0)
    assert snap.pending == 1 and snap.run_id == lp.run_id and snap.state is not None
    assert dict(snap.local_hook_keys) == {"logger": ("window",)}
    assert snap.payload["loop"]["batch_in_epoch"] == 3
    assert got["end"] == (False, 0, 0)  # the partial window of epoch 0 was applied
    assert lp.stop_reason == "enough" and lp.state.epoch == 1


def test_a_save_of_a_snapshot_from_a_hook_resumes_exactly(tmp_path):
    ref = ftrain.Loop(accum_step(), new_state(), make_batches(7), [], epochs=2)
    ref.run()

    def save_at_step_5(events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.state.micro_step == 5:  # mid window
                run = ev.run
                entry = run.checkpointer.save(run.snapshot(), run.work_dir, "mine.pth", "periodic")
                assert entry["step"] == 2 and entry["run"] == run.run_id
                raise KeyboardInterrupt
            yield ev

    lp = ftrain.Loop(accum_step(), new_state(), make_batches(7), [save_at_step_5], epochs=2,
                     work_dir=tmp_path)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    resumed = ftrain.Loop(accum_step(), new_state(), make_batches(7), [], epochs=2,
                          work_dir=tmp_path, resume="auto")  # fmt: skip
    resumed.run()
    assert resumed.resumed_from == tmp_path / "mine.pth"
    for a, b in zip(resumed.state.model.parameters(), ref.state.model.parameters()):
        assert torch.equal(a, b)


class SavesElsewhere:
    """A user hook writing checkpoints to its own directory, declared with ``output_dirs``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def output_dirs(self, work_dir):
        return [OutputDir(self.out_dir, checkpoints=True), OutputDir(self.out_dir / "plots")]

    def __call__(self, events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.is_update and ev.state.step == 2:
                ev.run.checkpointer.save(ev.run.snapshot(), self.out_dir, "at_2.pth", "periodic")
            yield ev


def test_resume_auto_looks_where_the_hooks_declare_they_write_checkpoints(tmp_path):
    out = tmp_path / "elsewhere"
    hook = SavesElsewhere(out)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(3), [hook],
                     work_dir=tmp_path / "run")  # fmt: skip
    plan = lp.hooks
    assert plan.checkpoint_dirs(tmp_path / "run") == [tmp_path / "run", out]  # not plots/
    lp.run()
    again = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(3), [SavesElsewhere(out)],
                        epochs=2, work_dir=tmp_path / "run", resume="auto")  # fmt: skip
    again.run(steps=1)
    assert again.resumed_from == out / "at_2.pth"
    again.close()


def _sources(folder: str):
    return sorted((ROOT / "ftrain" / folder).rglob("*.py"))


def test_no_module_takes_an_untyped_loop_or_probes_it():
    hits = []
    for path in _sources(""):
        text = path.read_text()
        for pattern in (
            r"loop: Any",
            r"getattr\(\s*loop\b",
            r"getattr\(\s*(fn|h|hook), \"out_dir\"",
        ):
            hits += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert hits == []


WATCHED = {"ftrain.persist.checkpointer", "ftrain.persist.manifest", "ftrain.persist.resume",
           "ftrain.hooks.checkpoint"}  # fmt: skip


def test_persistence_touches_files_only_through_the_run_directory(tmp_path, monkeypatch):
    # the checkpointer, the manifest, resume and the checkpoint hooks reach files only through
    # RunDir (the one place to put a run directory on another store): every file operation
    # called from their own code is recorded while a run saves, resumes and rebuilds
    import builtins
    import os
    import pathlib
    import shutil
    import sys

    direct = []

    def watch(owner, name):
        real = getattr(owner, name)

        def watched(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__")
            if caller in WATCHED:
                direct.append(f"{caller}: {name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)

    for name in ("exists", "is_dir", "is_file", "stat", "mkdir", "unlink", "glob", "rglob",
                 "read_bytes", "write_bytes", "open", "iterdir", "rename", "replace"):  # fmt: skip
        watch(pathlib.Path, name)
    for owner, name in ((builtins, "open"), (os, "replace"), (os, "open"), (os, "stat"),
                        (os.path, "exists"), (shutil, "rmtree")):  # fmt: skip
        watch(owner, name)

    def run(resume, hooks):
        lp = ftrain.Loop(accum_step(), new_state(), make_batches(5), hooks, epochs=2,
                         work_dir=tmp_path, resume=resume)  # fmt: skip
        lp.run(steps=2)
        lp.close()  # saves interrupted.pth
        return lp

    def evaluate(events):
        for ev in events:
            yield ev
            if isinstance(ev, StepEnd) and ev.is_update:
                metrics = {"loss": 1.0 / ev.state.step}
                yield ftrain.events.Evaluated(ev.run, ev.state, metrics)

    def hooks():
        return [ftrain.hook(evaluate, priority="HIGH"), ftrain.BestCheckpointHook("loss"),
                ftrain.CheckpointHook(1, max_keep=1), ftrain.hooks.AutoCheckpointHook()]  # fmt: skip

    run(None, hooks())
    (tmp_path / "manifest.json").unlink()  # rebuilt from the files on the next start
    with pytest.warns(UserWarning, match="rebuilt"):
        assert run("auto", hooks()).resumed_from is not None
    assert sorted(p.name for p in tmp_path.glob("*.pth"))  # it did write files
    assert direct == []


@pytest.mark.parametrize(
    "name", ["run", "loop.core", "loop.data", "loop.signals", "loop.registry", "hooks.base"]
)
def test_docstring_examples(name):
    import doctest
    import importlib

    module = importlib.import_module(f"ftrain.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, name
