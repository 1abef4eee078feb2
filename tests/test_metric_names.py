"""Issue 21, item 2: one name per metric.

The evaluation returns ``val_loss``; the console, JSONL and TensorBoard show ``val/loss``;
``BestCheckpointHook``, ``EarlyStoppingHook`` and the plateau rule take either name and act
exactly as with the name the evaluation returned (the reference: the same run spelled that
way). Two returned names shown alike are refused.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from helpers import make_batches, make_model, mse_loss, read_jsonl

import ftrain
import ftrain.metric_names as names_module
from ftrain import schedules as S
from ftrain.metric_names import find_metric, shown_name

VAL = make_batches(2, seed=9)


def evaluate(state):
    return {"val_loss": sum(float(mse_loss(state.model, b)) for b in VAL), "acc": 0.5}


def run(tmp_path, metric, *, plateau=False, progress=False):
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.3))
    step = ftrain.make_step(mse_loss)
    if plateau:
        rule = S.plateau(metric, factor=0.5, patience=0, threshold=0.5)
        step = ftrain.with_schedule(step, plateau=rule)
    lrs = []

    def watch(events):
        for ev in events:
            if type(ev).__name__ == "StepEnd":
                lrs.append(ev.state.optimizer.param_groups[0]["lr"])
            yield ev

    best = ftrain.BestCheckpointHook(metric)
    stop = ftrain.EarlyStoppingHook(metric, patience=2)
    hooks = [
        ftrain.EvalHook(evaluate, every=2, by_epoch=False),
        ftrain.LoggerHook(every=100, progress=progress),
        best,
        stop,
        ftrain.hook(watch, cadence=ftrain.Every(steps=1)),
    ]
    lp = ftrain.Loop(step, state, make_batches(12), hooks, max_steps=12, work_dir=tmp_path)
    lp.run()
    return best, stop, lp, lrs


def test_shown_names_and_lookup():
    assert [shown_name(k) for k in ("val_loss", "loss", "val/loss", "test/top1", "val.acc")] == [
        "val/loss", "val/loss", "val/loss", "test/top1", "val/acc"
    ]  # fmt: skip
    metrics = {"val_loss": 1.0, "test/top1": 0.5}
    assert [find_metric(metrics, n) for n in ("val_loss", "val/loss", "loss", "test/top1")] == [
        "val_loss", "val_loss", "val_loss", "test/top1"
    ]  # fmt: skip
    assert find_metric(metrics, "top1") is None  # val/top1 is not test/top1
    assert doctest.testmod(names_module, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("spelled", ["val/loss", "loss"])
def test_hooks_take_the_shown_name_and_act_as_with_the_returned_one(tmp_path, spelled, capsys):
    ref_best, ref_stop, ref_lp, _ = run(tmp_path / "ref", "val_loss")
    best, stop, lp, _ = run(tmp_path / "shown", spelled)
    assert best.best is not None and best.best == ref_best.best  # a best checkpoint is saved
    files = sorted(p.name for p in (tmp_path / "shown").glob("best_*.pth"))
    prefix = "best_val_loss" if spelled == "val/loss" else "best_loss"
    assert files == [ref_best.best_file.replace("best_val_loss", prefix)]
    assert (stop.best, stop.best_step, stop.wait) == (ref_stop.best, ref_stop.best_step,
                                                      ref_stop.wait)  # fmt: skip
    assert lp.stop_reason == ref_lp.stop_reason.replace("val_loss", spelled)
    out = capsys.readouterr().out
    evals = [line for line in out.splitlines() if "val/loss" in line]
    assert evals and all("val/val_loss" not in line for line in out.splitlines())
    marked = [line.endswith("*best") for line in evals]
    assert marked[: len(marked) // 2] == marked[len(marked) // 2 :]  # both spellings mark alike
    rows = [r for r in read_jsonl(tmp_path / "shown" / "metrics.jsonl") if "val/loss" in r]
    assert rows and all("val_loss" not in r for r in rows)


def test_the_plateau_rule_takes_the_shown_name(tmp_path):
    *_, ref = run(tmp_path / "ref", "val_loss", plateau=True)
    *_, lrs = run(tmp_path / "shown", "val/loss", plateau=True)
    assert lrs == ref and min(lrs) < 0.3  # the rule lowered the rate, the same way


def test_two_names_shown_alike_are_refused():
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ev = ftrain.EvalHook(lambda s: {"loss": 1.0, "val_loss": 2.0}, every=1, by_epoch=False)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), state, make_batches(2), [ev], max_steps=2)
    with pytest.raises(ValueError, match="'loss' and 'val_loss', which are both shown as 'val/loss'"):
        lp.run()


def test_the_evaluations_state_goes_through_the_runs_replace_state(tmp_path):
    """``EvalHook`` hands a plateau rule's new state to the run with ``Run.replace_state``, the
    one typed way to change the run's state; a state from elsewhere is refused."""
    from ftrain.run import Run

    assert "replace_state" in Run.__dict__
    replaced, refused = [], []

    def probe(events):
        for ev in events:
            if type(ev).__name__ == "Evaluated":
                replaced.append(ev.run.state.transforms["schedule"].plateau.observed)
                with pytest.raises(ValueError, match="replace_state: the new state is at update"):
                    ev.run.replace_state(ev.run.state.replace(step=ev.state.step + 1))
                refused.append(ev.state.step)
            yield ev

    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.3))
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), plateau=S.plateau("val/loss"))
    hooks = [ftrain.EvalHook(evaluate, every=2, by_epoch=False), ftrain.hook(probe)]
    lp = ftrain.Loop(step, state, make_batches(6), hooks, max_steps=6)
    lp.run()
    assert replaced == [1, 2, 3] and refused == [2, 4, 6]  # the run holds the observed state
    assert lp.state.transforms["schedule"].plateau.observed == 3
