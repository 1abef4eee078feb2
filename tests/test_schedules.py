"""Tests for ftrain.schedules: closed forms, torch.optim.lr_scheduler, MMCV values."""

from __future__ import annotations

import doctest
import math
import re
from pathlib import Path

import attrs
import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import schedules as S
from ftrain.events import StepEnd
from ftrain.schedules import (
    apply_schedules,
    by_epoch,
    constant,
    cosine,
    cosine_restarts,
    cyclic,
    cyclic_momentum,
    exponential,
    join,
    multistep,
    onecycle,
    onecycle_momentum,
    polynomial,
    step_decay,
    warmup,
)


def torch_lrs(make_scheduler, steps: int, base: float = 0.1) -> list[float]:
    """The lr a torch scheduler gives at steps 0..steps-1 (read before each update)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def values(schedule, steps: int) -> list[float]:
    return [schedule(i) for i in range(steps)]


def close(expected):
    return pytest.approx(expected, rel=1e-9, abs=1e-15)


# ----------------------------------------------------------------------------- basic shapes


def test_constant():
    assert values(constant(0.3), 5) == [0.3] * 5
    assert isinstance(constant(1)(0), float)


def test_step_decay_matches_closed_form_and_steplr():
    s = step_decay(0.1, step_size=3, gamma=0.5)
    expected = [0.1 * 0.5 ** (i // 3) for i in range(12)]
    assert values(s, 12) == close(expected)
    lr = torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 12)
    assert values(s, 12) == close(lr)


def test_step_decay_min_value_clips():
    s = step_decay(1.0, step_size=1, gamma=0.1, min_value=1e-3)
    assert values(s, 6) == close([1.0, 0.1, 0.01, 1e-3, 1e-3, 1e-3])


def test_multistep_matches_closed_form_and_multisteplr():
    milestones = [3, 7, 8]
    s = multistep(0.1, milestones, gamma=0.5)
    expected = [0.1 * 0.5 ** sum(i >= m for m in milestones) for i in range(12)]
    assert values(s, 12) == close(expected)
    lr = torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones, gamma=0.5), 12)
    assert values(s, 12) == close(lr)
    # the decay takes effect *at* the milestone (MMCV: progress < s keeps the lower exponent)
    assert s(2) == 0.1 and s(3) == pytest.approx(0.05)


def test_multistep_min_value_and_list_converted_to_tuple():
    s = multistep(0.02, [1, 2, 3], gamma=0.1, min_value=1e-4)
    assert s.milestones == (1, 2, 3)
    assert s(5) == 1e-4
    hash(s)  # hashable although a list was passed


def test_exponential_matches_closed_form_and_exponentiallr():
    s = exponential(0.1, 0.9)
    assert values(s, 15) == close([0.1 * 0.9**i for i in range(15)])
    lr = torch_lrs(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9), 15)
    assert values(s, 15) == close(lr)


def test_cosine_matches_closed_form_and_cosineannealinglr():
    base, total, final = 0.1, 20, 1e-3
    s = cosine(base, total, final=final)
    expected = [final + (base - final) * (1 + math.cos(math.pi * i / total)) / 2 for i in range(21)]
    assert values(s, 21) == close(expected)
    lr = torch_lrs(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total, eta_min=final), 21
    )
    assert values(s, 21) == close(lr)


def test_cosine_defaults_to_zero_final_ratio_and_holds_after_total():
    assert cosine(0.1, 10)(10) == pytest.approx(0.0, abs=1e-18)
    s = cosine(0.2, 10, final_ratio=0.05)
    assert s(10) == pytest.approx(0.01)
    assert s(11) == s(10) == s(10_000)  # holds the final value (MMCV/torch would rise again)
    assert s(2.5) == pytest.approx(0.01 + 0.19 * (1 + math.cos(math.pi * 0.25)) / 2)


def test_polynomial_matches_closed_form_and_polynomiallr():
    s = polynomial(0.1, total=10, power=2.0)
    expected = [0.1 * (1 - min(i, 10) / 10) ** 2 for i in range(15)]
    assert values(s, 15) == close(expected)
    lr = torch_lrs(
        lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=10, power=2.0), 15
    )
    assert values(s, 15) == close(lr)


def test_polynomial_min_value_mmcv_formula():
    base, total, power, min_lr = 0.01, 40, 0.9, 1e-4
    s = polynomial(base, total, power=power, min_value=min_lr)
    for i in (0, 1, 13, 39, 40):
        assert s(i) == pytest.approx((base - min_lr) * (1 - i / total) ** power + min_lr)
    assert s(41) == pytest.approx(min_lr)  # no complex numbers past the end


# ----------------------------------------------------------------------------- warmup


def test_linear_warmup_closed_form_and_linearlr():
    iters, ratio = 5, 0.1
    s = warmup(constant(0.1), iters=iters, ratio=ratio, kind="linear")
    expected = [0.1 * (ratio + (1 - ratio) * min(i, iters) / iters) for i in range(10)]
    assert values(s, 10) == close(expected)
    lr = torch_lrs(
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=ratio, total_iters=iters), 10
    )
    assert values(s, 10) == close(lr)
    assert warmup(constant(0.1), iters, ratio) == s  # linear is the default


def test_constant_warmup_closed_form_and_constantlr():
    s = warmup(constant(0.1), iters=4, ratio=0.25, kind="constant")
    assert values(s, 8) == close([0.025] * 4 + [0.1] * 4)
    lr = torch_lrs(lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.25, total_iters=4), 8)
    assert values(s, 8) == close(lr)


def test_exponential_warmup_closed_form():
    iters, ratio = 4, 0.01
    s = warmup(constant(2.0), iters=iters, ratio=ratio, kind="exp")
    expected = [
        2.0 * (math.exp(math.log(ratio) * (iters - i) / iters) if i < iters else 1.0)
        for i in range(7)
    ]
    assert values(s, 7) == close(expected)
    assert s == warmup(constant(2.0), iters, ratio, kind="exp")


def test_warmup_scales_the_running_schedule_without_shifting_it():
    inner = multistep(1.0, [2], gamma=0.1)
    s = warmup(inner, iters=4, ratio=0.5)
    # regular value at step i times the linear factor (MMCV: regular_lr * (1 - k))
    for i in range(4):
        assert s(i) == pytest.approx(inner(i) * (0.5 + 0.5 * i / 4))
    assert s(4) == inner(4) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kind", "at_step_2"),
    [("constant", 1.9), ("linear", 1.3571428571428572), ("exp", 1.4399307381848783)],
)
def test_momentum_warmup_inverse_matches_mmcv(kind, at_step_2):
    # MMCV test_momentum_runner_hook: StepMomentumUpdaterHook(warmup=kind, warmup_iters=5,
    # warmup_ratio=0.5, step=[10]) with momentum 0.95 (pavi log index = iter + 1).
    m = warmup(multistep(0.95, [10]), iters=5, ratio=0.5, kind=kind, inverse=True)
    assert m(0) == pytest.approx(1.9)
    assert m(2) == pytest.approx(at_step_2)
    assert m(5) == m(9) == 0.95


# ----------------------------------------------------------------------------- cyclic


def test_cyclic_mmcv_cos_example():
    # MMCV test_momentum_runner_hook: 10 iterations, lr 0.02, momentum 0.95,
    # CyclicLrUpdaterHook(target_ratio=(10, 1), step_ratio_up=0.4) and
    # CyclicMomentumUpdaterHook(target_ratio=(0.85 / 0.95, 1), step_ratio_up=0.4).
    lr = cyclic(0.02, total=10, target_ratio=(10, 1), cyclic_times=1, step_ratio_up=0.4)
    mom = cyclic_momentum(0.95, total=10, cyclic_times=1, step_ratio_up=0.4)
    assert lr(0) == pytest.approx(0.01999999999999999)
    assert lr(4) == pytest.approx(0.2)
    assert lr(6) == pytest.approx(0.155)
    assert (mom(0), mom(4), mom(6)) == pytest.approx((0.95, 0.85, 0.875))


def test_cyclic_mmcv_linear_example():
    # MMCV test_cyclic_lr_update_hook: IterBasedRunner(max_iters=8), lr 0.02,
    # target_ratio=(10, 1), cyclic_times=1, step_ratio_up=0.5, anneal_strategy='linear'.
    s = cyclic(0.02, total=8, target_ratio=(10.0, 1.0), step_ratio_up=0.5, anneal="linear")
    assert (s(0), s(3), s(5)) == pytest.approx((0.02, 0.155, 0.155))


def test_cyclic_mmcv_gamma_example():
    # Same with cyclic_times=2, gamma=0.5: the second peak is 1 + (10 - 1) * 0.5 = 5.5x.
    s = cyclic(
        0.02,
        total=8,
        target_ratio=(10.0, 1.0),
        cyclic_times=2,
        step_ratio_up=0.5,
        anneal="linear",
        gamma=0.5,
    )
    assert (s(0), s(3), s(5), s(6)) == pytest.approx((0.02, 0.11, 0.065, 0.11))


def test_cyclic_momentum_mmcv_gamma_example():
    # MMCV test_momentum_runner_hook(cyclic_times=2, gamma=0.5), 10 iterations.
    mom = cyclic_momentum(0.95, total=10, cyclic_times=2, step_ratio_up=0.4, gamma=0.5)
    lr = cyclic(0.02, total=10, target_ratio=(10, 1), step_ratio_up=0.4)
    assert (lr(2), mom(2)) == pytest.approx((0.11, 0.85))
    assert (lr(5), mom(5)) == pytest.approx((0.1879422863405995, 0.95))
    assert (lr(7), mom(7)) == pytest.approx((0.11000000000000001, 0.9))


def test_cyclic_closed_form_two_cycles():
    base, total, hi, lo = 1e-3, 20, 10.0, 1e-4
    s = cyclic(base, total, target_ratio=(hi, lo), cyclic_times=2, step_ratio_up=0.4)
    phase, up = 10, 4

    def cos_anneal(a, b, t):
        return b + (a - b) * (1 + math.cos(math.pi * t)) / 2

    expected = []
    for i in range(total + 3):
        pos = i % phase
        if pos < up:
            expected.append(cos_anneal(base, base * hi, pos / up))
        else:
            expected.append(cos_anneal(base * hi, base * lo, (pos - up) / (phase - up)))
    assert values(s, total + 3) == close(expected)


def test_cyclic_target_ratio_forms_and_zero_up_phase():
    assert cyclic(1.0, 10, target_ratio=5.0).target_ratio == (5.0, 5e-5)
    assert cyclic(1.0, 10, target_ratio=[5.0]).target_ratio == (5.0, 5e-5)
    assert cyclic(1.0, 10, target_ratio=[5, 1]).target_ratio == (5, 1)
    s = cyclic(1.0, 10, target_ratio=(4.0, 1.0), step_ratio_up=0.0)
    assert s(0) == 4.0 and s(9) < s(1)  # starts at the peak and only goes down


# ----------------------------------------------------------------------------- join, by_epoch


def test_join_boundaries_and_relative_steps():
    s = join([constant(1.0), constant(2.0), exponential(1.0, 0.5)], boundaries=[5, 8])
    assert [s(i) for i in (0, 4, 5, 7, 8, 9, 10)] == [1.0, 1.0, 2.0, 2.0, 1.0, 0.5, 0.25]
    assert s(7.5) == 2.0 and s(8.0) == 1.0


def test_join_warmup_then_cosine_like_optax():
    # optax.join_schedules([linear warmup, cosine decay], [w]): each piece restarts at 0
    w, total = 4, 10
    ramp = polynomial(0.0, total=w, power=1.0, min_value=0.1)  # 0 -> 0.1 over w steps
    s = join([ramp, cosine(0.1, total)], [w])
    assert values(s, w) == close([0.1 * i / w for i in range(w)])
    assert [s(w + i) for i in range(total + 1)] == close(values(cosine(0.1, total), total + 1))


def test_by_epoch_changes_only_at_epoch_boundaries():
    s = by_epoch(multistep(0.1, [2, 3]), steps_per_epoch=5)
    assert values(s, 20) == close([0.1] * 10 + [0.01] * 5 + [0.001] * 5)
    assert s(9.99) == 0.1
    c = by_epoch(cosine(1.0, total=4), steps_per_epoch=3)
    assert values(c, 9) == close([1.0] * 3 + [cosine(1.0, 4)(1)] * 3 + [0.5] * 3)


def test_mmcv_schedule_1x_composition():
    # lr_config = dict(policy='step', warmup='linear', warmup_iters=500,
    #                  warmup_ratio=0.001, step=[8, 11]), 100 iterations per epoch
    lr, E = 0.02, 100
    s = warmup(by_epoch(multistep(lr, [8, 11]), E), iters=500, ratio=0.001)
    assert s(0) == pytest.approx(lr * 0.001)
    assert s(250) == pytest.approx(lr * (1 - 0.5 * (1 - 0.001)))
    assert (s(500), s(799)) == (lr, lr)
    assert (s(800), s(1099), s(1100)) == pytest.approx((lr * 0.1, lr * 0.1, lr * 0.01))


# ----------------------------------------------------------------------------- values


def test_pure_frozen_hashable_and_readable():
    s = warmup(cosine(0.1, 100, final_ratio=0.01), iters=10, ratio=0.1)
    forward = values(s, 120)
    backward = [s(i) for i in reversed(range(120))][::-1]
    assert forward == backward  # no hidden state: order of calls does not matter
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.iters = 5
    assert s == warmup(cosine(0.1, 100, final_ratio=0.01), iters=10, ratio=0.1)
    assert hash(s) == hash(warmup(cosine(0.1, 100, final_ratio=0.01), iters=10, ratio=0.1))
    assert repr(cosine(0.1, 1000)) == "cosine(base=0.1, total=1000, final=0.0)"
    assert (
        repr(join([constant(1.0)], [])) == "join(schedules=(constant(value=1.0),), boundaries=())"
    )
    assert eval(repr(s), vars(S)) == s  # prints as the call that makes it


def test_one_public_name_per_schedule():
    public = [n for n in S.__all__ if n not in ("Schedule", "apply_schedules")]
    assert all(n.islower() for n in public)
    for name in public:  # every schedule value prints as its function's name
        assert not hasattr(S, name.capitalize())
    for gone in ("Cosine", "Warmup", "linear_warmup", "exponential_warmup", "constant_warmup"):
        assert not hasattr(S, gone)


def test_plain_callables_compose():
    s = warmup(lambda step: 1.0, iters=2, ratio=0.5)
    assert (s(0), s(1), s(2)) == (0.5, 0.75, 1.0)


BAD = [
    (lambda: cosine(0.1, total=-5), "cosine(total) must be a number > 0"),
    (lambda: cosine(0.1, total=0), "cosine(total)"),
    (lambda: cosine(0.1, 10, final=0.0, final_ratio=0.1), "not both"),
    (lambda: polynomial(0.1, total=-1), "polynomial(total)"),
    (lambda: polynomial(0.1, 10, power=-1), "polynomial(power)"),
    (lambda: warmup(constant(1.0), 10, ratio=-0.1), "warmup(ratio) must be in [0, 1]"),
    (lambda: warmup(constant(1.0), 10, ratio=1.5), "warmup(ratio) must be in [0, 1]"),
    (lambda: warmup(constant(1.0), 10, ratio=0, inverse=True), "> 0 with inverse=True"),
    (lambda: warmup(constant(1.0), 10, ratio=0, kind="exp"), "> 0 with kind='exp'"),
    (lambda: warmup(constant(1.0), 10, kind="cosine"), "warmup(kind) must be one of"),
    (lambda: warmup(constant(1.0), iters=0), "warmup(iters)"),
    (lambda: warmup(0.1, 10), "warmup(schedule) must be a schedule"),
    (lambda: multistep(0.1, [8, 5]), "must be strictly increasing"),
    (lambda: multistep(0.1, [8, 8]), "must be strictly increasing"),
    (lambda: multistep(0.1, []), "non-empty list"),
    (lambda: multistep(0.1, [0, 5]), "milestone"),
    (lambda: multistep(0.1, 8), "non-empty list"),
    (lambda: step_decay(0.1, 0), "step_decay(step_size)"),
    (lambda: exponential(0.1, 0.0), "exponential(gamma)"),
    (lambda: constant(float("nan")), "constant(value) must be a finite number"),
    (lambda: constant(True), "constant(value)"),
    (lambda: join([constant(1.0), constant(2.0)], []), "2 schedules need 1 boundaries, got 0"),
    (lambda: join([constant(1.0)], [5]), "1 schedules need 0 boundaries, got 1"),
    (lambda: join([constant(1.0)] * 3, [5, 5]), "join(boundaries) must be strictly increasing"),
    (lambda: join([constant(1.0)] * 2, [0]), "join boundary"),
    (lambda: join([], []), "non-empty list of schedules"),
    (lambda: join([constant(1.0), 0.5], [3]), "join(schedules)[1]"),
    (lambda: by_epoch(constant(1.0), 0), "by_epoch(steps_per_epoch) must be an integer > 0"),
    (lambda: by_epoch(constant(1.0), 2.5), "by_epoch(steps_per_epoch)"),
    (lambda: cyclic(0.1, total=-1), "cyclic(total) must be an integer > 0"),
    (lambda: cyclic(0.1, 10, step_ratio_up=1.0), "cyclic(step_ratio_up) must be in [0, 1)"),
    (lambda: cyclic(0.1, 10, anneal="sin"), "cyclic(anneal) must be one of"),
    (lambda: cyclic(0.1, 10, target_ratio=(10, 0.1, 0.2)), "cyclic(target_ratio)"),
    (lambda: cyclic(0.1, 10, gamma=0), "cyclic(gamma) must be in (0, 1]"),
    (lambda: cyclic(0.1, 10, cyclic_times=0), "cyclic(cyclic_times)"),
    (lambda: cyclic(0.1, 3, cyclic_times=4), "lower cyclic_times"),
]


@pytest.mark.parametrize(("make", "message"), BAD)
def test_bad_arguments_raise_valueerror_naming_problem(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_error_messages_say_how_to_fix():
    with pytest.raises(ValueError, match="sort them and remove duplicates"):
        multistep(0.1, [11, 8])
    with pytest.raises(ValueError, match=r"e\.g\. ratio=0\.001"):
        warmup(constant(0.1), 10, ratio=2)
    with pytest.raises(ValueError, match=r"pass boundaries="):
        join([constant(1.0)] * 3, [4])


# ----------------------------------------------------------------------------- apply_schedules


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2)) for _ in range(n)]


def test_apply_schedules_sets_every_group_and_keeps_ratios():
    a, b = _params(2)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.01}], lr=0.1, momentum=0.9)
    sched = cosine(0.1, 10)
    for step in range(12):
        out = apply_schedules(opt, step, lr=sched)
        assert out == {"lr": sched(step)}
        assert opt.param_groups[0]["lr"] == pytest.approx(sched(step))
        assert opt.param_groups[1]["lr"] == pytest.approx(sched(step) * 0.1)
    assert [g["ftrain_lr_mult"] for g in opt.param_groups] == [1.0, pytest.approx(0.1)]
    assert [g["ftrain_initial_lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert all(g["momentum"] == 0.9 for g in opt.param_groups)  # untouched without a schedule


def test_apply_schedules_is_the_lr_the_optimizer_uses():
    (p,) = _params(1)
    opt = torch.optim.SGD([p], lr=1.0)
    apply_schedules(opt, 3, lr=constant(0.25))
    p.grad = torch.ones(2)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((2,), 0.75))


def test_apply_schedules_mmcv_two_groups_cyclic():
    # MMCV multi-optimizer case: model1 (lr 0.02, momentum 0.95), model2 (lr 0.01, momentum 0.9)
    a, b = _params(2)
    opt = torch.optim.SGD(
        [{"params": [a]}, {"params": [b], "lr": 0.01, "momentum": 0.9}], lr=0.02, momentum=0.95
    )
    lr = cyclic(0.02, total=10, target_ratio=(10, 1), step_ratio_up=0.4)
    mom = cyclic_momentum(0.95, total=10, step_ratio_up=0.4)
    expected = {  # iteration: (lr1, lr2, momentum1, momentum2), pavi index = iteration + 1
        0: (0.01999999999999999, 0.009999999999999995, 0.95, 0.9),
        4: (0.2, 0.1, 0.85, 0.8052631578947369),
        6: (0.155, 0.0775, 0.875, 0.8289473684210527),
    }
    for step in range(10):
        apply_schedules(opt, step, lr=lr, momentum=mom)
        if step in expected:
            got = tuple(g["lr"] for g in opt.param_groups) + tuple(
                g["momentum"] for g in opt.param_groups
            )
            assert got == pytest.approx(expected[step])


def test_apply_schedules_adam_betas():
    a, b = _params(2)
    opt = torch.optim.AdamW(
        [{"params": [a]}, {"params": [b], "lr": 2e-3, "betas": (0.45, 0.98)}],
        lr=1e-3,
        betas=(0.9, 0.999),
    )
    out = apply_schedules(opt, 0, lr=constant(4e-3), momentum=constant(0.8))
    assert out == {"lr": 4e-3, "momentum": 0.8}
    g0, g1 = opt.param_groups
    assert g0["betas"] == (0.8, 0.999) and g1["betas"] == (pytest.approx(0.4), 0.98)
    assert (g0["lr"], g1["lr"]) == (4e-3, pytest.approx(8e-3))


def test_apply_schedules_without_momentum_raises():
    (p,) = _params(1)
    opt = torch.optim.Adagrad([p], lr=0.1)
    apply_schedules(opt, 0, lr=constant(0.05))
    with pytest.raises(ValueError, match="Adagrad has no momentum.*pass momentum=None"):
        apply_schedules(opt, 0, momentum=constant(0.9))


def test_apply_schedules_resume_keeps_ratios():
    def make(lr0, lr1):
        a, b = _params(2)
        return torch.optim.SGD([{"params": [a], "lr": lr0}, {"params": [b], "lr": lr1}], lr=lr0)

    sched = warmup(cosine(0.1, 50), iters=5, ratio=0.01)
    opt = make(0.1, 0.02)
    for step in range(20):
        apply_schedules(opt, step, lr=sched)
    saved = opt.state_dict()
    # a resumed run builds its optimizer again (here with other lrs) and loads the state
    resumed = make(0.3, 0.3)
    resumed.load_state_dict(saved)
    assert [g["ftrain_lr_mult"] for g in resumed.param_groups] == [1.0, pytest.approx(0.2)]
    for step in range(20, 30):
        apply_schedules(opt, step, lr=sched)
        apply_schedules(resumed, step, lr=sched)
        assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in opt.param_groups]
    # ... and a fresh optimizer built as the original gets the same values directly
    fresh = make(0.1, 0.02)
    apply_schedules(fresh, 29, lr=sched)
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups]


def test_apply_schedules_group_added_later_and_preset_multiplier():
    a, b, c = _params(3)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "ftrain_lr_mult": 3.0}], lr=0.1)
    apply_schedules(opt, 5, lr=constant(0.5))
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.5]  # preset multiplier respected
    opt.add_param_group({"params": [c], "lr": 0.05})  # half of group 0's *initial* lr
    apply_schedules(opt, 6, lr=constant(0.4))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 1.2, 0.2])


def test_apply_schedules_zero_reference():
    a, b = _params(2)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "momentum": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match="param group 0 has momentum=0.*ftrain_momentum_mult"):
        apply_schedules(opt, 0, momentum=constant(0.9))
    opt2 = torch.optim.SGD(_params(2), lr=0.1)  # momentum 0 everywhere: multiplier 1
    apply_schedules(opt2, 0, momentum=constant(0.9))
    assert opt2.param_groups[0]["momentum"] == 0.9


def test_apply_schedules_tensor_lr_updated_in_place():
    (p,) = _params(1)
    lr_tensor = torch.tensor(0.01)
    opt = torch.optim.Adam([p], lr=lr_tensor, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    apply_schedules(opt, 0, lr=constant(0.002), momentum=constant(0.8))
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.002)
    assert float(opt.param_groups[0]["betas"][0]) == pytest.approx(0.8)


def test_apply_schedules_rejects_non_schedule():
    opt = torch.optim.SGD(_params(1), lr=0.1)
    with pytest.raises(ValueError, match=r"apply_schedules\(lr\) must be a schedule"):
        apply_schedules(opt, 0, lr=0.1)


def test_docstring_examples_run():
    result = doctest.testmod(S, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 20 and result.failed == 0


# ----------------------------------------------------------------------------- with_schedule
def _sgd_state(lr=0.05, momentum=0.9, groups=False, seed=0):
    model = make_model(seed)
    params = model.parameters()
    if groups:
        params = [
            {"params": model.fc1.parameters()},
            {"params": model.fc2.parameters(), "lr": lr / 10},
        ]
    return ftrain.TrainState.create(model, torch.optim.SGD(params, lr=lr, momentum=momentum))


def _recorder(log, fn):
    """A hook appending ``fn(event)`` after each optimizer update."""

    def record(events):
        for ev in events:
            if type(ev) is StepEnd and ev.is_update:
                log.append(fn(ev))
            yield ev

    return ftrain.hook(record)


def _groups(ev):
    return [(g["lr"], g["momentum"]) for g in ev.state.optimizer.param_groups]


def test_with_schedule_equals_a_plain_loop_with_torch_lr_scheduler():
    """Bitwise: the same training as SGD + torch's LambdaLR/MultiStepLR stepped per update."""
    batches = make_batches(12)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4, 9], gamma=0.5)
    for batch in batches:
        opt.zero_grad()
        mse_loss(model, batch).backward()
        opt.step()
        sched.step()
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), lr=multistep(0.1, [4, 9], gamma=0.5))
    state = ftrain.Loop(step, _sgd_state(lr=123.0), batches, hooks=[]).run()
    for a, b in zip(state.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert state.transforms["schedule"].values == {"lr": 0.1 * 0.5**2}


def test_with_schedule_lr_and_momentum_per_update_with_accumulation_and_groups():
    lr = warmup(cosine(0.1, total=20, final_ratio=0.01), iters=5, ratio=0.1)
    mom = cyclic_momentum(0.95, total=20)
    seen = []
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    step = ftrain.with_schedule(step, lr=lr, momentum=mom)
    hooks = [_recorder(seen, _groups)]
    state = ftrain.Loop(step, _sgd_state(0.1, groups=True), make_batches(20), hooks, epochs=2).run()
    assert state.step == 20 and len(seen) == 20  # once per update, not per micro-batch
    for k, groups in enumerate(seen):  # the values the k-th update (from 0) used
        assert groups[0] == (lr(k), mom(k))
        assert groups[1] == (lr(k) * (0.01 / 0.1), mom(k))  # group 1 keeps its ratio


def test_with_schedule_adam_betas_weight_decay_and_start_step():
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    state = ftrain.TrainState.create(model, opt, step=7)
    mom = warmup(constant(0.9), iters=10, ratio=0.95, inverse=True)
    wd = exponential(0.1, 0.5)
    seen = []
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), momentum=mom, weight_decay=wd)
    rec = _recorder(
        seen, lambda ev: (opt.param_groups[0]["betas"], opt.param_groups[0]["weight_decay"])
    )
    ftrain.Loop(step, state, make_batches(4), hooks=[rec]).run()
    assert seen == [((mom(k), 0.99), wd(k)) for k in range(7, 11)]


def test_with_schedule_by_epoch_changes_at_epoch_start():
    seen = []
    step = ftrain.with_schedule(
        ftrain.make_step(mse_loss), lr=multistep(0.1, milestones=[2]), by_epoch=True
    )
    rec = _recorder(seen, lambda ev: ev.state.optimizer.param_groups[0]["lr"])
    ftrain.Loop(step, _sgd_state(0.1), make_batches(4), hooks=[rec], epochs=3).run()
    assert seen == [0.1] * 8 + [multistep(0.1, [2])(2)] * 4


def _run_scheduled(work_dir, resume=None, max_steps=12):
    lr = join([warmup(constant(0.1), 3, ratio=0.2), cosine(0.1, 9)], [3])
    seen = []
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    step = ftrain.with_schedule(step, lr=lr, momentum=step_decay(0.9, 4, gamma=0.9))
    hooks = [_recorder(seen, _groups), ftrain.CheckpointHook(interval=4)]
    state = _sgd_state(lr=7.0, groups=True)  # lr replaced by the schedule (and the checkpoint)
    lp = ftrain.Loop(
        step, state, make_batches(10), hooks, max_steps=max_steps, work_dir=work_dir, resume=resume
    )
    state = lp.run()
    return seen, [p.detach().clone() for p in state.model.parameters()]


def test_with_schedule_resume_gives_the_same_run_as_uninterrupted(tmp_path):
    straight, p_straight = _run_scheduled(tmp_path / "a")
    _run_scheduled(tmp_path / "b", max_steps=5)  # stops mid-epoch
    resumed, p_resumed = _run_scheduled(tmp_path / "b", resume=tmp_path / "b" / "iter_4.pth")
    assert resumed == straight[4:]
    for a, b in zip(p_resumed, p_straight, strict=True):
        assert torch.equal(a, b)


def test_with_schedule_advances_on_a_skipped_update():
    """A skipped update (non-finite loss) counts: the next update uses the next value."""
    batches = make_batches(4)
    x, y = batches[1]
    batches[1] = (torch.full_like(x, float("nan")), y)
    lr = exponential(0.1, 0.5)
    step = ftrain.with_nonfinite_check(ftrain.make_step(mse_loss), action="skip")
    step = ftrain.with_schedule(step, lr=lr)
    seen = []
    rec = _recorder(seen, lambda ev: ev.state.optimizer.param_groups[0]["lr"])
    ftrain.Loop(step, _sgd_state(), batches, hooks=[rec]).run()
    assert seen == [lr(k) for k in range(4)]


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(lr=cosine(0.1, 100, final=-0.01)), "gives lr=-0.01 at step 100"),
        (dict(lr=constant(-0.1)), "gives lr=-0.1 at step 0"),
        (dict(lr=join([constant(0.1), exponential(-1.0, 0.5)], [10])), "at step 10"),
        (dict(momentum=lambda n: float("nan")), "momentum=nan at step 0"),
        (dict(weight_decay=by_epoch(polynomial(0.1, 5, min_value=-1), 4)), "at step 20"),
    ],
)
def test_a_negative_or_nan_schedule_fails_before_training(kwargs, text):
    with pytest.raises(ValueError, match=re.escape(text)) as info:
        ftrain.with_schedule(ftrain.make_step(mse_loss), **kwargs)
    assert "schedule" in str(info.value) and "Fix the schedule" in str(info.value)


def test_a_schedule_turning_negative_later_fails_at_that_update_before_writing_it():
    lr = lambda n: 0.1 - 0.05 * n  # noqa: E731 - unknown horizon: checked at each update
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), lr=lr)
    state = _sgd_state()
    batches = make_batches(5)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    with pytest.raises(ValueError, match=r"gives lr=-0.05\d* at step 3.*>= 0") as info:
        step(state, batches[3])
    assert "Fix the schedule" in str(info.value)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)  # not written
    assert not state.is_consumed  # nothing irreversible happened: the state stays usable


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda s: ftrain.with_schedule(s), ValueError, "needs a schedule"),
        (lambda s: ftrain.with_schedule(s, lr=0.1), TypeError, "must be a schedule"),
        (
            lambda s: ftrain.with_schedule(s, lr=constant(0.1), by_epoch="yes"),
            TypeError,
            "by_epoch",
        ),
    ],
)
def test_with_schedule_bad_arguments(make, error, text):
    with pytest.raises(error, match=re.escape(text)):
        make(ftrain.make_step(mse_loss))


def test_with_schedule_repr_and_state():
    step = ftrain.with_schedule(ftrain.make_step(mse_loss), lr=constant(0.1))
    assert "Scheduled(lr=constant(value=0.1), momentum=None" in repr(step)
    state, _ = step(_sgd_state(), make_batches(1)[0])
    assert "schedule: ScheduleState(values={'lr': 0.1})" in repr(state)


def test_with_schedule_under_compile_does_not_recompile():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    step = ftrain.with_schedule(
        ftrain.make_step(mse_loss), lr=cosine(0.1, 6), momentum=cosine(0.9, 6)
    )
    step = ftrain.with_compile(step, backend="eager")
    state, batches = _sgd_state(), make_batches(6)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k, batch in enumerate(batches):
        state, _ = step(state, batch)
        opt.param_groups[0].update(lr=cosine(0.1, 6)(k), momentum=cosine(0.9, 6)(k))
        opt.zero_grad()
        mse_loss(model, batch).backward()
        opt.step()
        assert state.optimizer.param_groups[0]["lr"] == cosine(0.1, 6)(k)
    assert not counters["recompiles"]
    for a, b in zip(state.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_apply_schedules_weight_decay_keeps_ratios_and_needs_the_setting():
    a, b = _params(2)
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    apply_schedules(opt, 3, weight_decay=exponential(0.02, 0.5))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.02 * 0.5**3, 0.0]
    with pytest.raises(ValueError, match="Rprop has no weight_decay.*pass weight_decay=None"):
        apply_schedules(torch.optim.Rprop(_params(1)), 0, weight_decay=constant(0.1))


# ------------------------------------------------------- per param group, against torch / MMEngine
LAYER2_MULT = 10  # MMEngine's test_lr_scheduler: group 0 at lr 0.05, group 1 at 0.5


def _two_groups(lr=0.05, momentum=0.9, opt=torch.optim.SGD):
    a, b = _params(2)
    kw = {"momentum": momentum} if opt is torch.optim.SGD else {}
    groups = [{"params": [a]}, {"params": [b], "lr": lr * LAYER2_MULT}]
    return opt(groups, lr=lr, **kw)


def reference_groups(make_scheduler, steps, key="lr", **kw):
    """Each group's ``key`` a torch / MMEngine scheduler gives at steps 0..steps-1."""
    opt = _two_groups(**kw)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append([_value(g, key) for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def ftrain_groups(steps, key="lr", opt=torch.optim.SGD, **schedules):
    """Each group's ``key`` after ``apply_schedules`` at steps 0..steps-1 (two groups)."""
    optimizer = _two_groups(opt=opt)
    out = []
    for n in range(steps):
        apply_schedules(optimizer, n, **schedules)
        out.append([_value(g, key) for g in optimizer.param_groups])
    return out


def _value(group, key):
    return group["betas"][0] if key == "momentum" and "betas" in group else group[key]


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb))


def ftrain_lrs(schedule, steps, lr=0.05):
    opt = _two_groups(lr)
    out = []
    for n in range(steps):
        apply_schedules(opt, n, lr=schedule)
        out.append([g["lr"] for g in opt.param_groups])
    return out


FIGURES: dict[str, float] = {}  # the largest differences measured, printed by the last test


def _agree(name, ours, reference, tol=1e-12):
    FIGURES[name] = max(FIGURES.get(name, 0.0), max_diff(ours, reference))
    assert FIGURES[name] <= tol, (name, ours, reference)


def test_absolute_floors_stay_absolute_in_every_group_as_torch_cosineannealinglr():
    eta_min, total = 0.02, 12
    ref = reference_groups(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total, eta_min=eta_min), 13
    )
    ours = ftrain_lrs(cosine(0.05, total, final=eta_min), 13)
    _agree("torch CosineAnnealingLR(eta_min), 2 groups", ours, ref)
    assert ours[-1] == pytest.approx([eta_min, eta_min])  # the x10 group ends at the floor
    # the former rule (the floor times the group's ratio) would end the x10 group at 0.2
    assert ours[-1][1] != pytest.approx(eta_min * LAYER2_MULT)


@pytest.fixture(scope="module")
def mmengine_sched():
    """MMEngine's schedulers (the ``mmengine`` extra)."""
    return pytest.importorskip("mmengine.optim.scheduler")


def test_mmengine_poly_scheduler_two_group_targets(mmengine_sched):
    # MMEngine's own tests/test_optim/test_scheduler/test_lr_scheduler.py::test_poly_scheduler
    epochs, power, min_lr, iters = 10, 0.9, 0.001, 4
    layer1 = [min_lr + (0.05 - min_lr) * (1 - i / iters) ** power for i in range(iters)]
    layer2 = [
        min_lr + (0.05 * LAYER2_MULT - min_lr) * (1 - i / iters) ** power for i in range(iters)
    ]
    targets = [
        list(pair)
        for pair in zip(layer1 + [min_lr] * (epochs - iters), layer2 + [min_lr] * (epochs - iters))
    ]
    ours = ftrain_lrs(polynomial(0.05, iters, power=power, min_value=min_lr), epochs)
    real = reference_groups(
        lambda o: mmengine_sched.PolyLR(o, power=power, eta_min=min_lr, end=iters + 1), epochs
    )
    _agree("MMEngine PolyLR(eta_min), 2 groups", ours, real)
    _agree("MMEngine test_poly_scheduler targets", ours, targets)


@pytest.mark.parametrize("floor", [dict(eta_min=0.01), dict(eta_min_ratio=0.05)])
def test_mmengine_cosineannealinglr_eta_min_and_eta_min_ratio_per_group(floor, mmengine_sched):
    total, steps = 10, 14
    real = reference_groups(
        lambda o: mmengine_sched.CosineAnnealingLR(o, T_max=total, **floor), steps
    )
    final = dict(final=floor["eta_min"]) if "eta_min" in floor else dict(final_ratio=0.05)
    ours = ftrain_lrs(cosine(0.05, total, **final), total + 1)
    # MMEngine's cosine rises again after T_max; ftrain holds the final value
    _agree(f"MMEngine CosineAnnealingLR({next(iter(floor))}), 2 groups", ours, real[: total + 1])


@pytest.mark.parametrize("floor", [dict(eta_min=0.0), dict(eta_min=0.004), dict(eta_min_ratio=0.1)])
def test_cosine_restarts_is_mmengines_cosinerestartlr(floor, mmengine_sched):
    periods, weights, steps = [4, 5, 3], [1.0, 0.5, 0.25], 16  # 4 steps after the last period
    real = reference_groups(
        lambda o: mmengine_sched.CosineRestartLR(
            o, periods=periods, restart_weights=weights, **floor
        ),
        steps,
    )
    final = dict(final=floor["eta_min"]) if "eta_min" in floor else dict(final_ratio=0.1)
    ours = ftrain_lrs(cosine_restarts(0.05, periods, weights, **final), steps)
    _agree(f"MMEngine CosineRestartLR({next(iter(floor))}), 2 groups", ours, real)


def test_cosine_restarts_mmengine_test_targets():
    # MMEngine's test_lr_scheduler.py::test_cosine_restart_scheduler (its targets are
    # rounded: within its own assert_allclose tolerance)
    single = [0.05, 0.0426776, 0.025, 0.00732233, 0.025, 0.022612712, 0.01636271]
    single += [0.0086372, 0.0023872, 0.0023872]
    ours = ftrain_lrs(cosine_restarts(0.05, [4, 5], [1, 0.5], final=0.0), 10)
    for got, want in zip(ours, single, strict=True):
        assert got == pytest.approx([want, want * LAYER2_MULT], rel=1.3e-6, abs=1e-5)


@pytest.mark.parametrize("anneal", ["cos", "linear"])
@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.AdamW])
def test_onecycle_is_torch_onecyclelr_lr_and_momentum(anneal, three_phase, opt):
    total, pct = 40, 0.25

    def make(o):
        return torch.optim.lr_scheduler.OneCycleLR(
            o,
            max_lr=[0.05, 0.5],
            total_steps=total,
            pct_start=pct,
            anneal_strategy=anneal,
            three_phase=three_phase,
            div_factor=20.0,
            final_div_factor=50.0,
        )

    kw = dict(anneal=anneal, three_phase=three_phase, pct_start=pct)
    lr = onecycle(0.05, total, div_factor=20.0, final_div_factor=50.0, **kw)
    mom = onecycle_momentum(total, base=0.85, max_value=0.95, **kw)
    for key in ("lr", "momentum"):
        ref = reference_groups(make, total, key=key, opt=opt)
        ours = ftrain_groups(total, key=key, lr=lr, momentum=mom, opt=opt)
        _agree(f"torch OneCycleLR {key} ({anneal}, three_phase={three_phase})", ours, ref)


def test_onecycle_holds_its_last_value_after_total():
    s, m = onecycle(0.1, total=20), onecycle_momentum(total=20)
    assert s(19) == s(20) == s(1000) and m(19) == m(500) == 0.95


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_warmup_from_zero_is_transformers_schedule_with_warmup(kind, transformers):
    base, warm, total = 0.05, 5, 30
    if kind == "linear":
        make = lambda o: transformers.get_linear_schedule_with_warmup(o, warm, total)  # noqa: E731
        after = polynomial(base, total - warm, power=1.0)
    else:
        make = lambda o: transformers.get_cosine_schedule_with_warmup(o, warm, total)  # noqa: E731
        after = cosine(base, total - warm)
    ours = ftrain_lrs(join([warmup(constant(base), warm, ratio=0), after], [warm]), total + 1)
    _agree(f"transformers get_{kind}_schedule_with_warmup", ours, reference_groups(make, total + 1))
    assert ours[0] == [0.0, 0.0]


# ------------------------------------------------- the loss function sees this update's values
@pytest.mark.parametrize("every", [1, 3])
def test_the_loss_function_sees_the_values_torch_shows(every):
    """loss_fn reads the optimizer: the values of the update it contributes to (torch's)."""
    total = 8
    batches = make_batches(total * every)
    seen_torch, seen = [], []
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
    for k, batch in enumerate(batches):
        g = opt.param_groups[0]
        seen_torch.append((g["lr"], g["momentum"]))
        (mse_loss(model, batch) / every).backward()
        if (k + 1) % every == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
    ours = _sgd_state(lr=0.1)
    optimizer = ours.optimizer

    def loss_fn(m, batch):
        g = optimizer.param_groups[0]
        seen.append((g["lr"], g["momentum"]))
        return mse_loss(m, batch)

    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=every)
    step = ftrain.with_schedule(step, lr=onecycle(0.1, total), momentum=onecycle_momentum(total))
    state = ftrain.Loop(step, ours, batches, hooks=[]).run()
    _agree("loss_fn's values vs torch OneCycleLR (accumulation)", seen, seen_torch)
    for a, b in zip(state.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_the_loss_function_sees_the_scheduled_value_not_the_last_updates():
    # the example: optimizer lr 0.1, warmup from 0.025 by 0.01875 per update
    sched = warmup(constant(0.1), iters=4, ratio=0.25)
    seen = []
    state = _sgd_state(lr=0.1)
    optimizer = state.optimizer

    def loss_fn(m, batch):
        seen.append(optimizer.param_groups[0]["lr"])
        return mse_loss(m, batch)

    step = ftrain.with_schedule(ftrain.make_step(loss_fn), lr=sched)
    ftrain.Loop(step, state, make_batches(5), hooks=[]).run()
    assert seen == [sched(k) for k in range(5)]
    assert seen[:3] == pytest.approx([0.025, 0.04375, 0.0625])


@pytest.mark.parametrize("every", [1, 4])
def test_count_micro_batches_is_mmengines_iteration(every, mmengine_sched):
    """count='micro_batches': micro-batch i sees schedule(i), as MMEngine's ParamSchedulerHook
    (stepped after every iteration) shows it; the update ending window u uses N*u + N - 1."""
    model = make_model(0)
    groups = [
        {"params": model.fc1.parameters()},
        {"params": model.fc2.parameters(), "lr": 0.05 * LAYER2_MULT},
    ]
    state = ftrain.TrainState.create(model, torch.optim.SGD(groups, lr=0.05, momentum=0.9))
    optimizer, seen = state.optimizer, []

    def loss_fn(m, batch):
        seen.append([g["lr"] for g in optimizer.param_groups])
        return mse_loss(m, batch)

    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=every)
    step = ftrain.with_schedule(step, lr=cosine(0.05, 16, final=0.01), count="micro_batches")
    ftrain.Loop(step, state, make_batches(16), hooks=[]).run()
    real = reference_groups(
        lambda o: mmengine_sched.CosineAnnealingLR(o, T_max=16, eta_min=0.01), 16
    )
    _agree(f"MMEngine CosineAnnealingLR per iteration, accumulation {every}", seen, real)


def test_with_schedule_bad_count():
    with pytest.raises(ValueError, match=r"count must be one of \('updates', 'micro_batches'\)"):
        ftrain.with_schedule(ftrain.make_step(mse_loss), lr=constant(0.1), count="iters")


def test_zz_print_the_differences_measured():
    for name, diff in sorted(FIGURES.items()):
        print(f"max |ftrain - reference| {diff:.3g}  {name}")


def test_the_schedules_page_runs(tmp_path, monkeypatch, capsys):
    """docs/concepts/schedules.md: every code block runs, in order, and prints what it says."""
    page = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "schedules.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/concepts/schedules.md block {i + 1}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[0.0, 0.05, 0.1, 0.0505, 0.001]"
    assert out[1] == "[0.001, 0.001]"  # the x10 group ends at the absolute floor too
    assert out[2] == "cosine(base=1.0, total=7, final=0.001)"
    assert out[3].startswith("PlateauState(") and "observed=4" in out[3]
    assert namespace["state"].transforms["schedule"].plateau.observed == 5


def test_a_state_loaded_mid_window_gets_its_values_written_again():
    """Within a window the values are written once; a state loaded from a checkpoint (another
    run's optimizer values, here 123.0) gets them written again before its next forward."""
    import ftrain.checkpoint

    sched = exponential(0.1, 0.5)
    state = _sgd_state(lr=0.1)
    optimizer, seen = state.optimizer, []

    def loss_fn(m, batch):
        seen.append(optimizer.param_groups[0]["lr"])
        return mse_loss(m, batch)

    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=3)
    step = ftrain.with_schedule(step, lr=sched)
    batches = make_batches(6)
    for batch in batches[:4]:  # update 0, then one micro-batch of update 1
        state, _ = step(state, batch)
    saved = ftrain.checkpoint.state_dict(state)
    state = ftrain.checkpoint.load_state_dict(state, saved)
    optimizer.param_groups[0]["lr"] = 123.0
    for batch in batches[4:]:
        state, _ = step(state, batch)
    assert seen == [sched(0)] * 3 + [sched(1)] * 3
