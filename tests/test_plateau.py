"""The plateau rule (``with_schedule(plateau=...)``) against torch's ``ReduceLROnPlateau``.

The same metric sequence drives both: through ``Step.observe`` directly, and in a real
``Loop`` whose ``EvalHook`` evaluations feed it, resumed from a mid-run checkpoint.
"""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
import ftrain.plateau
from ftrain import schedules as S
from ftrain.events import StepEnd

LRS = (0.05, 0.5)  # two param groups, as MMEngine's scheduler tests


def _groups(model):
    return [
        {"params": model.fc1.parameters()},
        {"params": model.fc2.parameters(), "lr": LRS[1]},
    ]


def torch_run(metrics, batches, **kw):
    """A plain loop: SGD, ``ReduceLROnPlateau.step(metric)`` after each update."""
    model = make_model(0)
    opt = torch.optim.SGD(_groups(model), lr=LRS[0], momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kw)
    lrs = []
    for batch, metric in zip(batches, metrics, strict=True):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        mse_loss(model, batch).backward()
        opt.step()
        sched.step(metric)
    return lrs, model


def ftrain_run(metrics, batches, **kw):
    """The plateau rule fed through ``Step.observe``; the lrs the loss function saw."""
    kw = {("min_value" if k == "min_lr" else k): v for k, v in kw.items()}
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(_groups(model), lr=7.0, momentum=0.9))
    for group, lr in zip(state.optimizer.param_groups, LRS):  # (7.0: group 0 set below)
        group["lr"] = lr
    optimizer, lrs = state.optimizer, []

    def loss_fn(m, batch):
        lrs.append([g["lr"] for g in optimizer.param_groups])
        return mse_loss(m, batch)

    step = ftrain.with_schedule(ftrain.make_step(loss_fn), plateau=S.plateau("val_loss", **kw))
    for batch, metric in zip(batches, metrics, strict=True):
        state, _ = step(state, batch)
        state = step.observe(state, {"val_loss": metric})
    return lrs, model, state


MMENGINE_LESS = [10.0, 9.0, 8.0, 7.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0]  # its own test sequences
MMENGINE_GREATER = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
WALK = [1.0, 0.8, 0.81, 0.79, 0.8, 0.8, 0.6, 0.6, 0.61, 0.6, 0.59, 0.59, 0.6, 0.3, 0.3, 0.3]
WALK += [0.31, 0.3, math.nan, 0.29, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]

CASES = {
    "mmengine less rel": (MMENGINE_LESS, dict(factor=0.1, patience=2, cooldown=1, threshold=0.01)),
    "mmengine less abs": (
        MMENGINE_LESS,
        dict(factor=0.1, patience=2, cooldown=1, threshold=0.9, threshold_mode="abs"),
    ),
    "mmengine greater rel": (
        MMENGINE_GREATER,
        dict(mode="max", factor=0.1, patience=2, cooldown=1, threshold=0.01),
    ),
    "mmengine greater abs": (
        MMENGINE_GREATER,
        dict(mode="max", factor=0.1, patience=2, cooldown=1, threshold=0.9, threshold_mode="abs"),
    ),
    "mmengine min_value": (
        MMENGINE_LESS,
        dict(factor=0.1, patience=2, cooldown=1, threshold=0.01, min_lr=0.01),
    ),
    "walk, floors per group": (
        WALK,
        dict(factor=0.5, patience=1, cooldown=2, threshold=1e-3, min_lr=[0.01, 0.2]),
    ),
    "walk, patience 0, abs": (
        WALK,
        dict(factor=0.7, patience=0, threshold=0.005, threshold_mode="abs"),
    ),
    "walk, max": ([-v for v in WALK], dict(mode="max", factor=0.3, patience=2)),
    "walk, eps blocks a small cut": (WALK, dict(factor=0.5, patience=0, eps=0.02)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plateau_equals_torch_reducelronplateau(case):
    metrics, kw = CASES[case]
    batches = make_batches(len(metrics))
    want, torch_model = torch_run(metrics, batches, **kw)
    got, model, state = ftrain_run(metrics, batches, **kw)
    assert got == want  # the same floats: the lr of every group at every update
    assert len({tuple(r) for r in want}) > 1  # the case does lower the learning rate
    for a, b in zip(model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert state.transforms["schedule"].plateau.observed == len(metrics)


def test_plateau_caps_a_warmup():
    """With a schedule the rule lowers a ceiling over it: a warmup still ramps below it."""
    metrics = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    lr = S.warmup(S.constant(0.05), iters=4, ratio=0.25)
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    optimizer, seen = state.optimizer, []

    def loss_fn(m, batch):
        seen.append(optimizer.param_groups[0]["lr"])
        return mse_loss(m, batch)

    rule = S.plateau("val_loss", factor=0.5, patience=0, cooldown=10)  # one cut
    step = ftrain.with_schedule(ftrain.make_step(loss_fn), lr=lr, plateau=rule)
    for batch, metric in zip(make_batches(6), metrics):
        state, _ = step(state, batch)
        state = step.observe(state, {"val_loss": metric})
    # the 2nd evaluation (after update 1) cuts what update 2 would use: lr(2) * 0.5 caps the
    # rest of the ramp
    assert seen == [lr(0), lr(1)] + [lr(2) * 0.5] * 4 and lr(2) * 0.5 < lr(1) < lr(5)


# ----------------------------------------------------------------- in a Loop, with a resume
SEQUENCE = [1.0, 0.9, 0.9, 0.9, 0.85, 0.85, 0.85, 0.85, 0.84, 0.84, 0.84, 0.7]  # per epoch
EPOCHS, BATCHES = len(SEQUENCE), 3
PLATEAU = dict(factor=0.5, patience=1, cooldown=1, threshold=0.02, min_lr=[0.004, 0.1])


def evaluate(state):
    """The metric of the epoch just ended (a scripted sequence, the same on a resumed run)."""
    return {"val_loss": SEQUENCE[state.epoch - 1]}


def loop_run(work_dir, resume=None):
    model = make_model(0)
    lr0 = 0.05 if resume is None else 9.0  # a resumed run takes the lrs from the checkpoint
    state = ftrain.TrainState.create(model, torch.optim.SGD(_groups(model), lr=lr0))
    kw = {("min_value" if k == "min_lr" else k): v for k, v in PLATEAU.items()}
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), plateau=S.plateau("val_loss", **kw))
    seen = []

    def record(events):
        for ev in events:
            if type(ev) is StepEnd and ev.is_update:
                seen.append([g["lr"] for g in ev.state.optimizer.param_groups])
            yield ev

    hooks = [
        ftrain.EvalHook(evaluate),
        ftrain.CheckpointHook(interval=1, by_epoch=True),
        ftrain.hook(record),
    ]
    lp = ftrain.Loop(
        step, state, make_batches(BATCHES), hooks, epochs=EPOCHS, work_dir=work_dir, resume=resume
    )
    return seen, lp.run()


def test_plateau_in_a_loop_fed_by_evalhook_and_resumed_equals_torch(tmp_path):
    # torch: ReduceLROnPlateau.step(metric) after each epoch's last update
    model = make_model(0)
    opt = torch.optim.SGD(_groups(model), lr=LRS[0])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **PLATEAU)
    want = []
    for epoch in range(EPOCHS):
        for batch in make_batches(BATCHES):
            want.append([g["lr"] for g in opt.param_groups])
            opt.zero_grad()
            mse_loss(model, batch).backward()
            opt.step()
        sched.step(SEQUENCE[epoch])
    straight, final = loop_run(tmp_path / "a")
    assert straight == want
    assert len({tuple(r) for r in want}) >= 3  # lowered at least twice, a floor reached
    assert want[-1][1] == 0.1 and want[-1][0] < LRS[0] / 4
    for a, b in zip(final.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # resumed from the checkpoint of epoch 5 (the evaluation of epoch 5 is redone at once)
    resumed, again = loop_run(tmp_path / "b", resume=tmp_path / "a" / "epoch_5.pth")
    assert resumed == straight[5 * BATCHES :]
    for a, b in zip(again.model.parameters(), final.model.parameters(), strict=True):
        assert torch.equal(a, b)
    mine, theirs = again.transforms["schedule"].plateau, final.transforms["schedule"].plateau
    assert mine == theirs and mine.observed == EPOCHS
    assert (mine.best, mine.bad, mine.cooldown) == (
        sched.best,
        sched.num_bad_epochs,
        sched.cooldown_counter,
    )


# ----------------------------------------------------------------------------- errors
def test_a_metric_the_evaluation_does_not_return_is_named():
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), plateau=S.plateau("val/loss"))
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, _ = step(state, make_batches(1)[0])
    # another evaluation (a test set's) is not counted, with a warning naming both (it was an
    # error: a second EvalHook returning other metrics stopped the run)
    with pytest.warns(UserWarning, match=r"watches 'val/loss'.*returned \['val_acc'\]"):
        assert step.observe(state, {"val_acc": 1.0}) is state
    # issue 21: "val/loss" is the name the logs show for "val_loss": the same metric
    other = ftrain.with_schedule(ftrain.make_step(mse_loss), plateau=S.plateau("val_loss"))
    seen = step.observe(state, {"val_loss": 1.0}).transforms["schedule"].plateau
    assert seen == other.observe(state, {"val_loss": 1.0}).transforms["schedule"].plateau
    assert seen.observed == 1 and seen.best == 1.0


def test_one_floor_per_group_must_match_the_groups():
    step = ftrain.with_schedule(
        ftrain.make_step(mse_loss), plateau=S.plateau("val_loss", min_value=[0.1, 0.2, 0.3])
    )
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(_groups(model), lr=0.1))
    with pytest.raises(ValueError, match="3 values but the optimizer has 2 param groups"):
        step(state, make_batches(1)[0])


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(metric=""), "plateau(metric)"),
        (dict(metric="loss", mode="less"), "plateau(mode)"),
        (dict(metric="loss", factor=1.0), "plateau(factor) must be in (0, 1)"),
        (dict(metric="loss", patience=-1), "plateau(patience)"),
        (dict(metric="loss", cooldown=1.5), "plateau(cooldown)"),
        (dict(metric="loss", threshold=-1), "plateau(threshold)"),
        (dict(metric="loss", threshold_mode="relative"), "plateau(threshold_mode)"),
        (dict(metric="loss", min_value=-0.1), "plateau(min_value)"),
        (dict(metric="loss", eps=-1), "plateau(eps)"),
    ],
)
def test_bad_plateau_arguments(kwargs, text):
    with pytest.raises(ValueError) as info:
        S.plateau(**kwargs)
    assert text in str(info.value)


def test_with_schedule_plateau_must_be_a_plateau_rule():
    with pytest.raises(TypeError, match="plateau must be ftrain.schedules.plateau"):
        ftrain.with_schedule(ftrain.make_step(mse_loss), plateau="val_loss")


def test_docstring_examples():
    result = doctest.testmod(ftrain.plateau, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------- several processes
@pytest.mark.dist
def test_every_rank_lowers_its_learning_rate_at_the_same_evaluations(tmp_path):
    """2 gloo processes: each rank's evaluation differs, EvalHook averages them, and both
    ranks follow torch's ReduceLROnPlateau driven by the mean."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import plateau_worker as w

    tests = Path(__file__).parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(tests / "plateau_worker.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"plateau_rank{r}.json").read_text()) for r in (0, 1)]
    model = make_model(0)
    groups = [
        {"params": model.fc1.parameters()},
        {"params": model.fc2.parameters(), "lr": w.LRS[1]},
    ]
    opt = torch.optim.SGD(groups, lr=w.LRS[0])
    kw = {("min_lr" if k == "min_value" else k): v for k, v in w.PLATEAU.items()}
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kw)
    want = []
    for metric in w.SEQUENCE:
        want += [[g["lr"] for g in opt.param_groups]] * 3  # 3 updates per epoch on each rank
        sched.step(metric)
    assert ranks[0]["lrs"] == ranks[1]["lrs"] == want
    assert len({tuple(r) for r in want}) >= 3
    assert ranks[0]["best"] == ranks[1]["best"] == pytest.approx(sched.best)


def test_observe_without_a_plateau_rule_returns_the_same_state():
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), lr=S.constant(0.1))
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, _ = step(state, make_batches(1)[0])
    assert step.observe(state, {"val_loss": 1.0}) is state
