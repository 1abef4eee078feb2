"""Exact resume in every stop path: the resumed run ends as one that never stopped.

Reference: the same run (tests/resume_train.py) trained without a stop. Compared:
weights, optimizer state, EMA, counters, the best-checkpoint state and the
lines of metrics.jsonl (apart from wall-clock fields).
"""

import signal
import time

import pytest
import torch
from resume_train import build, outcome

import ftrain
from ftrain.events import Evaluated, StepEnd

_STRAIGHT: dict[str, dict] = {}
TRAINING_SECONDS: dict[str, float] = {}  # how long each straight run took


def straight(config, tmp_path_factory):
    """The uninterrupted run's outcome (computed once per configuration)."""
    if config not in _STRAIGHT:
        t0 = time.perf_counter()
        lp = build(config, tmp_path_factory.mktemp(f"straight-{config}"), resume=None)
        lp.run()
        _STRAIGHT[config] = outcome(lp)
        TRAINING_SECONDS[config] = time.perf_counter() - t0
    return _STRAIGHT[config]


def assert_same(got, expected, where="outcome"):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), f"{where}: keys differ"
        for k in expected:
            assert_same(got[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), f"{where}: {len(got)} items, expected {len(expected)}"
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def resume_to_end(config, work_dir):
    lp = build(config, work_dir)
    lp.run()
    assert lp.resumed_from is not None
    return outcome(lp)


class Killed(BaseException):
    """Stands in for SIGKILL: no hook saves on it (runs here have no auto-checkpoint)."""


def crash_when(predicate):
    """A hook of the lowest priority raising :class:`Killed` at the first event matching."""

    def crash(events):
        for ev in events:
            if predicate(ev):
                raise Killed
            yield ev

    return ftrain.hooks.Hook(crash, priority="LOWEST")


# ---------------------------------------------------------------- signals
@pytest.mark.parametrize(
    ("config", "sample", "signum"),
    [
        ("sdl0", 37, signal.SIGINT),
        ("sdl0", 21, signal.SIGTERM),
        ("sdl2", 37, signal.SIGINT),
        ("plain", 22, signal.SIGINT),  # batch 5: micro-step 1 of a window of 2
        ("plain", 26, signal.SIGTERM),  # batch 6: inside a window (a partial log line)
        ("dl_nogen", 37, signal.SIGINT),
        ("accum29", 50, signal.SIGTERM),
    ],
)
def test_a_signal_while_a_batch_is_read_resumes_exactly(
    config, sample, signum, tmp_path, tmp_path_factory
):
    expected = straight(config, tmp_path_factory)
    lp = build(config, tmp_path, trigger=(sample, signum, str(tmp_path / "fired")))
    with pytest.raises((KeyboardInterrupt, SystemExit)) as info:
        lp.run()
    assert (tmp_path / "fired").exists() and (tmp_path / "interrupted.pth").exists()
    if signum == signal.SIGTERM:
        assert info.value.code == ftrain.loop.PREEMPTED_EXIT_CODE
    assert_same(resume_to_end(config, tmp_path), expected)


def test_a_second_ctrl_c_while_one_is_held_raises_at_once(tmp_path):
    class TwoCtrlC:
        def __iter__(self):
            for i in range(6):
                if i == 3:
                    signal.raise_signal(signal.SIGINT)
                    signal.raise_signal(signal.SIGINT)  # a hanging loader: press again
                yield torch.ones(2, 2)

    step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
    m = torch.nn.Linear(2, 1)
    lp = ftrain.Loop(
        step, ftrain.TrainState.create(m, torch.optim.SGD(m.parameters())), TwoCtrlC(), []
    )
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    assert lp.state.step == 3  # raised inside the read of batch 3: no step trained on it


def test_ctrl_c_in_the_callers_own_code_is_not_held():
    step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
    m = torch.nn.Linear(2, 1)
    state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters()))
    lp = ftrain.Loop(step, state, [torch.ones(2, 2)] * 4, [])
    reached = []
    with pytest.raises(KeyboardInterrupt):
        for ev in lp:
            if type(ev) is StepEnd:
                signal.raise_signal(signal.SIGINT)
                reached.append(ev.state.step)  # not reached: the signal acts at once
    assert reached == []


# ------------------------------------------------- SIGKILL after a checkpoint
@pytest.mark.parametrize("when", ["after the checkpoint", "after the evaluation"])
def test_killed_after_the_flush_of_a_partial_window_resumes_exactly(
    when, tmp_path, tmp_path_factory
):
    # 29 batches, windows of 3: update 10 is the flush at epoch 0's end, saved as iter_10
    expected = straight("accum29", tmp_path_factory)
    kind = StepEnd if when == "after the checkpoint" else Evaluated
    kill = crash_when(lambda ev: type(ev) is kind and ev.state.step == 10)
    lp = build("accum29", tmp_path, extra_hooks=(kill,), auto_checkpoint=False)
    with pytest.raises(Killed):
        lp.run()
    assert lp.state.step == 10 and (tmp_path / "iter_10.pth").exists()
    assert_same(resume_to_end("accum29", tmp_path), expected)


def test_killed_after_an_evaluation_logs_it_once(tmp_path, tmp_path_factory):
    expected = straight("sdl0", tmp_path_factory)
    kill = crash_when(lambda ev: type(ev) is Evaluated and ev.state.step == 6)
    lp = build("sdl0", tmp_path, extra_hooks=(kill,), auto_checkpoint=False)
    with pytest.raises(Killed):
        lp.run()
    got = resume_to_end("sdl0", tmp_path)
    val_steps = [line["step"] for line in got["metrics"] if "val/loss" in line]
    assert val_steps == sorted(set(val_steps))  # no evaluation logged twice
    assert_same(got, expected)


# ------------------------------------------- pause + close, break, hook error
@pytest.mark.parametrize(("config", "steps"), [("sdl0", 5), ("accum29", 10), ("plain", 7)])
def test_pause_close_then_resume_in_a_new_loop_is_exact(config, steps, tmp_path, tmp_path_factory):
    expected = straight(config, tmp_path_factory)
    lp = build(config, tmp_path)
    lp.run(steps=steps)
    lp.close()
    assert_same(resume_to_end(config, tmp_path), expected)


def test_break_out_of_the_event_loop_then_resume_is_exact(tmp_path, tmp_path_factory):
    expected = straight("sdl0", tmp_path_factory)
    lp = build("sdl0", tmp_path)
    for ev in lp:
        if type(ev) is StepEnd and ev.state.micro_step == 9:  # inside a window of 2
            break
    assert (tmp_path / "interrupted.pth").exists()
    assert_same(resume_to_end("sdl0", tmp_path), expected)


@pytest.mark.parametrize(
    ("micro_step", "priority"),
    [(13, "HIGH"), (14, "LOW")],  # inside a window, before every hook; an update, after EMA
)
def test_an_error_in_a_hook_then_resume_is_exact(micro_step, priority, tmp_path, tmp_path_factory):
    expected = straight("plain", tmp_path_factory)

    def failing(events):
        for ev in events:
            if type(ev) is StepEnd and ev.state.micro_step == micro_step:
                raise ValueError("a hook failed")
            yield ev

    lp = build("plain", tmp_path, extra_hooks=(ftrain.hooks.Hook(failing, priority=priority),))
    with pytest.raises(ValueError, match="a hook failed"):
        lp.run()
    assert_same(resume_to_end("plain", tmp_path), expected)


def test_a_loader_position_that_cannot_be_restored_is_warned_about(tmp_path):
    lp = build("sdl0", tmp_path)
    lp.run(steps=3)
    lp.close()  # interrupted.pth holds a StatefulDataLoader position, mid-epoch
    resumed = build("plain", tmp_path)  # the same run, now reading a plain iterable
    with pytest.warns(UserWarning, match="re-reading the epoch's first 6 batches"):
        resumed.run(steps=1)
    resumed.close()


@pytest.mark.parametrize("config", ["sdl0", "plain"])
def test_ctrl_c_then_run_again_in_the_same_process_is_exact(config, tmp_path, tmp_path_factory):
    # a notebook: Ctrl-C while a batch is read, then run the cell again
    expected = straight(config, tmp_path_factory)
    lp = build(config, tmp_path, trigger=(22, signal.SIGINT, str(tmp_path / "fired")))
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    lp.run()
    assert_same(outcome(lp), expected)


def test_a_sigusr1_handler_set_before_the_run_stays_in_charge():
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        m = torch.nn.Linear(2, 1)
        state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters()))

        def notify(events):
            for ev in events:
                if type(ev) is StepEnd and ev.state.step == 2:
                    signal.raise_signal(signal.SIGUSR1)
                yield ev

        assert ftrain.Loop(step, state, [torch.ones(2, 2)] * 4, [notify]).run().step == 4
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
