"""Evaluation, empty-cache and early-stopping hooks; the non-finite check."""

from __future__ import annotations

import doctest
import math
import warnings

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.events import EpochEnd, Evaluated, RunBegin, RunEnd, StepEnd
from ftrain.hooks import evaluation as evaluation_module
from ftrain.hooks import misc as misc_module
from ftrain.hooks.evaluation import EvalHook
from ftrain.hooks.misc import EarlyStoppingHook, EmptyCacheHook

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


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


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
        EmptyCacheHook(),
    ]
    plan = ftrain.hooks.resolve_hooks(hooks)
    assert [h.name for h in plan] == [
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

    lp = ftrain.Loop(
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
    ftrain.Loop(
        ftrain.make_step(mse_loss), sgd_state(), make_batches(4), hooks, max_steps=max_steps
    ).run()
    assert order == [("Evaluated", n) for n in evaluated] + [("RunEnd", max_steps)]


def test_eval_hook_rejects_non_dict_results():
    with pytest.raises(TypeError, match="must return a dict of metrics"):
        ftrain.Loop(
            ftrain.make_step(mse_loss), sgd_state(), make_batches(2), [EvalHook(lambda s: 0.5)]
        ).run()


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
    ftrain.Loop(
        ftrain.make_step(mse_loss), sgd_state(), make_batches(2), hooks, epochs=5, work_dir=tmp_path
    ).run()
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
        lp = ftrain.Loop(
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


# ------------------------------------------------- non-finite (was InvalidLossHook)
def nan_batches(n, bad):
    batches = make_batches(n)
    for i in [bad] if isinstance(bad, int) else bad:
        x, y = batches[i]
        batches[i] = (torch.full_like(x, NAN), y)
    return batches


def plain_params(batches):
    """The weights after a plain PyTorch loop over ``batches`` (the reference)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for batch in batches:
        opt.zero_grad()
        mse_loss(model, batch).backward()
        opt.step()
    return params_of(model)


@pytest.mark.parametrize("bad_step", [1, 7])
def test_nonfinite_check_raises_at_the_bad_update_before_it_is_applied(bad_step):
    steps = []
    batches = nan_batches(12, bad_step - 1)
    step = ftrain.with_nonfinite_check(ftrain.make_step(mse_loss))
    hooks = [recorder(steps, lambda ev: ev.state.step, "LOWEST")]
    with pytest.raises(FloatingPointError, match=f"at step {bad_step - 1} .*nan") as info:
        ftrain.Loop(step, sgd_state(), batches, hooks=hooks).run()
    assert "Lower the learning rate" in str(info.value)
    assert steps == list(range(1, bad_step))  # later hooks never saw the failing update
    # nothing lost: the error's state is the plain loop's after the good updates
    assert_bitwise(params_of(info.value.state.model), plain_params(batches[: bad_step - 1]))


def test_nonfinite_check_on_finite_losses_trains_like_a_plain_loop():
    batches = make_batches(6)
    for action in ("raise", "skip"):
        step = ftrain.with_nonfinite_check(ftrain.make_step(mse_loss), action)
        state = ftrain.Loop(step, sgd_state(), batches, hooks=[]).run()
        assert_bitwise(params_of(state.model), plain_params(batches))
        assert state.transforms["nonfinite"].skipped == 0


def test_a_run_of_skipped_updates_warns_once_naming_causes_and_fixes(recwarn):
    # issue 15: 30 of 30 updates skipped used to be silent
    step = ftrain.with_nonfinite_check(ftrain.make_step(mse_loss), "skip")
    start = sgd_state()
    before = params_of(start.model)
    state = ftrain.Loop(step, start, nan_batches(30, range(30)), hooks=[]).run()
    warned = [str(w.message) for w in recwarn if "in a row" in str(w.message)]
    assert len(warned) == 1, warned
    assert "skipped 10 updates in a row (updates 1 to 10)" in warned[0]
    for cause in ("learning rate", "fp16", "bad data", "action='raise'"):
        assert cause in warned[0]
    assert state.transforms["nonfinite"].skipped == 30 and state.step == 30
    assert_bitwise(params_of(state.model), before)


def test_skips_broken_by_a_good_update_or_warn_after_none_do_not_warn(recwarn):
    make = ftrain.make_step
    bad = list(range(9)) + list(range(10, 19))  # 9 bad, 1 good, 9 bad
    step = ftrain.with_nonfinite_check(make(mse_loss), "skip")
    state = ftrain.Loop(step, sgd_state(), nan_batches(20, bad), hooks=[]).run()
    assert state.transforms["nonfinite"].skipped == 18
    step = ftrain.with_nonfinite_check(make(mse_loss), "skip", warn_after=None)
    ftrain.Loop(step, sgd_state(), nan_batches(12, range(12)), hooks=[]).run()
    assert not [w for w in recwarn if "in a row" in str(w.message)]
    step = ftrain.with_nonfinite_check(make(mse_loss), "skip", warn_after=3)
    with pytest.warns(UserWarning, match=r"skipped 3 updates in a row \(updates 2 to 4\)"):
        ftrain.Loop(step, sgd_state(), nan_batches(5, [1, 2, 3]), hooks=[]).run()


@pytest.mark.parametrize("warn_after", [0, "10", 2.5, True])
def test_nonfinite_check_arguments_are_checked(warn_after):
    with pytest.raises(TypeError, match="warn_after must be a whole number >= 1"):
        ftrain.with_nonfinite_check(ftrain.make_step(mse_loss), "skip", warn_after=warn_after)
    with pytest.raises(ValueError, match="action must be 'raise' or 'skip'"):
        ftrain.with_nonfinite_check(ftrain.make_step(mse_loss), "warn")


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"max_norm": "1.0"}, TypeError, "max_norm must be a number > 0, e.g. 1.0, got '1.0' "
         "(str); pass max_norm=1.0"),
        ({"max_norm": 1.0, "norm_type": "2"}, TypeError, "norm_type must be a number > 0"),
        ({"mode": "value", "clip_value": "0.5"}, TypeError, "pass clip_value=0.5"),
        ({"mode": "average", "tolerance": "2"}, TypeError, "tolerance must be a number > 0"),
        ({"mode": "moving_average", "momentum": "0.9"}, TypeError, "momentum must be a number"),
        ({"mode": "value", "clip_value": [1.0]}, TypeError, "got [1.0] (list); pass a number"),
        ({"max_norm": True}, TypeError, "max_norm must be a number"),
        ({}, ValueError, "with_clip(mode='norm') needs max_norm"),
        ({"max_norm": 0}, ValueError, "max_norm must be a number > 0"),
        ({"max_norm": NAN}, ValueError, "max_norm must be a number > 0"),
        ({"mode": "value"}, ValueError, "needs clip_value"),
        ({"mode": "moving_average", "momentum": 1.0}, ValueError, "momentum must be a number in"),
        ({"mode": "average", "tolerance": -1}, ValueError, "tolerance must be a number > 0"),
        ({"max_norm": 1.0, "norm_type": 0}, ValueError, "norm_type must be a number > 0"),
    ],
)  # fmt: skip
def test_with_clip_checks_every_number_at_construction(kwargs, error, text):
    # issue 15: max_norm="1.0" used to fail later with a TypeError from a comparison
    with pytest.raises(error) as info:
        ftrain.with_clip(ftrain.make_step(mse_loss), **kwargs)
    assert text in str(info.value)


def test_with_clip_takes_numbers_of_any_kind():
    step = ftrain.with_clip(ftrain.make_step(mse_loss), max_norm=torch.tensor(2), norm_type=1)
    assert (step["clip"].max_norm, step["clip"].norm_type) == (2.0, 1.0)
    inf = ftrain.with_clip(ftrain.make_step(mse_loss), max_norm=math.inf, norm_type=math.inf)
    assert inf["clip"].norm_type == math.inf


def test_best_checkpoint_warns_once_when_evaluation_lacks_its_metric(tmp_path):
    # issue 15 asked for a warning; issue 21: "val/loss" (the name the logs show for
    # "val_loss") is the same metric, so only a name neither spelling matches warns
    hooks = [
        EvalHook(lambda s: {"val_loss": 1.0, "acc": 0.5}),
        ftrain.BestCheckpointHook("f1_score", mode="max"),
    ]
    with pytest.warns(UserWarning) as record:
        lp = ftrain.Loop(ftrain.make_step(mse_loss), sgd_state(), make_batches(2), hooks=hooks,
                         epochs=3, work_dir=tmp_path)  # fmt: skip
        lp.run()
    msgs = [str(w.message) for w in record if "BestCheckpointHook" in str(w.message)]
    assert msgs == [
        "BestCheckpointHook: the evaluation returned no 'f1_score' (it returned ['acc', "
        "'val_loss'], shown as ['val/acc', 'val/loss']); Pass one of those names. No best "
        "checkpoint is saved without it."
    ]
    assert not list(tmp_path.glob("best_*"))
    # either name of the metric: a best file, no warning
    for metric, where in (("val_loss", "a"), ("val/loss", "b"), ("loss", "c")):
        good = [EvalHook(lambda s: {"val_loss": 1.0}), ftrain.BestCheckpointHook(metric)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ftrain.Loop(ftrain.make_step(mse_loss), sgd_state(), make_batches(2), hooks=good,
                        work_dir=tmp_path / where).run()  # fmt: skip
        assert [p.name for p in (tmp_path / where).glob("best_*")] == [
            "best_val_loss_epoch_1.pth" if metric != "loss" else "best_loss_epoch_1.pth"
        ]


def test_hooks_declare_their_cadence():
    every = ftrain.Every
    assert EvalHook(scripted([]), every=3).cadence == every(epochs=3)
    assert EvalHook(scripted([]), every=3, by_epoch=False).cadence == every(steps=3)
    assert EmptyCacheHook().cadence == every() and EmptyCacheHook(after_step=True).cadence.due(7)
    for hook in (EarlyStoppingHook("acc"), ftrain.BestCheckpointHook("acc"),
                 ftrain.hooks.AutoCheckpointHook()):  # fmt: skip
        assert hook.cadence == every()  # Evaluated events / a stop only
    assert ftrain.CheckpointHook(4).cadence == every(steps=4)
    assert ftrain.CheckpointHook(4, by_epoch=True).cadence == every(epochs=4)
    # save_begin=6, interval 4: exactly 6, 10, 14... (also a coprime pair: no update in between)
    for interval, begin in ((4, 6), (1000, 1), (3, 0)):
        hook = ftrain.CheckpointHook(interval, save_begin=begin)
        assert [n for n in range(1, 3000) if hook.cadence.due(n)] == [
            n for n in range(1, 3000) if hook.should_save(n)]  # fmt: skip


def test_checkpoint_hook_sees_only_the_updates_it_saves_at(tmp_path):
    seen = []

    @ftrain.hook(priority="LOWEST", cadence=ftrain.Every(steps=1000))
    def spy(events):
        for ev in events:
            if isinstance(ev, StepEnd):
                seen.append(ev.state.step)
            yield ev

    # in the background (run length known) also the update after each save: a failed
    # write surfaces there
    for background, expected in ((False, [2, 5, 8]), (True, [2, 3, 5, 6, 8, 9])):
        seen.clear()
        hook = ftrain.CheckpointHook(3, save_begin=2, save_last=False, background=background)
        ftrain.Loop(ftrain.make_step(mse_loss), sgd_state(), make_batches(10), hooks=[hook, spy],
                    work_dir=tmp_path / str(background)).run()  # fmt: skip
        assert seen == expected
        assert sorted(p.name for p in (tmp_path / str(background)).glob("iter_*")) == [
            "iter_2.pth", "iter_5.pth", "iter_8.pth"]  # fmt: skip


def test_h2_docstring_examples():
    import importlib

    for name in ("hooks.checkpoint", "hooks.rules", "hooks.profiler", "transforms.clip",
                 "transforms.nonfinite", "transforms.unused", "hooks.defaults"):  # fmt: skip
        module = importlib.import_module(f"ftrain.{name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name


# -------------------------------------------------------------- empty cache
@pytest.mark.parametrize(
    "kwargs, calls",
    [({}, 3), ({"after_step": True}, 3 + 12), ({"before_epoch": True, "after_epoch": False}, 3)],
)
def test_empty_cache_calls(monkeypatch, kwargs, calls):
    count = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: count.append(1))
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        sgd_state(),
        make_batches(4),
        [EmptyCacheHook(**kwargs)],
        epochs=3,
    ).run()
    assert len(count) == calls


def test_empty_cache_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("called without CUDA"))
    state = ftrain.Loop(
        ftrain.make_step(mse_loss), sgd_state(), make_batches(2), [EmptyCacheHook(True, True)]
    ).run()
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
    lp = ftrain.Loop(
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
        ftrain.Loop(
            ftrain.make_step(mse_loss),
            sgd_state(),
            make_batches(2),
            [EvalHook(lambda s: {"acc": 1.0}), EarlyStoppingHook("val_loss")],
            epochs=2,
        ).run()


# ----------------------------------------------------------------- doctests
@pytest.mark.parametrize(
    "module",
    [evaluation_module, misc_module],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
