"""Evaluation, invalid-loss, empty-cache and early-stopping hooks."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.events import EpochEnd, Evaluated, RunBegin, RunEnd, StepEnd
from ftrain.hooks import evaluation as evaluation_module
from ftrain.hooks import misc as misc_module
from ftrain.hooks.evaluation import EvalHook
from ftrain.hooks.misc import EarlyStoppingHook, EmptyCacheHook, InvalidLossHook

NAN = float("nan")


# ------------------------------------------------------------------ helpers
def sgd_state(seed=0, lr=0.05, momentum=0.9, groups=False, **model_kw):
    model = make_model(seed, **model_kw)
    if groups:
        params = [
            {"params": model.fc1.parameters()},
            {"params": model.fc2.parameters(), "lr": lr / 10},
        ]
    else:
        params = model.parameters()
    return ftrain.TrainState.create(model, torch.optim.SGD(params, lr=lr, momentum=momentum))


def recorder(log, fn, priority="NORMAL"):
    """A hook appending ``fn(event)`` for each optimizer update."""

    def record(events):
        for ev in events:
            if type(ev) is StepEnd and ev.is_update:
                log.append(fn(ev))
            yield ev

    return ftrain.hook(record, priority=priority)


def scripted(values):
    """An evaluation function returning the next value of ``values`` as ``acc``/``val_loss``."""
    it = iter(values)

    def evaluate(state):
        v = next(it)
        return {"acc": v, "val_loss": v}

    return evaluate


# --------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: EvalHook(lambda s: {}, every=0), ValueError, "every"),
        (lambda: EvalHook("acc"), TypeError, "fn must be"),
        (lambda: InvalidLossHook(interval=0), ValueError, "interval"),
        (lambda: EmptyCacheHook(after_epoch=None), TypeError, "after_epoch"),
        (lambda: EarlyStoppingHook("score"), ValueError, "mode='max'"),
        (lambda: EarlyStoppingHook("acc", mode="up"), ValueError, "'max' or 'min'"),
        (lambda: EarlyStoppingHook("acc", patience=0), ValueError, "patience"),
        (lambda: EarlyStoppingHook("acc", min_delta=-0.1), ValueError, "min_delta"),
    ],
)
def test_bad_arguments_fail_at_construction(make, error, text):
    with pytest.raises(error, match=None) as info:
        make()
    assert text in str(info.value)


def test_reprs_and_priorities_are_readable():
    hooks = [
        EarlyStoppingHook("val/acc"),
        EvalHook(scripted([]), every=2),
        InvalidLossHook(),
        EmptyCacheHook(),
    ]
    plan = ftrain.resolve_hooks(hooks)
    assert [h.name for h in plan] == [
        "invalid_loss",
        "eval",
        "empty_cache",
        "early_stopping",
    ]
    text = repr(plan)
    assert "every 2 epochs" in text
    assert "EarlyStoppingHook('val/acc', mode='max', patience=5" in text


# --------------------------------------------------------------- evaluation
def test_eval_hook_puts_metrics_on_the_stream_after_the_trigger():
    state = sgd_state(dropout=0.5)
    state.model.drop.eval()  # a submodule kept in eval mode stays so
    calls = []

    def evaluate(s):
        calls.append((s.model.training, s.model.drop.training, torch.is_grad_enabled()))
        return {"val_loss": torch.tensor(0.25), "n": 3}

    seen = []

    def downstream(events):
        for ev in events:
            seen.append(ev)
            yield ev

    lp = ftrain.loop(
        ftrain.make_step(mse_loss),
        state,
        make_batches(3),
        [EvalHook(evaluate), ftrain.hook(downstream, priority="LOWEST")],
        epochs=2,
    )
    state = lp.run()
    assert calls == [(False, False, False)] * 2
    assert state.model.training and not state.model.drop.training
    kinds = [type(e).__name__ for e in seen]
    epoch = ["EpochBegin", "StepEnd", "StepEnd", "StepEnd", "EpochEnd", "Evaluated"]
    assert kinds == ["RunBegin", *epoch, *epoch, "RunEnd"]
    evals = [e for e in seen if type(e) is Evaluated]
    assert [e.metrics for e in evals] == [{"val_loss": 0.25, "n": 3.0}] * 2
    assert [(e.state.epoch, e.by_epoch) for e in evals] == [(1, True), (2, True)]


@pytest.mark.parametrize("max_steps, evaluated", [(10, [3, 6, 9, 10]), (9, [3, 6, 9])])
def test_eval_hook_by_step_and_at_end(max_steps, evaluated):
    order = []

    def watch(events):
        for ev in events:
            if type(ev) in (Evaluated, RunEnd):
                order.append((type(ev).__name__, ev.state.step))
            yield ev

    hooks = [
        EvalHook(lambda s: {"acc": float(s.step)}, every=3, by_epoch=False, at_end=True),
        ftrain.hook(watch, priority="LOW"),
    ]
    ftrain.fit(ftrain.make_step(mse_loss), sgd_state(), make_batches(4), hooks, max_steps=max_steps)
    assert order == [("Evaluated", n) for n in evaluated] + [("RunEnd", max_steps)]


def test_eval_hook_rejects_non_dict_results():
    with pytest.raises(TypeError, match="must return a dict of metrics"):
        ftrain.fit(
            ftrain.make_step(mse_loss), sgd_state(), make_batches(2), [EvalHook(lambda s: 0.5)]
        )


@pytest.mark.parametrize(
    "metric, values, best, best_name",
    [
        ("acc", [0.5, 0.7, NAN, 0.7, 0.6], 0.7, "best_acc_epoch_2.pth"),
        ("val_loss", [1.0, 0.4, NAN, 0.4, 0.8], 0.4, "best_val_loss_epoch_2.pth"),
        ("acc", [NAN, 0.1, 0.3, 0.2, 0.3], 0.3, "best_acc_epoch_3.pth"),
    ],
)
def test_best_checkpoint_from_eval_hook(tmp_path, metric, values, best, best_name):
    files_after_each_eval = []

    def watch(events):
        for ev in events:
            if type(ev) is Evaluated:
                files_after_each_eval.append(sorted(p.name for p in tmp_path.glob("best_*.pth")))
            yield ev

    best_hook = ftrain.BestCheckpointHook(metric)
    hooks = [EvalHook(scripted(values)), best_hook, ftrain.hook(watch, priority="LOWEST")]
    ftrain.fit(
        ftrain.make_step(mse_loss), sgd_state(), make_batches(2), hooks, epochs=5, work_dir=tmp_path
    )
    assert best_hook.best == best
    assert sorted(p.name for p in tmp_path.glob("best_*.pth")) == [best_name]
    assert all(len(files) <= 1 for files in files_after_each_eval)


def test_eval_pending_at_a_checkpoint_is_redone_on_resume(tmp_path):
    val = make_batches(2, seed=5)

    def evaluate(state):
        return {"val_loss": sum(float(mse_loss(state.model, b)) for b in val)}

    def run(work_dir, resume=None, epochs=5):
        evals = []

        def watch(events):
            for ev in events:
                if type(ev) is Evaluated:
                    evals.append((ev.state.epoch, ev.metrics["val_loss"]))
                yield ev

        stopper = EarlyStoppingHook("val_loss", patience=2)
        hooks = [
            EvalHook(evaluate),
            ftrain.CheckpointHook(interval=1, by_epoch=True),
            ftrain.BestCheckpointHook("val_loss"),
            stopper,
            ftrain.hook(watch, priority="LOWEST"),
        ]
        state = sgd_state(lr=0.5)
        lp = ftrain.loop(
            ftrain.make_step(mse_loss),
            state,
            make_batches(3),
            hooks,
            epochs=epochs,
            work_dir=work_dir,
            resume=resume,
        )
        lp.run()
        return evals, stopper.state_dict()

    straight, stop_a = run(tmp_path / "a")
    run(tmp_path / "b", epochs=2)
    resumed, stop_b = run(tmp_path / "b", resume=tmp_path / "b" / "epoch_2.pth")
    # epoch_2.pth was written while EpochEnd passed, before that evaluation ran:
    # the resumed run performs it first, and everything after matches.
    assert resumed == straight[1:]
    assert stop_b == stop_a


# ------------------------------------------------------------- invalid loss
def nan_batches(n, bad):
    batches = make_batches(n)
    x, y = batches[bad]
    batches[bad] = (torch.full_like(x, NAN), y)
    return batches


@pytest.mark.parametrize(
    "interval, bad_step, raised_at, text",
    [(1, 7, 7, "at step 7"), (5, 7, 10, "between step 6 and step 10"), (4, 4, 4, "step 4")],
)
def test_invalid_loss_raises_at_the_first_check_after_the_nan(interval, bad_step, raised_at, text):
    steps = []
    hooks = [InvalidLossHook(interval), recorder(steps, lambda ev: ev.state.step, "LOWEST")]
    with pytest.raises(FloatingPointError, match=f"The loss is nan at step {raised_at} ") as info:
        ftrain.fit(ftrain.make_step(mse_loss), sgd_state(), nan_batches(12, bad_step - 1), hooks)
    assert text in str(info.value) and "with_nonfinite_check" in str(info.value)
    assert steps == list(range(1, raised_at))  # later hooks never saw the failing step


def test_invalid_loss_silent_when_finite_or_not_checked():
    ftrain.fit(ftrain.make_step(mse_loss), sgd_state(), make_batches(6), [InvalidLossHook(2)])
    # a NaN at step 12 with interval 5 over 11 steps is never checked
    ftrain.fit(
        ftrain.make_step(mse_loss),
        sgd_state(),
        nan_batches(12, 11),
        [InvalidLossHook(5)],
        max_steps=11,
    )
    with pytest.raises(KeyError, match="key="):
        ftrain.fit(
            ftrain.make_step(mse_loss), sgd_state(), make_batches(2), [InvalidLossHook(1, key="x")]
        )


# -------------------------------------------------------------- empty cache
@pytest.mark.parametrize(
    "kwargs, calls",
    [({}, 3), ({"after_step": True}, 3 + 12), ({"before_epoch": True, "after_epoch": False}, 3)],
)
def test_empty_cache_calls(monkeypatch, kwargs, calls):
    count = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: count.append(1))
    ftrain.fit(
        ftrain.make_step(mse_loss),
        sgd_state(),
        make_batches(4),
        [EmptyCacheHook(**kwargs)],
        epochs=3,
    )
    assert len(count) == calls


def test_empty_cache_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("called without CUDA"))
    state = ftrain.fit(
        ftrain.make_step(mse_loss), sgd_state(), make_batches(2), [EmptyCacheHook(True, True)]
    )
    assert state.step == 2


# ----------------------------------------------------------- early stopping
@pytest.mark.parametrize(
    "metric, values, kwargs, stop_epoch",
    [
        ("val_loss", [1.0, 0.9, 0.95, 0.92, 0.5, 0.4], {"patience": 2}, 4),
        ("val_loss", [1.0, 0.95, 0.93, 0.5], {"patience": 2, "min_delta": 0.1}, 3),
        ("acc", [0.1, NAN, 0.2, NAN, NAN, 0.9], {"patience": 2}, 5),
        ("acc", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], {"patience": 1}, None),
    ],
)
def test_early_stopping_after_patience(metric, values, kwargs, stop_epoch):
    events = []

    def watch(evs):
        for ev in evs:
            events.append(type(ev))
            yield ev

    stopper = EarlyStoppingHook(metric, **kwargs)
    lp = ftrain.loop(
        ftrain.make_step(mse_loss),
        sgd_state(),
        make_batches(2),
        [EvalHook(scripted(values)), stopper, ftrain.hook(watch, priority="LOWEST")],
        epochs=6,
    )
    state = lp.run()
    assert events[0] is RunBegin and events[-1] is RunEnd  # a normal end
    if stop_epoch is None:
        assert lp.stop_reason is None and state.epoch == 6
    else:
        assert state.epoch == stop_epoch
        assert lp.stop_reason.startswith(f"early stopping: {metric} did not improve")
        assert events.count(EpochEnd) == stop_epoch


def test_early_stopping_state_and_missing_metric():
    hook = EarlyStoppingHook("val_loss", patience=3)
    assert hook.mode == "min"
    assert [hook.observe(v, step=i) for i, v in enumerate([2.0, 1.0, 1.5, math.inf])] == [
        False,
        False,
        False,
        False,
    ]
    other = EarlyStoppingHook("val_loss", patience=3)
    other.load_state_dict(hook.state_dict())
    assert (other.best, other.best_step, other.wait) == (1.0, 1, 2)
    assert other.observe(1.2) is True
    with pytest.warns(UserWarning, match="no 'val_loss'"):
        ftrain.fit(
            ftrain.make_step(mse_loss),
            sgd_state(),
            make_batches(2),
            [EvalHook(lambda s: {"acc": 1.0}), EarlyStoppingHook("val_loss")],
            epochs=2,
        )


# ----------------------------------------------------------------- doctests
@pytest.mark.parametrize(
    "module",
    [evaluation_module, misc_module],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
