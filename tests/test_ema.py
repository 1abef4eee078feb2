"""with_ema: the weight average in the step, against a hand-written EMA of the trajectory."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.events import StepEnd
from ftrain.transforms import ema as ema_module
from ftrain.transforms.ema import ema_state_dict, swap_ema, use_ema


def bn_state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def sgd_state(seed=0):
    model = make_model(seed)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def averaged(state):
    return list(state.transforms["ema"].params.values())


def assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def trajectory_hook(log):
    def record(events):
        for ev in events:
            if type(ev) is StepEnd and ev.is_update:
                log.append(params_of(ev.state.model))
            yield ev

    return ftrain.hook(record)


@pytest.mark.parametrize("every, warmup", [(1, None), (3, None), (2, 5)])
def test_ema_equals_hand_computed_average_of_the_trajectory(every, warmup):
    decay = 0.7
    trajectory = []
    step = ftrain.with_ema(ftrain.make_step(mse_loss), decay, every=every, warmup=warmup)
    state = ftrain.Loop(
        step, bn_state(), make_batches(5), [trajectory_hook(trajectory)], epochs=2
    ).run()
    expected = trajectory[0]
    textbook = trajectory[0]
    for n, params in enumerate(trajectory[1:], start=1):
        if n % every == 0:
            w = 1 - decay if warmup is None else decay * math.exp(-(1 + n) / warmup) + 1 - decay
            expected = [e.lerp(p, w) for e, p in zip(expected, params)]
            d = 1 - w
            textbook = [d * e + (1 - d) * p for e, p in zip(textbook, params)]
    assert state.transforms["ema"].updates == 10
    assert_bitwise(averaged(state), expected)
    for a, b in zip(averaged(state), textbook):
        torch.testing.assert_close(a, b)
    assert not any(t.requires_grad for t in averaged(state))
    # buffers (BatchNorm statistics) are copied from the model
    assert_bitwise(state.transforms["ema"].buffers.values(), list(state.model.buffers()))


def test_ema_once_per_update_with_grad_accum():
    trajectory = []
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    step = ftrain.with_ema(step, 0.5)
    state = ftrain.Loop(step, sgd_state(), make_batches(7), [trajectory_hook(trajectory)]).run()
    assert state.step == 3 and state.transforms["ema"].updates == 3  # 3 + 3 + a flushed 1
    expected = trajectory[0]
    for params in trajectory[1:]:
        expected = [e.lerp(p, 0.5) for e, p in zip(expected, params)]
    assert_bitwise(averaged(state), expected)


def test_ema_begin_follows_the_model_until_then():
    trajectory = []
    step = ftrain.with_ema(ftrain.make_step(mse_loss), 0.5, begin=3)
    state = ftrain.Loop(step, sgd_state(), make_batches(5), [trajectory_hook(trajectory)]).run()
    expected = trajectory[2]  # updates 1, 2 only followed; the 3rd starts the average
    for params in trajectory[3:]:
        expected = [e.lerp(p, 0.5) for e, p in zip(expected, params)]
    assert state.transforms["ema"].updates == 3
    assert_bitwise(averaged(state), expected)


def test_ema_does_not_average_an_update_the_nonfinite_check_skipped():
    batches = make_batches(4)
    x, y = batches[2]
    batches[2] = (torch.full_like(x, float("nan")), y)
    trajectory = []
    step = ftrain.with_nonfinite_check(ftrain.make_step(mse_loss), action="skip")
    step = ftrain.with_ema(step, 0.5)
    state = ftrain.Loop(step, sgd_state(), batches, [trajectory_hook(trajectory)]).run()
    assert state.transforms["ema"].updates == 4  # counted, as in state.step
    expected = trajectory[0]
    for n, params in enumerate(trajectory[1:], start=1):
        if n != 2:  # the skipped update: the weights did not change, nothing is averaged
            expected = [e.lerp(p, 0.5) for e, p in zip(expected, params)]
    assert_bitwise(averaged(state), expected)


def test_ema_does_not_average_an_update_the_fp16_scaler_skipped():
    """fp16 on the CPU: the first updates overflow at the initial scale 2**24 and are skipped."""
    step = ftrain.with_amp(ftrain.make_step(mse_loss), "fp16", loss_scale={"init_scale": 2.0**24})
    step = ftrain.with_ema(step, 0.5)
    state = sgd_state()
    before, skipped = params_of(state.model), []
    expected = before
    for n, batch in enumerate(make_batches(40, seed=3)):
        x, y = batch
        state, m = step(state, (x * 1e4, y))
        skipped.append(bool(m["skipped"]))
        params = params_of(state.model)
        if n == 0:
            expected = params
        elif not skipped[-1]:
            expected = [e.lerp(p, 0.5) for e, p in zip(expected, params)]
    assert any(skipped) and not all(skipped)
    assert state.transforms["ema"].updates == 40
    assert_bitwise(averaged(state), expected)


def test_swap_ema_puts_the_average_in_and_takes_it_out():
    step = ftrain.with_ema(ftrain.make_step(mse_loss), 0.5)
    state = ftrain.Loop(step, sgd_state(), make_batches(4), []).run()
    own = params_of(state.model)
    assert not all(torch.equal(a, b) for a, b in zip(own, averaged(state)))
    with swap_ema(state) as model:
        assert model is state.model
        assert_bitwise(params_of(state.model), averaged(state))
    assert_bitwise(params_of(state.model), own)
    with pytest.raises(RuntimeError, match="boom"), swap_ema(state):
        raise RuntimeError("boom")
    assert_bitwise(params_of(state.model), own)
    with pytest.raises(ValueError, match=r"no weight average.*with_ema"):
        swap_ema(sgd_state()).__enter__()


def test_use_ema_evaluates_the_average_including_the_last_update():
    seen = []

    def evaluate(state):
        seen.append(params_of(state.model))
        return {"acc": 1.0}

    step = ftrain.with_ema(ftrain.make_step(mse_loss), 0.6)
    hooks = [ftrain.EvalHook(use_ema(evaluate))]
    state = ftrain.Loop(step, sgd_state(), make_batches(3), hooks, epochs=2).run()
    assert len(seen) == 2
    assert_bitwise(seen[-1], averaged(state))  # the average after the epoch's last update
    assert not all(torch.equal(a, b) for a, b in zip(seen[-1], params_of(state.model)))


def test_ema_resumes_exactly(tmp_path):
    def run(work_dir, resume=None, max_steps=12):
        step = ftrain.with_ema(ftrain.make_step(mse_loss), 0.75, every=2, warmup=4)
        hooks = [ftrain.CheckpointHook(interval=6)]
        return ftrain.Loop(
            step,
            bn_state(),
            make_batches(5),
            hooks,
            max_steps=max_steps,
            work_dir=work_dir,
            resume=resume,
        ).run()

    a = run(tmp_path / "a")
    run(tmp_path / "b", max_steps=7)
    b = run(tmp_path / "b", resume=tmp_path / "b" / "iter_6.pth")
    assert b.transforms["ema"].updates == a.transforms["ema"].updates == 12
    assert_bitwise(params_of(b.model), params_of(a.model))
    assert ema_state_dict(b).keys() == ema_state_dict(a).keys()
    assert_bitwise(ema_state_dict(b).values(), list(ema_state_dict(a).values()))


def test_ema_state_dict_loads_into_a_model_and_survives_clone():
    step = ftrain.with_ema(ftrain.make_step(mse_loss), 0.5)
    state = ftrain.Loop(step, sgd_state(), make_batches(3), []).run()
    other = make_model(1)
    other.load_state_dict(ema_state_dict(state))
    assert_bitwise(params_of(other), averaged(state))
    copy = state.clone()
    assert_bitwise(averaged(copy), averaged(state))
    assert averaged(copy)[0] is not averaged(state)[0]
    batch = make_batches(1, seed=5)[0]
    copy, _ = step(copy, batch)
    state, _ = step(state, batch)
    assert_bitwise(averaged(copy), averaged(state))  # the copy's cache is its own model's


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(decay=1.5), "decay=1 - m"),
        (dict(decay=0.0), "(0, 1)"),
        (dict(every=0), "every"),
        (dict(warmup=-1), "warmup"),
        (dict(begin=-1), "begin"),
    ],
)
def test_with_ema_bad_arguments(kwargs, text):
    with pytest.raises(ValueError) as info:
        ftrain.with_ema(ftrain.make_step(mse_loss), **kwargs)
    assert text in str(info.value)


def test_docstring_examples():
    result = doctest.testmod(ema_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------- counting micro-batches, as MMEngine's EMAHook
@pytest.fixture(scope="module")
def mm_ema():
    """MMEngine's averaging models (the ``mmengine`` extra)."""
    return pytest.importorskip("mmengine.model")


@pytest.mark.parametrize("every, accumulate", [(1, 4), (2, 3), (3, 1)])
def test_ema_counting_micro_batches_is_mmengines_average_per_iteration(mm_ema, every, accumulate):
    """A plain accumulation loop calling MMEngine's ``update_parameters`` after every
    micro-batch (what ``EMAHook.after_train_iter`` does) against ``count='micro_batches'``."""
    momentum, batches = 0.2, make_batches(12)
    ref_model = bn_state().model
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = mm_ema.ExponentialMovingAverage(ref_model, momentum=momentum, interval=every)
    expected = []
    for k, batch in enumerate(batches):
        (mse_loss(ref_model, batch) / accumulate).backward()
        if (k + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
        ref.update_parameters(ref_model)
        expected.append(params_of(ref.module))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=accumulate)
    step = ftrain.with_ema(step, 1 - momentum, every=every, count="micro_batches")
    state, seen = bn_state(), []
    for batch in batches:
        state, _ = step(state, batch)
        seen.append([t.clone() for t in averaged(state)])
    assert state.transforms["ema"].updates == len(batches)  # MMEngine's `steps`
    for got, want in zip(seen, expected, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_ema_counting_micro_batches_begins_at_a_micro_batch():
    """begin counts micro-batches: before it the average is the model (EMAHook's begin_iter)."""
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    step = ftrain.with_ema(step, 0.5, begin=5, count="micro_batches")
    state, batches = sgd_state(), make_batches(8)
    for k, batch in enumerate(batches):
        before = params_of(state.model)
        state, _ = step(state, batch)
        if k + 1 < 5:  # not started: a copy of the weights after this micro-batch
            assert_bitwise(averaged(state), params_of(state.model))
        elif k + 1 == 5:  # micro-batch 4 (from 0): the first average, of unchanged weights
            assert_bitwise(params_of(state.model), before)
    assert state.transforms["ema"].updates == 4  # micro-batches 4, 5, 6, 7


def test_with_ema_bad_count():
    with pytest.raises(ValueError, match="count must be one of"):
        ftrain.with_ema(ftrain.make_step(mse_loss), count="iterations")
