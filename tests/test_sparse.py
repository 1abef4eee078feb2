"""Cadences: hooks see the StepEnd events their cadence asks for; ``run(steps=...)``; grad clearing.

The reference for every run here is either a plain PyTorch loop written in
the test or the same run driven event by event (``for ev in lp``), where
every ``StepEnd`` passes through every hook.
"""

import orjson
import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.events import EpochEnd, RunBegin, RunEnd, RunTotals, StepEnd
from ftrain.hooks.cadence import EVERY_MICRO_BATCH
from ftrain.hooks.checkpoint import CheckpointHook
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.timer import TimerHook
from ftrain.step import clear_grads


def new_state(seed=0, lr=0.1):
    model = make_model(seed)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))


def plain_run(batches, epochs, seed=0, lr=0.1):
    """Parameters and per-step losses of the same training in a plain PyTorch loop."""
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(epochs):
        for batch in batches:
            loss = mse_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def read_jsonl(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def default_like_hooks(jsonl=None):
    return [
        TimerHook(skip_first_k=2),
        LoggerHook(every=3, progress=False, tensorboard=False, jsonl=jsonl),
        CheckpointHook(4, max_keep=None),
        ftrain.hooks.AutoCheckpointHook(),
    ]


class Recorder:
    """A hook whose cadence asks for every ``n``-th update; it records the StepEnd steps it sees."""

    priority = "HIGHEST"

    def __init__(self, n=None, **cadence):
        self.cadence = ftrain.Every(steps=n, **cadence)
        self.seen = []

    def __call__(self, events):
        for ev in events:
            if isinstance(ev, StepEnd):
                self.seen.append(ev.state.step)
            yield ev


# ------------------------------------------------------------ the same run
def test_run_with_cadences_trains_and_logs_like_the_full_stream(tmp_path):
    batches = make_batches(10)
    ref_params, ref_losses = plain_run(batches, epochs=2)

    sparse_dir, full_dir = tmp_path / "sparse", tmp_path / "full"
    rec = Recorder(n=100)  # asks for nothing: sees only what the other hooks ask for
    hooks = [rec, TimerHook(skip_first_k=2), LoggerHook(every=3, progress=False, jsonl=True)]
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks, epochs=2, work_dir=sparse_dir
    )
    final = lp.run()
    # the timer's end of warm-up (2), the logger's 3, 6, ...; the flush-free epoch ends add none
    assert rec.seen == [2, 3, 6, 9, 12, 15, 18]
    full_rec = Recorder(n=100)
    timer = TimerHook(skip_first_k=2)
    full = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        batches,
        [full_rec, timer, LoggerHook(every=3, progress=False, jsonl=True)],
        epochs=2,
        work_dir=full_dir,
    )
    for _ in full:  # iterating by hand: every event, every hook
        pass
    assert full_rec.seen == list(range(1, 21))

    for p, q, r in zip(final.model.parameters(), full.state.model.parameters(), ref_params):
        assert torch.equal(p, q) and torch.equal(p, r)
    sparse_log, full_log = (
        read_jsonl(sparse_dir / "metrics.jsonl"),
        read_jsonl(full_dir / "metrics.jsonl"),
    )
    assert [r["step"] for r in sparse_log] == [3, 6, 9, 10, 12, 15, 18, 20]
    assert [r["step"] for r in full_log] == [r["step"] for r in sparse_log]
    previous = 0
    for a, b in zip(sparse_log, full_log):
        expected = sum(ref_losses[previous : a["step"]]) / (a["step"] - previous)
        assert a["loss"] == pytest.approx(expected, rel=1e-6)
        assert b["loss"] == pytest.approx(expected, rel=1e-6)
        previous = a["step"]
    # the timer counted the same steps either way: all 20 minus the 2 warm-up updates
    for stats in (hooks[1].stats, timer.stats):
        assert (stats.n, stats.updates) == (18, 18)
    assert (lp.totals.micro_batches, lp.totals.updates) == (20, 20)
    total, count = lp.totals.metric_sums()["loss"]
    assert count == 20 and total == pytest.approx(sum(ref_losses), rel=1e-6)


def test_hooks_see_their_cadence_and_totals_see_every_micro_batch():
    batches = make_batches(7)
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    rec = Recorder(n=2)
    lp = ftrain.Loop(step, new_state(), batches, [rec], epochs=1)
    lp.run()
    # 7 micro-batches: updates 1..3 in windows of 2, then the flushed partial window (update 4)
    assert rec.seen == [2, 4]  # update 2 (asked) and the flush, always yielded
    assert (lp.totals.micro_batches, lp.totals.updates) == (8, 4)  # with the flush
    # the same micro-batch losses as the full stream's StepEnd events
    losses = []
    for ev in ftrain.Loop(step, new_state(), batches, [Recorder(n=2)], epochs=1):
        if isinstance(ev, StepEnd) and "loss" in ev.metrics:
            losses.append(ev.metrics["loss"].item())
    total, count = lp.totals.metric_sums()["loss"]
    assert count == len(losses) == 7 and total == pytest.approx(sum(losses), rel=1e-6)


def test_one_hook_without_a_cadence_makes_the_stream_full():
    batches = make_batches(6)

    class Everything(Recorder):  # an ordinary hook object: no cadence
        cadence = None

    rec = Recorder(n=3)
    everything = Everything()
    everything.cadence = None
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, [rec, everything]).run()
    assert rec.seen == everything.seen == [1, 2, 3, 4, 5, 6]
    rec = Recorder(n=3)
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, [rec]).run()
    assert rec.seen == [3, 6]


def test_every_once_on_cadences_and_generator_functions():
    batches = make_batches(9)
    called = []
    hooks = [
        ftrain.every(4, lambda ev: called.append(("every", ev.state.step))),
        ftrain.hooks.once(lambda ev: called.append(("once", ev.state.step)), at=3),
        ftrain.hooks.on(EpochEnd, lambda ev: called.append(("epoch", ev.epoch))),
        ftrain.every(2, lambda ev: called.append(("epochs", ev.epoch)), by="epoch", first=True),
    ]
    rec = Recorder(n=100)
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, [*hooks, rec]).run()
    assert called == [("once", 3), ("every", 4), ("every", 8), ("epoch", 0), ("epochs", 0)]
    assert rec.seen == [3, 4, 8]  # a step nobody asks for runs no hook

    def plain(events):  # a generator function: it sees everything, and so does every hook
        yield from events

    rec = Recorder(n=100)
    called.clear()
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, [*hooks, rec, plain]).run()
    assert rec.seen == list(range(1, 10))
    assert called == [("once", 3), ("every", 4), ("every", 8), ("epoch", 0), ("epochs", 0)]
    with_cadence = ftrain.hook(plain, name="plain", cadence=ftrain.Every(at=(5,)))
    rec = Recorder(n=100)
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, [rec, with_cadence]).run()
    assert rec.seen == [5]


def test_a_bad_cadence_is_named():
    class Bad(Recorder):
        cadence = 5

    bad = Bad()
    bad.cadence = 5
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(2), [bad])
    with pytest.raises(TypeError, match="'bad'.*ftrain.Every"):
        lp.run()
    with pytest.raises(TypeError, match="ftrain.Every"):
        ftrain.hook(bad, cadence=5)


# ------------------------------------------------------------- run(steps=)
def test_run_steps_pauses_with_hooks_open_and_continues_exactly(tmp_path):
    batches = make_batches(10)
    ref_params, _ = plain_run(batches, epochs=3)
    begins = []

    class CountBegins(Recorder):
        def __call__(self, events):
            for ev in events:
                if isinstance(ev, (RunBegin, RunEnd)):
                    begins.append(type(ev).__name__)
                yield ev

    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        batches,
        [CountBegins(n=5), *default_like_hooks()],
        epochs=3,
        work_dir=tmp_path,
    )
    assert lp.run(steps=7).step == 7
    with pytest.raises(RuntimeError, match="paused by run"):
        iter(lp)
    assert lp.run(steps=1).step == 8
    assert lp.run(steps=13).step == 21
    final = lp.run()
    assert final.step == 30 and lp.done
    assert begins == ["RunBegin", "RunEnd"]  # one run: the hooks never restarted
    for p, r in zip(final.model.parameters(), ref_params):
        assert torch.equal(p, r)
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 30


def test_closing_a_paused_run_saves_it_and_resume_continues_exactly(tmp_path):
    batches = make_batches(8)
    ref_params, _ = plain_run(batches, epochs=2)
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        batches,
        default_like_hooks(),
        epochs=2,
        work_dir=tmp_path,
    )
    lp.run(steps=5)
    lp.close()
    assert (tmp_path / "interrupted.pth").exists()  # closed mid-run: as a Ctrl-C would
    resumed = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(seed=3),
        batches,
        default_like_hooks(),
        epochs=2,
        work_dir=tmp_path,
        resume="auto",
    ).run()
    assert resumed.step == 16
    for p, r in zip(resumed.model.parameters(), ref_params):
        assert torch.equal(p, r)


def test_run_steps_rejects_bad_values():
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(2), [])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="steps must be a whole number"):
            lp.run(steps=bad)


# ------------------------------------------------------------ grad clearing
def test_clear_grads_matches_zero_grad_and_respects_overrides_and_the_profiler():
    model = make_model(0)
    mse_loss(model, make_batches(1)[0]).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clear_grads(opt)
    assert all(p.grad is None for p in model.parameters())

    class Custom(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none=True):
            Custom.calls += 1
            super().zero_grad(set_to_none=set_to_none)

    step = ftrain.make_step(mse_loss)
    state = ftrain.TrainState.create(model, Custom(model.parameters(), lr=0.1))
    state, _ = step(state, make_batches(1)[0])
    assert Custom.calls == 1  # an optimizer's own zero_grad is always called

    other = make_model(0)
    state = ftrain.TrainState.create(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with torch.profiler.profile() as prof:
        step(state, make_batches(1)[0])
    names = {e.name for e in prof.events()}
    assert any("zero_grad" in n for n in names)  # profiled runs keep zero_grad's annotation


# ------------------------------------------------------------ metric window
def test_run_totals_float32_sums_and_bfloat16_in_float64():
    g = torch.Generator().manual_seed(0)
    totals = RunTotals()
    values = [torch.rand((), generator=g) * 10 for _ in range(3000)]  # folds 2 times
    halves = [torch.rand((), generator=g, dtype=torch.float64) for _ in range(3000)]
    for v, h in zip(values, halves):
        totals.add({"loss": v, "half": h.to(torch.bfloat16)})
    got = totals.metric_sums()
    assert got["loss"][0] / 3000 == pytest.approx(sum(float(v) for v in values) / 3000, rel=1e-6)
    expected = sum(float(h.to(torch.bfloat16)) for h in halves)
    assert got["half"][0] == pytest.approx(expected, rel=1e-9)  # bfloat16 summed in float64
    grad = torch.tensor(2.0, requires_grad=True) * 1.0  # a metric still attached to a graph
    totals.add({"m": torch.tensor(1.0)})
    totals.add({"m": grad})
    assert totals.metric_sums()["m"] == (3.0, 2)
    assert all(not t.requires_grad for t in totals.sums.values())


# ------------------------------------------- pausing: what a review found
def test_run_steps_counts_from_the_resumed_step(tmp_path):
    batches = make_batches(20)
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        batches,
        [CheckpointHook(10)],
        max_steps=10,
        work_dir=tmp_path,
    ).run()
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        batches,
        [CheckpointHook(10)],
        max_steps=30,
        work_dir=tmp_path,
        resume="auto",
    )
    assert lp.run(steps=5).step == 15  # 5 more than the checkpoint's 10


def test_a_ctrl_c_held_at_the_pause_is_raised_not_kept():
    import os
    import signal

    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the 3rd step
        return mse_loss(model, batch)

    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), make_batches(20), [])
    with pytest.raises(KeyboardInterrupt):
        lp.run(steps=3)
    assert lp.state.step == 3
    assert lp.run(steps=2).step == 5  # the next run trains: nothing was left pending


def test_a_pause_is_not_training_time():
    import time

    timer = TimerHook(skip_first_k=1)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(40), [timer])
    lp.run(steps=10)
    time.sleep(0.5)  # the user looks at the paused run
    lp.run()
    stats = timer.stats
    assert stats.n == 39 and stats.iter_time < 0.25  # 39 tiny steps, not the 0.5 s pause
    assert stats.elapsed < 0.4


def test_request_stop_from_outside_a_hook_stops_at_the_next_step():
    lp = None

    def loss_fn(model, batch):
        if lp.state.step == 4:
            lp.request_stop("enough")
        return mse_loss(model, batch)

    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), make_batches(100), [LoggerHook(50)])
    assert lp.run().step == 5 and lp.stop_reason == "enough"


def test_pausing_on_an_evaluation_step_finishes_the_evaluation_first():
    calls = []
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(30),
        [
            ftrain.EvalHook(
                lambda s: calls.append(s.step) or {"val_loss": 0.5}, every=10, by_epoch=False
            ),
            ftrain.EarlyStoppingHook("val_loss", patience=1),
        ],
    )
    lp.run(steps=10)
    assert calls == [10]  # done before run() returned, not when it continues
    lp.run(steps=10)
    assert calls == [10, 20] and lp.done  # no improvement at 20: early stopping


def test_pausing_flushes_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(40),
        [LoggerHook(every=5, progress=False, console=False)],
        work_dir=tmp_path,
    )
    lp.run(steps=20)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [5, 10, 15, 20]  # on disk while paused
    lp.close()


def test_an_instance_zero_grad_override_is_called():
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    original = opt.zero_grad
    opt.zero_grad = lambda set_to_none=True: calls.append(1) or original(set_to_none)
    state = ftrain.TrainState.create(model, opt)
    state, _ = ftrain.make_step(mse_loss)(state, make_batches(1)[0])
    state, _ = ftrain.with_clip(ftrain.make_step(mse_loss), "norm", max_norm=1.0)(
        state, make_batches(1)[0]
    )
    assert calls == [1, 1]


def test_the_warm_up_stays_out_of_the_logged_times(tmp_path):
    hooks = [TimerHook(skip_first_k=5), LoggerHook(every=2, progress=False, tensorboard=False)]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(12), hooks, work_dir=tmp_path
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    timed = [(r["step"], "iter_time" in r) for r in records]
    # steps 1-5 are the warm-up: the logs at 2 and 4 have no times, every later one has
    assert timed == [(2, False), (4, False), (6, True), (8, True), (10, True), (12, True)]


def test_long_totals_keep_float64_precision():
    totals = RunTotals()
    value = torch.tensor(0.1)
    for _ in range(200_000):
        totals.add({"loss": value})
    total, count = totals.metric_sums()["loss"]
    assert total / count == pytest.approx(0.1, rel=1e-4)


# ------------------------------------- every built-in hook: sparse == full
def _hook_set(kind):
    evaluate = lambda s: {"val_loss": mse_loss(s.model, make_batches(1, seed=9)[0])}  # noqa: E731
    sets = {
        "eval+best+early": lambda: [
            ftrain.EvalHook(evaluate, every=4, by_epoch=False),
            ftrain.BestCheckpointHook("val_loss"),
            ftrain.EarlyStoppingHook("val_loss", patience=2),
            LoggerHook(every=3, progress=False, tensorboard=False),
        ],
        "eval by epoch": lambda: [
            ftrain.EvalHook(evaluate, every=1),
            LoggerHook(every=5, progress=False, tensorboard=False),
        ],
        "timer+checkpoint": lambda: [
            TimerHook(skip_first_k=1),
            CheckpointHook(3, save_begin=2, max_keep=2),
            LoggerHook(every=2, progress=False, tensorboard=False),
        ],
    }
    return sets[kind]()


@pytest.mark.parametrize("kind", ["eval+best+early", "eval by epoch", "timer+checkpoint"])
@pytest.mark.parametrize("accum", [1, 3])
def test_every_built_in_hook_acts_the_same_on_sparse_and_full_streams(tmp_path, kind, accum):
    batches = make_batches(10)
    step = ftrain.make_step(mse_loss)
    if accum > 1:
        step = ftrain.with_grad_accum(step, every=accum)
    results = {}
    for mode in ("sparse", "full"):
        hooks = _hook_set(kind)
        work = tmp_path / mode
        lp = ftrain.Loop(step, new_state(), batches, hooks, epochs=3, work_dir=work)
        if mode == "sparse":
            lp.run()
        else:
            for _ in lp:
                pass
        logs = [
            {
                k: v
                for k, v in r.items()
                # timing-derived tags differ from run to run (issue 16 added compute_time,
                # perf/* and memory/*)
                if k not in ("time", "elapsed", "eta", "iter_time", "data_time", "compute_time")
                and not k.startswith(("perf/", "memory/"))
            }
            for r in read_jsonl(work / "metrics.jsonl")
        ]
        results[mode] = (
            [p.detach().clone() for p in lp.state.model.parameters()],
            logs,
            sorted(p.name for p in work.glob("*.pth")),
            lp.state.step,
            lp.stop_reason,
        )
    (p1, l1, f1, s1, r1), (p2, l2, f2, s2, r2) = results["sparse"], results["full"]
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert l1 == l2 and f1 == f2 and s1 == s2 and r1 == r2
    assert l1 and ("eval" not in kind or any("val/loss" in r for r in l1))
    assert f1 or "checkpoint" not in kind and "best" not in kind


def test_continuing_a_paused_run_holds_ctrl_c_again_after_jupyter_reset_the_handler():
    import os
    import signal

    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 6:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of a step
        return mse_loss(model, batch)

    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), make_batches(20), [])
    lp.run(steps=3)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as ipykernel does
    try:
        with pytest.raises(KeyboardInterrupt):
            lp.run()
        assert not lp.state.is_consumed and lp.state.step == 6  # the update finished first
    finally:
        signal.signal(signal.SIGINT, previous)


def test_paused_loops_closed_in_any_order_give_the_handlers_back():
    import signal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    a = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(10), [])
    b = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(10), [])
    a.run(steps=2)
    b.run(steps=2)
    a.close()
    b.run()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_pause_on_the_last_batch_ends_the_epoch_first():
    calls = []
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(10),
        [ftrain.EvalHook(lambda s: calls.append(s.epoch) or {"v": 1.0}, every=1)],
        epochs=1,
    )
    lp.run(steps=10)
    assert calls == [1] and lp.done  # the by-epoch evaluation ran; nothing left to do


def test_lowering_max_steps_while_paused_is_honoured():
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        make_batches(100),
        [LoggerHook(50)],
        max_steps=100,
    )
    lp.run(steps=5)
    lp.max_steps = 20
    assert lp.run().step == 20


def test_running_a_cell_again_closes_the_paused_run_of_that_directory(tmp_path):
    batches = make_batches(40)

    def cell():
        lp = ftrain.Loop(
            ftrain.make_step(mse_loss),
            new_state(),
            batches,
            default_like_hooks(),
            max_steps=40,
            work_dir=tmp_path,
            resume="auto",
        )
        lp.run(steps=10)
        return lp

    first = cell()
    with pytest.warns(UserWarning, match="Closing a paused run"):
        second = cell()  # the first is closed (saved at 10) and the second resumes from it
    assert second.state.step == 20 and first._paused is None
    second.run()
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == sorted(steps) and steps[-1] == 40  # no late lines from the first loop


def test_no_built_in_hook_makes_the_stream_full(tmp_path):
    # every built-in hook declares a cadence: together they ask only for their own updates
    from ftrain.dist import SyncBuffersHook

    hooks = [
        *ftrain.default_hooks(log_every=4, checkpoint_every=4),
        ftrain.EvalHook(lambda state: {"val_loss": 1.0}, every=4, by_epoch=False),
        ftrain.BestCheckpointHook("val_loss"),
        ftrain.EarlyStoppingHook("val_loss", patience=100),
        ftrain.hooks.EmptyCacheHook(),
        SyncBuffersHook(every=4),
    ]
    rec = Recorder(n=100)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(9), [*hooks, rec],
                     work_dir=tmp_path)  # fmt: skip
    lp.run()
    assert all(h.cadence != EVERY_MICRO_BATCH for h in lp.hooks), [h.name for h in lp.hooks]
    # only the updates some hook is due at: 5 ends the timer's warm-up, 5 and 9 check the
    # background checkpoint writes of 4 and 8
    assert rec.seen == [4, 5, 8, 9]
