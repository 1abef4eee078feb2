"""docs/migration.md: every code block runs, and the rows changed or added for issue 16 match
the MMEngine 0.10.7 / detectron2 behaviour they claim.

The references are those libraries' documented formulas, written out here (neither library
is installed): MMEngine's chainable ``LinearLR`` and ``CosineAnnealingLR`` updates,
``DefaultOptimWrapperConstructor.add_params``'s weight-decay rule, ``ExponentialMovingAverage``
(``averaged = averaged + momentum * (source - averaged)``, the first update copies), and
detectron2's ``WarmupParamScheduler`` / ``MultiStepParamScheduler`` and
``PeriodicCheckpointer``. Rows that earlier issues already test (clipping, AMP, accumulation,
conv-bn, CheckpointHook files, activation checkpointing, paramwise options) keep their tests
in test_step.py, test_conv_bn.py, test_loop.py, test_activation_checkpoint.py and
test_param_groups.py.
"""

from __future__ import annotations

import bisect
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import schedules as S
from ftrain.optim import param_groups
from ftrain.transforms.ema import use_ema

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "migration.md"


def test_every_code_block_of_the_guide_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/migration.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    state = namespace["state"]
    assert state.epoch == 12 and not state.is_consumed
    assert (tmp_path / "work_dirs" / "exp" / "manifest.json").is_file()
    # the custom hook is a real hook that acts on every 50th update, declared as its cadence
    hook = ftrain.resolve_hooks([namespace["print_loss"]]).hooks[0]
    assert hook.priority == 40  # ABOVE_NORMAL (MMEngine: 40)
    assert hook.cadence == ftrain.Every(steps=50)


# ------------------------------------------------------------- schedules
def mmengine_linear_lr(base, start_factor, begin, end, steps, end_factor=1.0):
    """MMEngine's LinearParamScheduler, chainable form, stepped once per iteration."""
    total = end - begin - 1
    lrs, lr = [], base
    for t in range(steps):
        rel = t - begin
        if t < begin or t >= end:
            pass  # outside [begin, end): the value is left as it is
        elif rel == 0:
            lr = base * start_factor
        else:
            lr = lr * (
                1.0
                + (end_factor - start_factor)
                / (total * start_factor + (rel - 1) * (end_factor - start_factor))
            )
        lrs.append(lr)
    return lrs


def test_mmengine_linear_lr_is_warmup_of_end_minus_begin_minus_one():
    base, E = 0.02, 100
    reference = mmengine_linear_lr(base, 0.001, 0, 500, 700)
    ours = S.warmup(S.by_epoch(S.multistep(base, [8, 11]), E), iters=499, ratio=0.001)
    for t in range(700):
        assert ours(t) == pytest.approx(reference[t], rel=1e-9), t
    old = S.warmup(S.constant(base), iters=500, ratio=0.001)  # the guide's former row
    assert old(250) != pytest.approx(reference[250], rel=1e-6)


def mmengine_cosine(base, t_max, steps, eta_min=0.0):
    """MMEngine's CosineAnnealingParamScheduler, chainable form."""
    lrs, lr = [], base
    for t in range(steps):
        if t == 0:
            lr = base
        elif (t - 1 - t_max) % (2 * t_max) == 0:
            lr = lr + (base - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
        else:
            lr = (1 + math.cos(math.pi * t / t_max)) / (1 + math.cos(math.pi * (t - 1) / t_max)) * (
                lr - eta_min
            ) + eta_min
        lrs.append(lr)
    return lrs


def test_cosine_by_epoch_and_convert_to_iter_based():
    base, E, epochs = 0.1, 7, 12
    # by_epoch=True: stepped at each epoch's end, so iteration t uses the epoch's value
    per_epoch = mmengine_cosine(base, epochs, epochs)
    ours = S.by_epoch(S.cosine(base, epochs), E)
    for t in range(epochs * E):
        assert ours(t) == pytest.approx(per_epoch[t // E], abs=1e-12), t
    # convert_to_iter_based=True: T_max becomes T_max * epoch_length, stepped every iteration
    per_iter = mmengine_cosine(base, epochs * E, epochs * E)
    ours = S.cosine(base, epochs * E)
    for t in range(epochs * E):
        assert ours(t) == pytest.approx(per_iter[t], abs=1e-12), t


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
def test_ema_row_evaluates_the_averaged_weights_like_mmengine():
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
    # MMEngine: ExponentialMovingAverage, updated after each iteration, first update copies
    ref = make_model(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    averaged = None
    for b in batches:
        opt.zero_grad()
        mse_loss(ref, b).backward()
        opt.step()
        w = ref.fc1.weight.detach().clone()
        averaged = w if averaged is None else averaged + momentum * (w - averaged)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], averaged, rtol=1e-6, atol=1e-7)
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


def mmengine_decay(model, base_wd, cfg):
    """DefaultOptimWrapperConstructor.add_params' weight decay per parameter (MMEngine 0.10.7)."""
    norms = (
        torch.nn.modules.batchnorm._BatchNorm,
        torch.nn.modules.instancenorm._InstanceNorm,
        torch.nn.GroupNorm,
        torch.nn.LayerNorm,
    )
    out = {}

    def add(module, prefix):
        is_norm = isinstance(module, norms)
        is_dw = isinstance(module, torch.nn.Conv2d) and module.in_channels == module.groups
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            wd = base_wd
            if is_norm and cfg.get("norm_decay_mult") is not None:
                wd = base_wd * cfg["norm_decay_mult"]
            elif name == "bias" and cfg.get("bias_decay_mult") is not None:
                wd = base_wd * cfg["bias_decay_mult"]
            elif is_dw and cfg.get("dwconv_decay_mult") is not None:
                wd = base_wd * cfg["dwconv_decay_mult"]
            elif p.ndim == 1 and cfg.get("flat_decay_mult") is not None:
                wd = base_wd * cfg["flat_decay_mult"]
            out[full] = wd
        for child_name, child in module.named_children():
            add(child, f"{prefix}.{child_name}" if prefix else child_name)

    add(model, "")
    return out


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
def test_param_groups_weight_decay_is_mmengines(cfg):
    model = Net()
    assert len(list(model.parameters())) == 17
    groups = param_groups(model, lr=0.1, weight_decay=0.05, merge=False, **cfg)
    ours = {g["name"]: g["weight_decay"] for g in groups}
    assert ours == pytest.approx(mmengine_decay(model, 0.05, cfg))


def test_flat_decay_alone_switches_off_every_1d_parameter():
    model = Net()
    groups = param_groups(model, lr=0.1, weight_decay=0.05, flat_decay_mult=0.0, merge=False)
    decayed = sorted(g["name"] for g in groups if g["weight_decay"])
    assert decayed == ["conv.weight", "dw.weight", "head.weight", "pos_embed", "pw.weight"]
    # 12 parameters are 1-D: every one of them (norms' and biases included) gets no decay
    assert sum(1 for g in groups if not g["weight_decay"]) == 12
