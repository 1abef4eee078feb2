"""The pure step and its transforms, checked against plain PyTorch loops."""

import io
import itertools
import math

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import StaleStateError


def sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------- make_step
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_make_step_bitwise_equals_plain_loop(opt_name):
    batches = make_batches(10)
    make_opt = {
        "sgd": sgd,
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    }[opt_name]

    ref = make_model()
    opt = make_opt(ref)
    for b in batches:
        loss = mse_loss(ref, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model = make_model()
    state = ftrain.TrainState.create(model, make_opt(model))
    step = ftrain.make_step(mse_loss)
    for i, b in enumerate(batches):
        state, metrics = step(state, b)
        assert state.step == i + 1 and state.micro_step == i + 1
        assert isinstance(metrics["loss"], torch.Tensor)
    assert_bitwise(params_of(ref), params_of(state.model))


def test_loss_fn_may_return_metrics():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))

    def loss_fn(m, b):
        loss = mse_loss(m, b)
        return loss, {"double": 2 * loss.detach()}

    state, metrics = ftrain.make_step(loss_fn)(state, make_batches(1)[0])
    assert torch.allclose(metrics["double"], 2 * metrics["loss"])


def test_bad_loss_fn_output_is_explained():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    with pytest.raises(TypeError, match="scalar loss"):
        ftrain.make_step(lambda m, b: m(b[0]))(state, make_batches(1)[0])
    # the failed call left the state usable
    state, _ = ftrain.make_step(mse_loss)(state, make_batches(1)[0])
    with pytest.raises(TypeError, match="must return"):
        ftrain.make_step(lambda m, b: "loss")(state, None)


# ---------------------------------------------------------------- donation
def test_consumed_state_raises_and_clone_stays_valid():
    model = make_model()
    s0 = ftrain.TrainState.create(model, sgd(model))
    sibling = s0.replace(epoch=1)
    backup = s0.clone()
    step = ftrain.make_step(mse_loss)
    b = make_batches(1)[0]
    s1, _ = step(s0, b)
    with pytest.raises(StaleStateError, match="clone"):
        step(s0, b)
    with pytest.raises(StaleStateError, match="step=0"):
        _ = s0.model
    with pytest.raises(StaleStateError):
        _ = s0.optimizer
    with pytest.raises(StaleStateError):
        step(sibling, b)  # shares the donated tensors
    assert "consumed" in repr(s0)
    # the backup is independent and valid: stepping it reproduces s1
    b2, _ = step(backup, b)
    assert_bitwise(params_of(s1.model), params_of(b2.model))
    assert b2.model is not s1.model
    s2, _ = step(s1, b)  # the returned state is valid
    assert s2.step == 2


@pytest.mark.parametrize("amp", [None, "fp16"])
def test_clone_mid_window_keeps_the_partial_gradients(amp):
    """A clone taken mid-window continues exactly like the original."""
    batches = make_batches(6)

    def build():
        model = make_model()
        return ftrain.TrainState.create(model, sgd(model))

    step = ftrain.make_step(mse_loss)
    if amp:
        step = ftrain.with_amp(step, amp)
    step = ftrain.with_grad_accum(step, every=4)
    state = build()
    for b in batches[:2]:
        state, _ = step(state, b)
    copy = state.clone()
    assert step.pending(copy) == 2
    assert all(p.grad is not None for p in copy.model.parameters())
    for b in batches[2:5]:
        state, _ = step(state, b)
        copy, _ = step(copy, b)
    state, _ = step.flush(state)
    copy, _ = step.flush(copy)
    assert copy.step == state.step == 2
    assert_bitwise(params_of(copy.model), params_of(state.model))


def test_repr_is_readable():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_clip(ftrain.with_amp(ftrain.make_step(mse_loss), "fp16"), max_norm=1.0)
    state = step.init(state)
    text = repr(state)
    assert "MLP" in text and "SGD(lr=0.05" in text and "loss_scale=65536" in text
    assert "tensor(" not in text
    assert "Clip('norm', max_norm=1" in repr(step)


# ------------------------------------------------------------- accumulation
def test_grad_accum_equals_large_batch():
    micro = make_batches(8, batch_size=4)
    ref = make_model()
    opt = sgd(ref)
    for i in range(0, 8, 4):
        x = torch.cat([b[0] for b in micro[i : i + 4]])
        y = torch.cat([b[1] for b in micro[i : i + 4]])
        mse_loss(ref, (x, y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=4)
    for i, b in enumerate(micro):
        state, metrics = step(state, b)
        assert state.step == (i + 1) // 4
    for a, b in zip(params_of(ref), params_of(state.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_partial_window_is_flushed_at_its_true_size():
    micro = make_batches(6, batch_size=4)
    ref = make_model()
    opt = sgd(ref)
    for chunk in (micro[:4], micro[4:]):  # the second "large batch" holds only 2
        x = torch.cat([b[0] for b in chunk])
        y = torch.cat([b[1] for b in chunk])
        mse_loss(ref, (x, y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=4)
    for b in micro:
        state, _ = step(state, b)
    assert step.pending(state) == 2 and state.step == 1
    state, metrics = step.flush(state)
    assert step.pending(state) == 0 and state.step == 2
    for a, b in zip(params_of(ref), params_of(state.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    same, nothing = step.flush(state)  # nothing pending: unchanged
    assert same is state and nothing == {}


def test_bad_config_values_fail_clearly():
    step = ftrain.make_step(mse_loss)
    with pytest.raises(ValueError, match="every must be"):
        ftrain.with_grad_accum(step, every=0)
    with pytest.raises(ValueError, match="unknown mode"):
        ftrain.with_clip(step, "sometimes")
    with pytest.raises(ValueError, match="max_norm"):
        ftrain.with_clip(step, "norm")
    with pytest.raises(ValueError, match="dtype"):
        ftrain.with_amp(step, "fp8")
    with pytest.raises(ValueError, match="loss_scale"):
        ftrain.with_amp(step, "fp16", loss_scale={"init": 2.0})
    with pytest.raises(ValueError, match="already has"):
        ftrain.with_grad_accum(ftrain.with_grad_accum(step, every=2), every=2)


# --------------------------------------------------------------------- clip
def _run_clip(mode, norms_scale, **kw):
    """Train with clip ``mode`` and record grad norms; batches scaled to vary norms."""
    batches = make_batches(len(norms_scale))
    batches = [(x * s, y) for (x, y), s in zip(batches, norms_scale)]
    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = ftrain.with_clip(ftrain.make_step(mse_loss), mode, **kw)
    out = []
    for b in batches:
        state, m = step(state, b)
        out.append(m)
    return batches, state, out


@pytest.mark.parametrize(
    "mode,kw",
    [
        ("norm", {"max_norm": 0.5}),
        ("value", {"clip_value": 0.05}),
        ("average", {"tolerance": 1.2}),
        ("moving_average", {"tolerance": 1.1, "momentum": 0.8}),
    ],
)
def test_clip_modes_match_reference(mode, kw):
    scales = [1.0, 3.0, 0.5, 8.0, 1.0, 20.0, 2.0]
    batches, state, metrics = _run_clip(mode, scales, **kw)

    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    past = []  # finite pre-clip norms seen so far
    ema = 0.0
    for b in batches:
        mse_loss(ref, b).backward()
        grads = [p.grad for p in ref.parameters()]
        norm = float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        )
        if mode == "norm":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), kw["max_norm"])
        elif mode == "value":
            torch.nn.utils.clip_grad_value_(ref.parameters(), kw["clip_value"])
        elif mode == "average":
            if past:
                torch.nn.utils.clip_grad_norm_(
                    ref.parameters(), kw["tolerance"] * sum(past) / len(past)
                )
        else:
            m = kw["momentum"]
            if past:
                corrected = ema / (1 - m ** len(past))
                torch.nn.utils.clip_grad_norm_(ref.parameters(), kw["tolerance"] * corrected)
            ema = m * ema + (1 - m) * norm
        past.append(norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for m, ref_norm in zip(metrics, past):
        assert math.isclose(float(m["grad_norm"]), ref_norm, rel_tol=1e-5)
    for a, b in zip(params_of(ref), params_of(state.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if mode in ("average", "moving_average"):
        assert float(metrics[0]["clip_threshold"]) == math.inf  # never clip with no history
        assert any(float(m["grad_norm"]) > float(m["clip_threshold"]) for m in metrics)


@pytest.mark.parametrize("mode", ["average", "moving_average"])
def test_average_clip_ignores_non_finite_norm_and_resumes(mode):
    """An fp16 overflow (inf norm) is skipped and does not poison the statistics."""
    batches = make_batches(6)
    inf_at = 2

    def loss_fn(model, batch):
        i, (x, y) = batch
        loss = mse_loss(model, (x, y))
        return loss * float("inf") if i == inf_at else loss

    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    momentum = 0.8
    extra = {"momentum": momentum} if mode == "moving_average" else {}
    step = ftrain.with_clip(
        ftrain.with_amp(ftrain.make_step(loss_fn), "fp16"), mode, tolerance=1.5, **extra
    )
    counts, norms, thresholds = [], [], []
    for i, b in enumerate(batches):
        state, m = step(state, (i, b))
        counts.append(int(state.transforms["clip"].count))
        norms.append(float(m["grad_norm"]))
        thresholds.append(float(m["clip_threshold"]))
        assert bool(m["skipped"]) == (i == inf_at)
        assert math.isfinite(float(state.transforms["clip"].mean))
    assert counts == [1, 2, 2, 3, 4, 5]
    assert not math.isfinite(norms[inf_at]) and math.isfinite(thresholds[inf_at + 1])
    # reference statistics over the finite norms only, in closed form
    finite = [n for n in norms if math.isfinite(n)]
    for k, threshold in enumerate(thresholds):
        past = [n for n in norms[:k] if math.isfinite(n)]
        if not past:
            assert threshold == math.inf
            continue
        if mode == "average":
            ref = sum(past) / len(past)
        else:  # bias-corrected EMA
            ema = 0.0
            for n in past:
                ema = momentum * ema + (1 - momentum) * n
            ref = ema / (1 - momentum ** len(past))
        assert math.isclose(threshold, 1.5 * ref, rel_tol=1e-5), (k, threshold, ref)
    if mode == "average":
        assert math.isclose(float(state.transforms["clip"].mean), sum(finite) / 5, rel_tol=1e-5)
    # the statistics survive a state_dict round trip
    saved = ftrain.checkpoint.state_dict(state)
    fresh = make_model(seed=1)
    other = ftrain.TrainState.create(fresh, torch.optim.SGD(fresh.parameters(), lr=0.01))
    other = step.init(ftrain.checkpoint.load_state_dict(other, saved))
    assert int(other.transforms["clip"].count) == 5
    assert torch.equal(other.transforms["clip"].mean, state.transforms["clip"].mean)


# ---------------------------------------------------------------------- AMP
def test_fp16_overflow_skips_update_and_backs_off_scale():
    batches = make_batches(3)

    def loss_fn(model, batch):
        inject, b = batch
        loss = mse_loss(model, b)
        return loss * torch.tensor(float("inf")) if inject else loss

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ftrain.TrainState.create(model, opt)
    step = ftrain.with_amp(ftrain.make_step(loss_fn), "fp16")
    state, m = step(state, (False, batches[0]))
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 65536.0
    before = params_of(state.model)
    opt_before = {k: v.clone() for k, v in state.optimizer.state_dict()["state"][0].items()}
    state, m = step(state, (True, batches[1]))
    assert bool(m["skipped"])
    assert float(m["loss_scale"]) == 32768.0
    assert_bitwise(before, params_of(state.model))
    after = state.optimizer.state_dict()["state"][0]
    assert all(torch.equal(opt_before[k], after[k]) for k in opt_before)  # step count too
    assert int(state.transforms["amp"].skipped) == 1
    state, m = step(state, (False, batches[2]))
    assert not bool(m["skipped"])
    assert not all(torch.equal(a, b) for a, b in zip(before, params_of(state.model)))


def test_fp16_dynamic_scaling_matches_gradscaler_loop():
    batches = make_batches(6)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for b in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(ref, b)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    step = ftrain.with_amp(
        ftrain.with_clip(ftrain.make_step(mse_loss), max_norm=0.3),  # clip composed first
        "fp16",
        loss_scale={"init_scale": 2.0**10, "growth_interval": 2},
    )
    for b in batches:
        state, m = step(state, b)
    assert_bitwise(params_of(ref), params_of(state.model))
    assert float(m["loss_scale"]) == scaler.get_scale()


def test_static_loss_scale_stays_fixed():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_amp(ftrain.make_step(mse_loss), "fp16", loss_scale=128.0)
    for b in make_batches(4):
        state, m = step(state, b)
        assert float(m["loss_scale"]) == 128.0


def test_bf16_autocast_on_cpu_and_no_scaler():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    seen = []
    step = ftrain.with_amp(
        ftrain.make_step(lambda m, b: (seen.append(m(b[0]).dtype), mse_loss(m, b))[1]), "bf16"
    )
    state, metrics = step(state, make_batches(1)[0])
    assert seen == [torch.bfloat16]
    assert "loss_scale" not in metrics


# ------------------------------------------------------------- composition
def _composed(order, loss_fn=mse_loss):
    fns = {
        "amp": lambda s: ftrain.with_amp(s, "fp16", loss_scale={"init_scale": 2.0**12}),
        "accum": lambda s: ftrain.with_grad_accum(s, every=3),
        "clip": lambda s: ftrain.with_clip(s, "moving_average", tolerance=1.1),
        "finite": lambda s: ftrain.with_nonfinite_check(s, "skip"),
    }
    step = ftrain.make_step(loss_fn)
    for name in order:
        step = fns[name](step)
    return step


def test_every_composition_order_trains_the_same():
    batches = make_batches(9)
    results = []
    for order in itertools.permutations(["amp", "accum", "clip", "finite"]):
        model = make_model()
        state = ftrain.TrainState.create(model, sgd(model))
        step = _composed(order)
        for b in batches:
            state, _ = step(state, b)
        results.append(params_of(state.model))
    for r in results[1:]:
        assert_bitwise(results[0], r)


def test_composed_step_matches_hand_written_reference():
    """AMP fp16 + accumulation + clip-by-norm against the MMEngine-style recipe."""
    batches = make_batches(6)
    ref = make_model()
    opt = sgd(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for i, b in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(ref, b)
        scaler.scale(loss / 3).backward()
        if (i + 1) % 3 == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_clip(
        ftrain.with_grad_accum(
            ftrain.with_amp(ftrain.make_step(mse_loss), "fp16", loss_scale={"init_scale": 2.0**12}),
            every=3,
        ),
        max_norm=0.2,
    )
    for b in batches:
        state, _ = step(state, b)
    assert_bitwise(params_of(ref), params_of(state.model))


def test_skipped_fp16_update_skips_the_whole_window():
    batches = make_batches(6)

    def loss_fn(model, batch):
        inject, b = batch
        loss = mse_loss(model, b)
        return loss * float("inf") if inject else loss

    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_grad_accum(ftrain.with_amp(ftrain.make_step(loss_fn), "fp16"), every=3)
    for i, b in enumerate(batches[:3]):
        state, m = step(state, (i == 1, b))  # overflow in the middle of window 1
    assert bool(m["skipped"])
    for p, q in zip(make_model().parameters(), state.model.parameters()):
        assert torch.equal(p, q)
    assert state.optimizer.state_dict()["state"] == {}  # no momentum buffer: never stepped
    assert all(p.grad is None for p in state.model.parameters())


def test_composed_step_makes_no_host_sync(monkeypatch):
    """bf16 AMP + accumulation + adaptive clipping: no .item()/bool()/float() in the step."""
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_clip(
        ftrain.with_grad_accum(ftrain.with_amp(ftrain.make_step(mse_loss), "bf16"), every=2),
        "moving_average",
    )
    batches = make_batches(6)
    state, _ = step(state, batches[0])  # first call: lazy state creation may look around

    def boom(*a, **k):
        raise AssertionError("host synchronisation in the hot path")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for b in batches[1:]:
        state, metrics = step(state, b)
    monkeypatch.undo()
    assert state.step == 3 and float(metrics["grad_norm"]) > 0


# --------------------------------------------------------------- non-finite
def test_nonfinite_loss_raises_without_losing_data():
    batches = make_batches(4)

    def loss_fn(model, batch):
        inject, b = batch
        loss = mse_loss(model, b)
        return loss * float("nan") if inject else loss

    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.with_nonfinite_check(ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2))
    state, _ = step(state, (False, batches[0]))
    state, _ = step(state, (False, batches[1]))
    good = params_of(state.model)
    state, _ = step(state, (False, batches[2]))
    with pytest.raises(FloatingPointError, match=r"step 1 .*nan") as info:
        step(state, (True, batches[3]))
    with pytest.raises(StaleStateError):
        step(state, (False, batches[3]))
    recovered = info.value.state
    assert_bitwise(good, params_of(recovered.model))
    assert step.pending(recovered) == 0 and recovered.step == 1
    recovered, _ = step(recovered, (False, batches[0]))  # training goes on


def test_nonfinite_skip_counts():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))

    def loss_fn(model, batch):
        inject, b = batch
        loss = mse_loss(model, b)
        return loss * float("inf") if inject else loss

    step = ftrain.with_nonfinite_check(ftrain.make_step(loss_fn), "skip")
    before = params_of(state.model)
    state, m = step(state, (True, make_batches(1)[0]))
    assert bool(m["skipped"]) and state.transforms["nonfinite"].skipped == 1
    assert_bitwise(before, params_of(state.model))
    state, m = step(state, (False, make_batches(1)[0]))
    assert not bool(m["skipped"])


# ------------------------------------------------------------ unused params
def test_unused_parameters_are_reported_by_name_and_shape():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(8, 4)
            self.unused = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.used(x)

    model = Two()
    b = make_batches(1)[0]
    assert ftrain.transforms.find_unused_parameters(model, mse_loss, b) == [
        ("unused.weight", (3, 8)),
        ("unused.bias", (3,)),
    ]
    state = ftrain.TrainState.create(model, sgd(model))
    step = ftrain.transforms.with_unused_check(ftrain.make_step(mse_loss))
    with pytest.warns(UserWarning, match=r"unused.weight \(3, 8\)"):
        state, _ = step(state, b)
    strict = ftrain.transforms.with_unused_check(
        ftrain.make_step(mse_loss), action="raise", once=False
    )
    with pytest.raises(RuntimeError, match="unused.bias"):
        strict(state, b)
    state, _ = step(state, b)  # the raise left the state valid


# ------------------------------------------------------------ checkpointing
@pytest.mark.parametrize("stop_at", [4, 5, 7])
def test_state_dict_mid_window_continues_identically(stop_at):
    """Stop mid accumulation window, save to bytes, load into new objects, continue."""
    batches = make_batches(12)
    step = _composed(["amp", "accum", "clip", "finite"])

    model = make_model(dropout=0.2)
    state = ftrain.TrainState.create(model, sgd(model))
    torch.manual_seed(123)
    for b in batches:
        state, _ = step(state, b)
    straight = params_of(state.model)

    model = make_model(dropout=0.2)
    state = ftrain.TrainState.create(model, sgd(model))
    torch.manual_seed(123)
    for b in batches[:stop_at]:
        state, _ = step(state, b)
    buf = io.BytesIO()
    torch.save(ftrain.checkpoint.state_dict(state), buf)
    assert step.pending(state) == stop_at % 3
    torch.manual_seed(999)  # the RNG state must come from the checkpoint

    model = make_model(seed=7, dropout=0.2)  # different initial weights
    resumed = ftrain.TrainState.create(model, sgd(model))
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    resumed = ftrain.checkpoint.load_state_dict(resumed, saved)
    assert resumed.step == state.step and resumed.micro_step == stop_at
    for b in batches[stop_at:]:
        resumed, _ = step(resumed, b)
    assert_bitwise(straight, params_of(resumed.model))


def test_load_state_dict_rejects_foreign_dicts():
    model = make_model()
    state = ftrain.TrainState.create(model, sgd(model))
    with pytest.raises(ValueError, match="load_weights"):
        ftrain.checkpoint.load_state_dict(state, model.state_dict())


# ----------------------------------------------------------------- bad input
def test_create_refuses_an_optimizer_over_another_models_parameters():
    model, other = make_model(0), make_model(1)
    with pytest.raises(ValueError, match=r"none of the model's parameters.*model\.parameters\(\)"):
        ftrain.TrainState.create(model, sgd(other))
    state = ftrain.TrainState.create(model, sgd(model))
    with pytest.raises(ValueError, match="none of the model's parameters"):
        state.replace(optimizer=sgd(other))


def test_an_optimizer_over_a_subset_or_with_extra_tensors_trains_like_plain_pytorch():
    """A frozen backbone (optimizer over the head only) and an extra learnt tensor are fine."""
    batches = make_batches(4)

    def build(seed=0):
        model = make_model(seed)
        extra = torch.nn.Parameter(torch.ones(()))
        opt = torch.optim.SGD([*model.fc2.parameters(), extra], lr=0.1)
        return model, extra, opt

    def loss_fn(extra):
        return lambda m, b: mse_loss(m, b) * extra

    ref_model, ref_extra, ref_opt = build()
    for b in batches:  # the plain loop
        loss_fn(ref_extra)(ref_model, b).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    model, extra, opt = build()
    fc1 = params_of(model)[:2]
    state = ftrain.Loop(
        ftrain.make_step(loss_fn(extra)), ftrain.TrainState.create(model, opt), batches, hooks=[]
    ).run()
    assert_bitwise(params_of(state.model), params_of(ref_model))
    assert_bitwise(params_of(state.model)[:2], fc1)  # the frozen part did not move
    assert torch.equal(extra, ref_extra) and not torch.equal(extra, torch.ones(()))
