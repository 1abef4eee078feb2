"""Issue 21, item 3: the sinks' one home and protocol, and their bad input.

A sink object of yours is told where a resumed run restarted (and gets back what it
marked at the checkpoint); the named sinks come from one list; the trackers change no
process-wide setting; a directory, a non-path or a full disk gets an error naming the
argument or the file and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.events import StepEnd
from ftrain.hooks import sinks as sinks_module
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.sinks import SINKS, CsvSink, MLflowSink, SinkBase, Start


def new_state():
    model = make_model(0)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


class Recorder(SinkBase):
    """A sink of one's own: it keeps rows in memory and marks how many it holds."""

    def __init__(self):
        self.rows, self.starts = [], []

    def start(self, at):
        self.starts.append(at)
        if not at.fresh:  # drop what was written after the checkpoint
            self.rows = self.rows[: at.mark]

    def write(self, step, scalars):
        self.rows.append((step, round(scalars["loss"], 6)))

    def mark(self):
        return len(self.rows)


class Stop(Exception):
    pass


def test_a_sink_object_is_told_where_a_resumed_run_restarted(tmp_path):
    def stop_after(k):
        def h(events):
            for ev in events:
                yield ev
                if type(ev) is StepEnd and ev.state.step == k:
                    raise Stop

        return ftrain.hook(h, priority="LOWEST", cadence=ftrain.Every(at=(k,)))

    def loop(sink, *extra, resume=None, work_dir=tmp_path / "a"):
        hooks = [LoggerHook(every=2, console=False, sinks=[sink]), ftrain.CheckpointHook(4),
                 *extra]  # fmt: skip
        return ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(10), hooks,
                           max_steps=10, work_dir=work_dir, resume=resume)  # fmt: skip

    straight = Recorder()
    loop(straight, work_dir=tmp_path / "straight").run()
    sink = Recorder()
    with pytest.raises(Stop):
        loop(sink, stop_after(7)).run()  # an error: interrupted.pth at update 7
    assert [s for s, _ in sink.rows] == [2, 4, 6, 7]  # (7: the interrupted interval's row)
    lp = loop(sink, resume=tmp_path / "a" / "iter_4.pth")  # back to update 4 on purpose
    lp.run()
    fresh, resumed = sink.starts
    assert fresh.fresh and resumed.resumed_from == "iter_4.pth" and resumed.step == 4
    assert resumed.mark == 2  # what mark() said when iter_4.pth was saved
    assert sink.rows == straight.rows  # no row twice, no partial row


def test_the_named_sinks_come_from_one_list():
    assert list(SINKS) == ["console", "jsonl", "tensorboard", "csv", "mlflow", "wandb"]
    for name in SINKS:
        LoggerHook(sinks=[name])  # every listed name is accepted
    with pytest.raises(ValueError, match="'console', 'jsonl', 'tensorboard', 'csv', 'mlflow'"):
        LoggerHook(sinks=["ftp"])
    documented = sinks_module.__doc__ + LoggerHook.__doc__
    assert "SINKS" in documented


def test_a_directory_where_a_file_goes_is_named_before_training(tmp_path):
    steps = []

    def loss(m, b):
        steps.append(1)
        return mse_loss(m, b)

    (tmp_path / "logs").mkdir()
    lp = ftrain.Loop(ftrain.make_step(loss), new_state(), make_batches(2),
                     [LoggerHook(progress=False, jsonl="logs")], work_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"LoggerHook\(jsonl=...\): .*logs is a directory, not a "
                                         r"file; pass a file in it, e\.g\. .*logs/metrics\.jsonl"):
        lp.run()
    assert steps == []  # before training
    with pytest.raises(ValueError, match=r"CsvSink\(path\): .* is a directory, not a file"):
        CsvSink(tmp_path / "logs")


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="pip install 'ftrain[mlflow]'")
@pytest.mark.parametrize("uri", [None, 123, True, ""])
def test_mlflow_sink_refuses_a_uri_that_is_not_one(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((TypeError, ValueError), match="MLflowSink: tracking_uri"):
        MLflowSink(uri)
    assert list(tmp_path.iterdir()) == []  # no "None/" or "123/" directory


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"postfix": 5}, "postfix must be a list of tag names"),
        ({"postfix": "loss"}, "postfix must be a list of tag names"),
        ({"console_keys": [1]}, "console_keys must hold tag names"),
        ({"progress": "yes"}, "progress must be True or False"),
        ({"desc": 3}, "desc must be a string"),
        ({"sinks": "csv"}, "sinks must be a list"),
    ],
)
def test_logger_arguments_are_checked(kwargs, text):
    with pytest.raises(TypeError, match=text):
        LoggerHook(**kwargs)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_names_the_file_and_the_fix():
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(4),
                     [LoggerHook(every=2, progress=False, jsonl="/dev/full")])  # fmt: skip
    with pytest.raises(OSError, match=r"writing /dev/full failed: No space left on device\. "
                                      r"Free space on that disk, or point LoggerHook\(jsonl=\.\.\.\) "
                                      r"at another disk; resume=\"auto\" then continues"):
        lp.run()


def _process_settings():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    return dict(os.environ), handlers, sys.excepthook, sys.stdout, sys.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("wandb") is None,
    reason="pip install 'ftrain[mlflow,wandb]'",
)
def test_the_trackers_change_no_process_wide_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    before = _process_settings()
    hooks = [LoggerHook(every=2, progress=False, sinks=["mlflow", "wandb"])]
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(4), hooks,
                work_dir=tmp_path).run()  # fmt: skip
    assert _process_settings() == before
    assert (tmp_path / "mlruns").is_dir() and list((tmp_path / "wandb").glob("offline-run-*"))


def test_start_says_what_kind_of_start():
    assert Start().fresh and not Start(step=3, continued=True).fresh


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="pip install 'ftrain[mlflow]'")
def test_a_resumed_run_continues_its_own_mlflow_run_in_a_shared_store(tmp_path, monkeypatch):
    """Runs A and B log into one MLflow store and experiment; B starts after A stopped (the
    store's run-id file then names B's run). A resumed continues A's MLflow run (the id its
    checkpoint keeps), not B's."""
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    step = ftrain.make_step(mse_loss)

    def run(work: str, max_steps: int) -> None:
        sink = MLflowSink(store, experiment="shared", run_name=work)
        hooks = [LoggerHook(every=2, sinks=[sink], progress=False, jsonl=False,
                            tensorboard=False), ftrain.CheckpointHook(2)]  # fmt: skip
        ftrain.Loop(step, new_state(), make_batches(8), hooks, work_dir=tmp_path / work,
                    max_steps=max_steps, resume="auto").run()  # fmt: skip

    run("a", 4)
    run("b", 4)
    run("a", 6)  # resumed from a/iter_4.pth
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the directory store here
    client = MlflowClient(tracking_uri=store.as_uri())
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    steps = {r.info.run_name: sorted(m.step for m in client.get_metric_history(r.info.run_id,
                                                                            "loss"))
             for r in runs}  # fmt: skip
    assert steps == {"a": [2, 4, 6], "b": [2, 4]}


def test_a_restarted_tensorboard_sink_writes_a_file_read_after_the_one_it_continues(tmp_path):
    """Readers take event files in name order (``events.out.tfevents.<second>...<n>``; within
    one second a process's writer ``.10`` sorts before ``.9``). A sink (re)started while the
    newest file's second has not passed waits for it: its file is read last, so its
    ``purge_step`` hides what the run it continues wrote after the checkpoint."""
    import time

    from ftrain.hooks.sinks import TensorBoardSink

    ahead = int(time.time()) + 1  # a file of the next second (a restart within one second)
    old = tmp_path / f"events.out.tfevents.{ahead}.host.1.9"
    old.write_bytes(b"")
    sink = TensorBoardSink(tmp_path)
    sink.start(Start(step=4, resumed_from="iter_4.pth"))
    sink.write(6, {"loss": 0.5})
    sink.close()
    names = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))
    assert names[0] == old.name and len(names) == 2, names
