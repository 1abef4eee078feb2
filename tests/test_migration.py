"""docs/migration.md: every code block runs, and its mapped rows train as the MMEngine 0.10.7
objects they name (the ``mmengine`` extra): the ``Runner`` (schedulers stepped by its
``ParamSchedulerHook``, ``EMAHook``, ``AmpOptimWrapper`` with accumulation), MMEngine's
``ExponentialMovingAverage`` and ``DefaultOptimWrapperConstructor``. detectron2 is not
installed: its rows are checked against its documented formulas, written out here. Rows that
earlier issues already test (clipping, AMP, conv-bn, CheckpointHook files, activation
checkpointing) keep their tests in test_step.py, test_conv_bn.py, test_loop.py,
test_activation_checkpoint.py and test_param_groups.py.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss
from mmengine_ref import Setup, max_differences, run_ftrain, run_mmengine, runner_lrs

import ftrain
from ftrain import schedules as S
from ftrain.optim import param_groups
from ftrain.transforms.ema import use_ema

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "migration.md"


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    """The guide's code blocks run in order in one namespace (in a fresh directory)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    here = Path.cwd()
    namespace["__guide_dir__"] = where = tmp_path_factory.mktemp("guide")
    os.chdir(where)
    try:
        for i, code in enumerate(blocks):
            exec(compile(code, f"docs/migration.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(here)
    return namespace


def test_every_code_block_of_the_guide_runs(guide, capsys):
    state = guide["state"]
    assert state.epoch == 12 and not state.is_consumed
    assert (guide["__guide_dir__"] / "work_dirs" / "exp" / "manifest.json").is_file()
    assert guide["trained"].step == 8  # the accumulation block: 32 micro-batches
    # the custom hook is a real hook that acts on every 50th update, declared as its cadence
    hook = ftrain.hooks.resolve_hooks([guide["print_loss"]]).hooks[0]
    assert hook.priority == 40  # ABOVE_NORMAL (MMEngine: 40)
    assert hook.cadence == ftrain.Every(steps=50)


# ------------------------------------------------------------- schedules
@pytest.fixture(scope="module")
def mmengine():
    return pytest.importorskip("mmengine", reason="the MMEngine reference needs the extra")


def test_mmengine_linear_lr_is_warmup_of_end_minus_begin_minus_one(mmengine, tmp_path):
    base, E, epochs = 0.02, 20, 12
    schedulers = [
        dict(type="LinearLR", start_factor=0.001, by_epoch=False, begin=0, end=50),
        dict(type="MultiStepLR", by_epoch=True, milestones=[8, 11], gamma=0.1),
    ]
    real = runner_lrs(schedulers, tmp_path, epochs=epochs, batches=E, lr=base)
    ours = S.warmup(S.by_epoch(S.multistep(base, [8, 11]), E), iters=49, ratio=0.001)
    assert len(real) == epochs * E
    assert [ours(t) for t in range(len(real))] == pytest.approx(real, rel=1e-12)
    old = S.warmup(S.constant(base), iters=50, ratio=0.001)  # the guide's former row
    assert old(25) != pytest.approx(real[25], rel=1e-6)


def test_cosine_by_epoch_and_convert_to_iter_based(mmengine, tmp_path):
    base, E, epochs = 0.1, 7, 12
    # by_epoch=True: stepped at each epoch's end, so iteration t uses the epoch's value
    cosine = dict(type="CosineAnnealingLR", T_max=epochs, by_epoch=True)
    real = runner_lrs([cosine], tmp_path / "a", epochs=epochs, batches=E, lr=base)
    ours = S.by_epoch(S.cosine(base, epochs), E)
    assert [ours(t) for t in range(epochs * E)] == pytest.approx(real, abs=1e-12)
    # convert_to_iter_based=True: T_max becomes T_max * epoch_length, stepped every iteration
    cosine = dict(cosine, convert_to_iter_based=True)
    real = runner_lrs([cosine], tmp_path / "b", epochs=epochs, batches=E, lr=base)
    ours = S.cosine(base, epochs * E)
    assert [ours(t) for t in range(epochs * E)] == pytest.approx(real, abs=1e-12)


@pytest.mark.parametrize("accumulate", [4, 1])
def test_the_accumulation_block_trains_as_the_mmengine_runner(
    guide, mmengine, tmp_path, accumulate
):
    """The guide's MMEngine config run by the real Runner; its ftrain translation (`build`)
    with the same model and batches: lr, weights and EMA per iteration within 1e-6."""
    cfg = {k: guide[k] for k in ("optim_wrapper", "param_scheduler", "train_cfg", "custom_hooks")}
    cfg["optim_wrapper"] = dict(cfg["optim_wrapper"], accumulative_counts=accumulate)
    setup = Setup(accumulate=accumulate, iters=cfg["train_cfg"]["max_iters"])
    theirs, _ = run_mmengine(setup, tmp_path, config=cfg)

    def build(model, loss_fn):
        return guide["build"](model, loss_fn, N=accumulate)

    ours, _ = run_ftrain(setup, build=build)
    diff = max_differences(theirs, ours)
    print(f"accumulative_counts={accumulate}: max |ftrain - MMEngine| {diff}")
    assert max(diff.values()) <= 1e-6, diff


def test_counting_updates_with_a_window_decay_is_not_mmengines_average(mmengine, tmp_path):
    """ftrain's default (updates): each update's lr read at MMEngine's iteration 4u + 3 gives
    MMEngine's updates, but no per-update decay gives its average, not even (1 - m) ** 4: its
    first window starts from the initial weights and each window averages the previous
    weights 3 times. (One param group ratio: a plain callable scales with each group.)"""
    setup = Setup(accumulate=4, iters=32, head_lr_mult=1.0)
    theirs, _ = run_mmengine(setup, tmp_path)
    lr = S.join([S.warmup(S.constant(0.1), iters=7, ratio=0.1), S.cosine(0.1, 24, final=1e-3)], [8])

    def build(model, loss_fn):
        groups = param_groups(model, lr=0.1, weight_decay=1e-4, norm_decay_mult=0.0, merge=False)
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        step = ftrain.with_amp(ftrain.make_step(loss_fn), "bf16")
        step = ftrain.with_grad_accum(step, every=4)
        step = ftrain.with_clip(step, "norm", max_norm=1.0)
        step = ftrain.with_schedule(step, lr=lambda u: lr(4 * u + 3))
        step = ftrain.with_ema(step, decay=(1 - 0.01) ** 4)
        return step, ftrain.TrainState.create(model, optimizer)

    ours, _ = run_ftrain(setup, build=build)
    at_updates = [i for i in range(len(theirs)) if i % 4 == 3]
    diff = max_differences([theirs[i] for i in at_updates], [ours[i] for i in at_updates])
    print(f"counting updates, decay (1 - m) ** 4: max |ftrain - MMEngine| at updates {diff}")
    assert diff["lr"] <= 1e-12 and diff["weights"] <= 1e-6  # the same updates
    assert diff["ema"] > 1e-3  # the average is not: count="micro_batches" is needed


def detectron2_lr(base, steps, gamma, warmup_factor, warmup_iters, max_iter, method, t):
    """detectron2's LRMultiplier(WarmupParamScheduler(MultiStepParamScheduler)) at iteration t."""
    values = [gamma**k for k in range(len(steps) + 1)]

    def multistep(where):
        return values[bisect.bisect_right(list(steps), int((where + 1e-6) * max_iter))]

    length = warmup_iters / max_iter
    where = t / max_iter
    if where < length:
        start = warmup_factor * multistep(0.0)
        if method == "constant":
            return base * start
        end = multistep(length)
        return base * (start + (end - start) * where / length)
    return base * multistep(where)


@pytest.mark.parametrize("method", ["linear", "constant"])
def test_detectron2_warmup_multistep(method):
    base, steps, max_iter = 0.02, (600, 800), 900
    ours = S.warmup(S.multistep(base, list(steps), gamma=0.1), iters=100, ratio=0.001, kind=method)
    for t in range(max_iter):
        ref = detectron2_lr(base, steps, 0.1, 0.001, 100, max_iter, method, t)
        assert ours(t) == pytest.approx(ref, rel=1e-9), t


def test_detectron2_warmup_cosine_differs_only_within_the_stated_bound():
    base, f, W, T = 0.02, 0.001, 1000, 90000
    ours = S.warmup(S.cosine(base, T), iters=W, ratio=f)

    def cos(t):
        return base * (1 + math.cos(math.pi * t / T)) / 2

    bound = (1 - math.cos(math.pi * W / T)) / 2
    for t in range(0, T, 7):
        ref = f * base + (cos(W) - f * base) * t / W if t < W else cos(t)
        if t >= W:
            assert ours(t) == pytest.approx(ref, rel=1e-12)
        else:
            assert abs(ours(t) - ref) / ref < bound


def test_with_schedule_uses_the_value_of_the_updates_done():
    """detectron2's iteration t (from 0) and the update after t updates read the same value."""
    sched = S.multistep(0.1, [2, 4])
    lrs = []
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ftrain.TrainState.create(model, opt)

    def record(events):
        for ev in events:
            if type(ev) is ftrain.events.StepEnd:
                lrs.append(opt.param_groups[0]["lr"])  # the lr the update just done used
            yield ev

    step = ftrain.with_schedule(ftrain.make_step(mse_loss), lr=sched)
    ftrain.Loop(step, state, make_batches(6), [ftrain.hook(record)]).run()
    assert lrs == [sched(t) for t in range(6)]


# ---------------------------------------------------------- checkpoints
def test_detectron2_checkpoint_period(tmp_path):
    period, max_iter = 3, 10
    # detectron2 PeriodicCheckpointer: after iteration i (from 0) when (i + 1) % period == 0,
    # and model_final at i == max_iter - 1; ftrain names them by updates done (i + 1)
    expected = {i + 1 for i in range(max_iter) if (i + 1) % period == 0} | {max_iter}
    model = make_model(0)  # the optimizer on this model's parameters (not another model's)
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), 0.1)),
        make_batches(max_iter),
        [ftrain.CheckpointHook(period)],
        max_steps=max_iter,
        work_dir=tmp_path,
    ).run()
    files = {int(p.stem.split("_")[1]) for p in tmp_path.glob("iter_*.pth")}
    assert files == expected


# ------------------------------------------------------------------ EMA
def test_ema_row_evaluates_the_averaged_weights_like_mmengine(mmengine):
    from mmengine.model import ExponentialMovingAverage

    momentum, steps = 0.25, 5
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_ema(ftrain.make_step(mse_loss), decay=1 - momentum)
    seen = []

    def evaluate(state):
        return {"w": state.model.fc1.weight.detach().clone()}

    def record(events):
        for ev in events:
            if type(ev) is ftrain.events.Evaluated:
                seen.append(ev.metrics["w"])
            yield ev

    batches = make_batches(steps)
    hooks = [
        ftrain.EvalHook(use_ema(evaluate), every=steps, by_epoch=False),
        ftrain.hook(record, priority="LOWEST"),
    ]
    ftrain.Loop(step, state, batches, hooks, max_steps=steps).run()
    # MMEngine's average, updated after each iteration as its EMAHook does
    ref = make_model(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    averaged = ExponentialMovingAverage(ref, momentum=momentum)
    for b in batches:
        opt.zero_grad()
        mse_loss(ref, b).backward()
        opt.step()
        averaged.update_parameters(ref)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], averaged.module.fc1.weight, rtol=0, atol=1e-7)
    assert not torch.allclose(seen[0], ref.fc1.weight)  # not the raw weights


# ---------------------------------------------------------------- paramwise
class Net(torch.nn.Module):
    """17 parameters: convs, a depthwise conv, norms, a linear head and flat extras."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)  # weight, bias
        self.bn = torch.nn.BatchNorm2d(8)  # weight, bias
        self.dw = torch.nn.Conv2d(8, 8, 3, groups=8)  # weight, bias
        self.gn = torch.nn.GroupNorm(2, 8)  # weight, bias
        self.pw = torch.nn.Conv2d(8, 16, 1)  # weight, bias
        self.ln = torch.nn.LayerNorm(16)  # weight, bias
        self.head = torch.nn.Linear(16, 4)  # weight, bias
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, 4))
        self.gate = torch.nn.Parameter(torch.ones(4))


def mmengine_groups(model, lr, weight_decay, cfg):
    """{name: (lr, weight_decay)} from MMEngine's DefaultOptimWrapperConstructor."""
    from mmengine.optim import DefaultOptimWrapperConstructor

    optimizer = dict(type="SGD", lr=lr, weight_decay=weight_decay)
    wrapper = DefaultOptimWrapperConstructor(dict(optimizer=optimizer), cfg)(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: (g["lr"], g["weight_decay"])
        for g in wrapper.optimizer.param_groups
        for p in g["params"]
    }


@pytest.mark.parametrize(
    "cfg",
    [
        {"flat_decay_mult": 0.0},
        {"norm_decay_mult": 0.0},
        {"bias_decay_mult": 0.5, "flat_decay_mult": 0.0},
        {"dwconv_decay_mult": 0.0, "flat_decay_mult": 0.2},
        {"norm_decay_mult": 0.0, "bias_decay_mult": 0.0, "flat_decay_mult": 0.0},
        {},
    ],
)
def test_param_groups_weight_decay_is_mmengines(cfg, mmengine):
    model = Net()
    assert len(list(model.parameters())) == 17
    groups = param_groups(model, lr=0.1, weight_decay=0.05, merge=False, **cfg)
    ours = {g["name"]: (g["lr"], g["weight_decay"]) for g in groups}
    theirs = mmengine_groups(model, 0.1, 0.05, cfg)
    assert ours.keys() == theirs.keys()
    for name, values in ours.items():
        assert values == pytest.approx(theirs[name], rel=1e-12), name


@pytest.mark.parametrize(
    "cfg",
    [
        {"custom_keys": {"conv": dict(lr_mult=0.1), "pos_embed": dict(decay_mult=0.0)}},
        {"bias_lr_mult": 2.0, "bias_decay_mult": 0.0, "norm_decay_mult": 0.0},
        {"custom_keys": {"dw": dict(lr_mult=0.5, decay_mult=2.0)}, "dwconv_decay_mult": 0.0},
    ],
)
def test_param_groups_lr_and_decay_are_mmengines(cfg, mmengine):
    model = Net()
    groups = param_groups(model, lr=0.1, weight_decay=0.05, merge=False, **cfg)
    ours = {g["name"]: (g["lr"], g["weight_decay"]) for g in groups}
    theirs = mmengine_groups(model, 0.1, 0.05, cfg)
    assert ours.keys() == theirs.keys()
    for name, values in ours.items():
        assert values == pytest.approx(theirs[name], rel=1e-12), name


def test_flat_decay_alone_switches_off_every_1d_parameter():
    model = Net()
    groups = param_groups(model, lr=0.1, weight_decay=0.05, flat_decay_mult=0.0, merge=False)
    decayed = sorted(g["name"] for g in groups if g["weight_decay"])
    assert decayed == ["conv.weight", "dw.weight", "head.weight", "pos_embed", "pw.weight"]
    # 12 parameters are 1-D: every one of them (norms' and biases included) gets no decay
    assert sum(1 for g in groups if not g["weight_decay"]) == 12
