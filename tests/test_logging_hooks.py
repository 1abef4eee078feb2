"""TimerHook and LoggerHook: what gets logged, where, when, and at what cost."""

import doctest
import importlib
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import make_batches, make_model, mean, mse_loss, plain_losses, read_jsonl

import ftrain
from ftrain.checkpoint import load_checkpoint
from ftrain.events import EpochEnd, Evaluated, RunTotals, StepEnd
from ftrain.hooks import logging as logging_mod
from ftrain.hooks import timer as timer_mod
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.sinks import JsonlSink, Start
from ftrain.hooks.sinks import console as console_mod
from ftrain.hooks.timer import TimerHook, TimerStats


def new_state(seed=0, lr=0.1, groups=False):
    model = make_model(seed)
    if groups:
        params = [
            {"params": model.fc1.parameters()},
            {"params": model.fc2.parameters(), "lr": lr / 4},
        ]
    else:
        params = model.parameters()
    return ftrain.TrainState.create(model, torch.optim.SGD(params, lr=lr))


# ------------------------------------------------------------------- JSONL
def test_jsonl_holds_interval_means_at_the_right_steps(tmp_path):
    batches = make_batches(10)
    hooks = [TimerHook(skip_first_k=0), LoggerHook(every=3, progress=False, tensorboard=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks=hooks, epochs=2, work_dir=tmp_path
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    # every 3 updates, plus the end of each epoch (10, 20) for the steps left over
    assert [r["step"] for r in records] == [3, 6, 9, 10, 12, 15, 18, 20]
    assert [r["epoch"] for r in records] == [0, 0, 0, 0, 1, 1, 1, 1]
    losses = plain_losses(batches, epochs=2)
    previous = 0
    for r in records:
        assert r["loss"] == pytest.approx(mean(losses[previous : r["step"]]), rel=1e-6)
        previous = r["step"]
    for r in records:
        assert {"step", "epoch", "time", "loss", "lr", "data_time", "iter_time", "elapsed"} <= set(
            r
        )
        assert r["lr"] == 0.1
        assert r["data_time"] >= 0 and r["iter_time"] > 0 and r["elapsed"] > 0
        assert abs(r["time"] - time.time()) < 600
    # ETA: remaining batches x mean time per batch; nothing left at the end
    assert all(r["eta"] > 0 for r in records[:-1])
    assert records[-1]["eta"] == 0.0
    elapsed = [r["elapsed"] for r in records]
    assert elapsed == sorted(elapsed)


def test_means_cover_every_micro_batch_with_accumulation(tmp_path):
    batches = make_batches(5)
    seen = []  # ("step", step, is_update, loss) per StepEnd; ("end", ...) per EpochEnd

    def record(events):
        for ev in events:
            if isinstance(ev, StepEnd):
                loss = ev.metrics.get("loss")
                seen.append(("step", ev.state.step, ev.is_update, loss and loss.item()))
            elif isinstance(ev, EpochEnd):
                seen.append(("end", ev.state.step, False, None))
            yield ev

    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    hooks = [record, LoggerHook(every=2, progress=False, tensorboard=False)]
    ftrain.Loop(step, new_state(), batches, hooks=hooks, epochs=2, work_dir=tmp_path).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    # the same rule, applied to the recorded micro-batch losses
    expected, group, pending = [], [], False
    for kind, s, update, loss in seen:
        if kind == "step":
            pending = True
            if loss is not None:
                group.append(loss)
        if (kind == "step" and update and s % 2 == 0) or (kind == "end" and pending):
            expected.append((s, mean(group)))
            group, pending = [], False
    # epoch 0: micro-batches 1-4 -> update 2 (a log); 5 + the flushed window -> 3 at its end
    # epoch 1: 6-7 -> update 4 (a log); 8-9 -> 5; 10 + flush -> 6 (a log)
    assert [r["step"] for r in records] == [s for s, _ in expected] == [2, 3, 4, 6]
    for r, (_, value) in zip(records, expected):
        assert r["loss"] == pytest.approx(value, rel=1e-6)
    assert len(seen) == 14  # 10 micro-batches, 2 flushes, 2 epoch ends


def test_jsonl_explicit_path_and_missing_directory(tmp_path):
    batches = make_batches(4)
    path = tmp_path / "logs" / "train.jsonl"
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        batches,
        hooks=[LoggerHook(every=2, progress=False, jsonl=path, tensorboard=False)],
    ).run()
    assert [r["step"] for r in read_jsonl(path)] == [2, 4]
    # the default configuration without a work_dir writes no files and does not complain
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks=[LoggerHook(progress=False)]
    ).run()
    # asking for a file explicitly without anywhere to put it is an error
    with pytest.raises(ValueError, match="work_dir"):
        ftrain.Loop(
            ftrain.make_step(mse_loss),
            new_state(),
            batches,
            hooks=[LoggerHook(progress=False, jsonl=True)],
        ).run()


# ------------------------------------------------------------- TensorBoard
def test_tensorboard_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    batches = make_batches(8)
    hooks = [TimerHook(skip_first_k=1), LoggerHook(every=2, progress=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks=hooks, epochs=1, work_dir=tmp_path
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "data_time", "iter_time", "elapsed", "eta"} <= tags
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [2, 4, 6, 8] == [r["step"] for r in records]
    losses = plain_losses(batches, epochs=1)
    for e, lo in zip(loss, range(0, 8, 2)):
        assert e.value == pytest.approx(mean(losses[lo : lo + 2]), rel=1e-6)
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([0.1] * 4)


# --------------------------------------------------------------- learning rate
def test_lr_logged_matches_the_optimizer(tmp_path):
    batches = make_batches(6)
    lrs_at_log = {}

    @ftrain.hook(priority="HIGH")
    def schedule(events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.is_update:
                for i, g in enumerate(ev.state.optimizer.param_groups):
                    g["lr"] = 0.1 / (ev.state.step + 1) / (1 + 3 * i)
            yield ev

    @ftrain.hook(priority="LOWEST")
    def remember(events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.is_update:
                lrs_at_log[ev.state.step] = [g["lr"] for g in ev.state.optimizer.param_groups]
            yield ev

    hooks = [schedule, remember, LoggerHook(every=3, progress=False, tensorboard=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(groups=True),
        batches,
        hooks=hooks,
        epochs=1,
        work_dir=tmp_path,
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        lrs = lrs_at_log[r["step"]]
        assert r["lr"] == lrs[0]
        assert r["lr_min"] == min(lrs) and r["lr_max"] == max(lrs)


def test_single_lr_has_no_min_max(tmp_path):
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(lr=0.05),
        make_batches(2),
        hooks=[LoggerHook(every=1, progress=False, tensorboard=False)],
        work_dir=tmp_path,
    ).run()
    for r in read_jsonl(tmp_path / "metrics.jsonl"):
        assert r["lr"] == 0.05 and "lr_min" not in r and "lr_max" not in r


# ------------------------------------------------------------------- console
def test_console_lines_without_progress_bar(capsys):
    hooks = [TimerHook(skip_first_k=0), LoggerHook(every=2, progress=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(4), hooks=hooks, max_steps=4
    ).run()
    said, *out = capsys.readouterr().out.splitlines()
    assert said == "starting fresh"  # issue 21: every run says how it starts
    assert [line.split()[1] for line in out] == ["2/4", "4/4"]
    for line in out:
        assert line.startswith("step ")
        # issue 16: a quieter line; timing details and memory go to the file sinks only
        for key in ("loss", "lr", "eta", "samples/s", "epoch"):
            assert f"  {key} " in line
        for key in ("data_time", "iter_time", "compute_time", "elapsed", "memory/"):
            assert f"  {key}" not in line
    assert "eta 0:00:00" in out[-1]


def test_progress_bar_is_drawn_in_chunks(capfd, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(console_mod, "_bar_can_show", lambda: True)  # as on a terminal
    hooks = [TimerHook(), LoggerHook(every=3)]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(6), hooks=hooks, max_steps=6
    ).run()
    captured = capfd.readouterr()
    assert captured.out == "starting fresh\n"  # printed above the bar (issue 21)
    assert "train" in captured.err and "6/6" in captured.err and "loss" in captured.err


def test_progress_bar_counts_batches_when_only_epochs_are_known(capfd, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(console_mod, "_bar_can_show", lambda: True)  # as on a terminal
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    ftrain.Loop(step, new_state(), make_batches(5), hooks=[LoggerHook(every=1)], epochs=2).run()
    assert "10/10" in capfd.readouterr().err


def test_tqdm_disable_env_prints_lines_instead(capfd, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(2), hooks=[LoggerHook(every=1)]
    ).run()
    captured = capfd.readouterr()
    assert captured.out.count("step ") == 2 and "\r" not in captured.err


def test_no_bar_into_a_pipe_or_ci_log_but_one_on_a_terminal(capfd, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    run = lambda: ftrain.Loop(  # noqa: E731
        ftrain.make_step(mse_loss), new_state(), make_batches(2), hooks=[LoggerHook(every=1)]
    ).run()
    run()  # pytest captures stderr: not a terminal
    captured = capfd.readouterr()
    assert captured.out.count("step ") == 2 and "\r" not in captured.err
    monkeypatch.setattr(console_mod, "_bar_can_show", lambda: True)  # as on a terminal
    run()
    captured = capfd.readouterr()
    assert "step " not in captured.out and "train" in captured.err and "\r" in captured.err


# ---------------------------------------------------------------- evaluation
def evaluator(events):
    for ev in events:
        yield ev
        if isinstance(ev, EpochEnd):
            yield Evaluated(
                ev.loop, ev.state, {"acc": 0.5, "test/top1": torch.tensor(0.25)}, by_epoch=True
            )


def test_evaluated_metrics_are_logged(tmp_path, capsys):
    hooks = [evaluator, LoggerHook(every=100, progress=False, tensorboard=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(3),
        hooks=hooks,
        epochs=2,
        work_dir=tmp_path,
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    evals = [r for r in records if "val/acc" in r]
    assert [(r["step"], r["epoch"]) for r in evals] == [(3, 0), (6, 1)]
    assert all(r["val/acc"] == 0.5 and r["test/top1"] == 0.25 for r in evals)
    assert all("loss" not in r for r in evals)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [3, 6]  # the epoch-end logs
    out = capsys.readouterr().out
    assert out.count("val/acc 0.5000") == 2 and "test/top1 0.2500" in out


def test_evaluated_metrics_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hooks = [evaluator, LoggerHook(every=100, progress=False, jsonl=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(3), hooks=hooks, work_dir=tmp_path
    ).run()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("val/acc")] == [(3, 0.5)]


# ------------------------------------------------------------- host syncs
@pytest.fixture
def sync_guard(monkeypatch):
    """Make tensor→host conversions raise while ``guard["armed"]``."""
    guard = {"armed": False, "calls": 0}

    def patch(name):
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, **kwargs):
            if guard["armed"]:
                raise RuntimeError(f"host sync: Tensor.{name} called in a non-log step")
            guard["calls"] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)

    for name in ("item", "__float__", "__bool__", "tolist", "__int__", "cpu", "numpy"):
        patch(name)
    return guard


def guard_hook(guard, every):
    """Arm the guard for each step, disarm it around log steps (HIGHEST: sees events first)."""

    @ftrain.hook(priority="HIGHEST")
    def arm(events):
        guard["armed"] = True
        try:
            for ev in events:
                log_step = isinstance(ev, StepEnd) and ev.is_update and ev.state.step % every == 0
                if log_step or not isinstance(ev, StepEnd):
                    guard["armed"] = False
                yield ev
                guard["armed"] = True  # the next step (and its data loading) is checked
        finally:
            guard["armed"] = False

    return arm


def test_no_host_sync_outside_log_steps(tmp_path, sync_guard):
    kept = []
    hooks = [
        guard_hook(sync_guard, every=5),
        TimerHook(skip_first_k=2),
        ftrain.every(1, lambda ev: kept.append(ev.metrics["loss"])),  # keeps refs, no sync
        LoggerHook(every=5, progress=False, tensorboard=False),
    ]
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(20),
        hooks=hooks,
        max_steps=17,
        work_dir=tmp_path,
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 10, 15, 17]
    losses = [t.item() for t in kept]
    assert records[-1]["loss"] == pytest.approx(mean(losses[15:17]), rel=1e-6)


def test_no_host_sync_until_the_end_log(tmp_path, sync_guard):
    hooks = [
        guard_hook(sync_guard, every=1000),
        TimerHook(),
        LoggerHook(every=1000, progress=False, tensorboard=False),
    ]
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(30),
        hooks=hooks,
        max_steps=20,
        work_dir=tmp_path,
    ).run()
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["step"] == 20
    assert record["loss"] == pytest.approx(mean(plain_losses(make_batches(30)[:20], 1)), rel=1e-6)


def test_sync_guard_catches_a_per_step_sync(sync_guard):
    """The guard itself works: a hook reading the loss every step is caught."""
    hooks = [
        guard_hook(sync_guard, every=1000),
        ftrain.every(1, lambda ev: float(ev.metrics["loss"])),
    ]
    with pytest.raises(RuntimeError, match="host sync"):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(3), hooks=hooks).run()


def test_run_totals_are_read_in_one_sync(monkeypatch):
    totals = RunTotals()
    for i in range(6):
        totals.add({"loss": torch.tensor(float(i)), "acc": torch.tensor(i % 2), "n": i})
    totals.add({"loss": torch.tensor(6.0), "big": torch.ones(3)})  # no acc; big is left out
    calls = []
    original = torch.Tensor.tolist

    def counting(self):
        calls.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    out = totals.metric_sums()
    assert len(calls) == 1  # one host sync for all the CPU sums
    assert out == {"loss": (21.0, 7), "acc": (3.0, 6), "n": (15.0, 6)}


# ------------------------------------------------------------- timer, resume
def test_timer_skips_warmup_and_measures_data_time(tmp_path):
    def slow_data():
        for batch in make_batches(8):
            time.sleep(0.004)
            yield batch

    class Reiterable:
        def __iter__(self):
            return slow_data()

    timer = TimerHook(skip_first_k=3)
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        Reiterable(),
        hooks=[timer, LoggerHook(every=4, progress=False, tensorboard=False)],
        work_dir=tmp_path,
    )
    lp.run()
    stats = timer.stats
    assert isinstance(stats, TimerStats) and stats.totals is lp.totals
    assert stats.n == 5 and stats.updates == 5
    assert stats.data_time_avg >= 0.003 and stats.iter_time_avg >= stats.data_time_avg
    assert stats.eta is None  # data without a length and no max_steps: no estimate
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [4, 8]
    assert records[0]["data_time"] >= 0.003 and "eta" not in records[0]


def test_timer_window_and_eta_arithmetic():
    class FakeLoop(SimpleNamespace):  # weakly referenced, as a Loop is
        pass

    def add(totals, data_time, iter_time, update):
        totals.micro_batches += 1
        totals.updates += update
        totals.data_time += data_time
        totals.iter_time += iter_time

    loop = FakeLoop(
        state=SimpleNamespace(step=4, epoch=0), max_steps=10, epochs=None, batches_per_epoch=None
    )
    totals = RunTotals()
    stats = TimerStats(loop, totals=totals)
    for _ in range(4):
        add(totals, 0.5, 2.0, True)
    assert stats.eta == pytest.approx(6 * 2.0)
    mark = stats.mark()
    add(totals, 1.0, 4.0, False)
    assert stats.since(mark) == {"data_time": 1.0, "iter_time": 4.0}
    assert stats.since(stats.mark()) == {}
    # by epochs: remaining batches x mean seconds per batch; the sooner end wins
    loop = FakeLoop(
        state=SimpleNamespace(step=3, epoch=1),
        max_steps=None,
        epochs=2,
        batches_per_epoch=10,
        batch_in_epoch=6,
    )
    totals = RunTotals()
    stats = TimerStats(loop, totals=totals)
    add(totals, 0.0, 1.0, True)
    assert stats.eta == pytest.approx(4 * 1.0)
    loop.max_steps = 5
    assert stats.eta == pytest.approx(2 * 1.0)


def test_elapsed_time_and_log_survive_resume(tmp_path):
    batches = make_batches(12)

    class Stop(Exception):
        pass

    def interrupt_at(k):
        @ftrain.hook(priority="LOWEST")  # after the logger saw step k
        def h(events):
            for ev in events:
                if isinstance(ev, StepEnd) and ev.state.step == k:
                    time.sleep(0.02)
                    raise Stop
                yield ev

        return h

    def hooks(*extra):
        return [
            TimerHook(skip_first_k=0),
            LoggerHook(every=2, progress=False),
            ftrain.CheckpointHook(4),
            *extra,
        ]

    step = ftrain.make_step(mse_loss)
    with pytest.raises(Stop):
        ftrain.Loop(
            step, new_state(), batches, hooks=hooks(interrupt_at(5)), work_dir=tmp_path
        ).run()
    # the interrupted run logged 2, 4 and (when it stopped) 5
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4, 5]
    saved = load_checkpoint(tmp_path / "iter_4.pth")["hooks"]["timer"]["elapsed"]
    assert saved > 0
    ftrain.Loop(step, new_state(), batches, hooks=hooks(), work_dir=tmp_path, resume="auto").run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    # resumed from step 4 (logged before the checkpoint was written): the lines after it
    # are dropped, the line at it is kept, and the run continues the file
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    assert records[2]["elapsed"] >= saved  # counted on from the checkpoint
    losses = plain_losses(batches, epochs=1)
    assert records[2]["loss"] == pytest.approx(mean(losses[4:6]), rel=1e-6)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [2, 4, 6, 8, 10, 12]


def test_jsonl_purge_drops_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 4, "loss": 2.0}\n{"step": 5, "lo')
    sink = JsonlSink(path)
    sink.start(Start(step=4, resumed_from="iter_4.pth"))  # a checkpoint without the file's size
    sink.write(5, {"loss": 3.0})
    sink.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [(1, 1.0), (4, 2.0), (5, 3.0)]
    # without purging (a fresh run appending), a torn tail is cut too
    with open(path, "ab") as f:
        f.write(b'{"step": 6, "lo')
    sink = JsonlSink(path)
    sink.write(6, {"loss": 4.0})
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 4, 5, 6]
    path.write_bytes(b'{"step": 1')
    sink = JsonlSink(path)
    sink.write(7, {"loss": 5.0})
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [7]  # a single torn line is cut too
    sink = JsonlSink(path)
    sink.start(Start())  # a fresh start: nothing written before counts
    sink.close()
    assert path.read_bytes() == b""


# ------------------------------------------------------------- misc
def test_only_rank_zero_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ftrain.dist, "reduce_metrics", lambda m, *a, **k: dict(m))
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(4),
        hooks=[TimerHook(), LoggerHook(every=1, progress=False)],
        work_dir=tmp_path,
    ).run()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
    assert capsys.readouterr().out == ""


def test_sinks_closed_on_interruption(tmp_path):
    class Recorder:
        def __init__(self):
            self.writes, self.closed = [], False

        def write(self, step, scalars):
            self.writes.append((step, dict(scalars)))

        def close(self):
            self.closed = True

    @ftrain.hook(priority="LOWEST")
    def boom(events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.state.step == 3:
                raise KeyboardInterrupt
            yield ev

    sink = Recorder()
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(6),
        hooks=[boom, LoggerHook(every=2, console=False, sinks=[sink])],
        work_dir=tmp_path,
    )
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    assert sink.closed
    assert [s for s, _ in sink.writes] == [2, 3]
    assert (tmp_path / "metrics.jsonl").exists()


def test_default_hooks_keep_working(tmp_path):
    hooks = ftrain.default_hooks(log_every=2, progress=False)
    assert hooks.names()[:2] == ["timer", "logger"]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(4), hooks=hooks, work_dir=tmp_path
    ).run()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4]
    plan = ftrain.hooks.resolve_hooks([LoggerHook(), TimerHook()])
    assert [(h.name, h.priority) for h in plan] == [("timer", 50), ("logger", 60)]


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="every"):
        LoggerHook(every=0)
    with pytest.raises(TypeError, match="jsonl"):
        LoggerHook(jsonl=3)
    with pytest.raises(TypeError, match="sink"):
        LoggerHook(sinks=[object()])
    with pytest.raises(ValueError, match="skip_first_k"):
        TimerHook(skip_first_k=-1)


def test_import_stays_light():
    code = (
        "import sys, ftrain; "
        "bad = [m for m in ('tensorboard', 'torch.utils.tensorboard', 'tqdm.auto') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module",
    [logging_mod, timer_mod, console_mod, *(importlib.import_module(f"ftrain.hooks.sinks{m}")
     for m in ("", ".base", ".files", ".tensorboard", ".trackers"))],
)  # fmt: skip
def test_docstring_examples(module, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_run_totals_match_plain_means_and_keep_no_step_tensors():
    g = torch.Generator().manual_seed(0)
    steps = []
    for i in range(23):
        m = {"loss": torch.rand((), generator=g), "skipped": torch.tensor(i % 3 == 0)}
        if i % 2:
            m["acc"] = float(i)  # a plain number
        if i % 5 == 0:
            m["grad_norm"] = torch.rand((), generator=g, dtype=torch.float64)
        m["vec"] = torch.ones(3)  # not a scalar: left out
        steps.append(m)
    steps.append({"loss": 0.25})  # the same metric as a number once
    totals = RunTotals()
    for m in steps:
        totals.add(m)
    expected = {}
    for m in steps:  # the reference: a plain mean per key over the steps that have it
        for k, v in m.items():
            if k != "vec":
                expected.setdefault(k, []).append(float(v))
    got = totals.metric_sums()
    assert list(got) == list(expected)
    for k, values in expected.items():
        total, count = got[k]
        assert count == len(values) and total / count == pytest.approx(sum(values) / len(values))
    assert all(t.dim() == 0 and not t.requires_grad for t in totals.sums.values())
