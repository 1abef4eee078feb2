"""Several optimizers in one TrainState: a GAN (examples/gan.py) and optimizers over parameter
subsets trained by one loss, each checked bitwise against the same training written as a
plain PyTorch loop; exact resume (Loop, checkpoint state dicts, mid-window, SIGINT); bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import attrs
import pytest
import torch

import ftrain
from ftrain.errors import CheckpointError
from ftrain.events import StepEnd
from ftrain.transforms.base import Transform
from ftrain.transforms.compile import CompileFallbackWarning
from ftrain.transforms.ema import ema_state_dict, swap_ema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import gan  # noqa: E402

EPOCHS = 3  # 48 rounds of the example's data


# ------------------------------------------------------------------ helpers
def flat(obj, prefix=""):
    """Every tensor and number of a nested state dict, by path."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = obj
    return out


def assert_same(a, b):
    """Bitwise equal (NaN equal to NaN), key for key."""
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys(), sorted(set(fa) ^ set(fb))[:5]
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=k)
        else:
            assert x == y, (k, x, y)


def saved(state):
    return ftrain.checkpoint.state_dict(state, rng=False)


def gan_state():
    model = gan.make_model()
    return ftrain.TrainState.create(model, gan.make_optimizers(model))


def hand_written_gan(epochs):
    """The example's GAN as a plain two-optimizer PyTorch loop: zero_grad before each
    backward, a GradScaler, clipping and a learning rate per optimizer, the generator's EMA."""
    model = gan.make_model()
    opts = gan.make_optimizers(model)
    opt_d, opt_g = opts["disc"], opts["gen"]
    scaler_d, scaler_g = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    disc, gen = list(model["disc"].parameters()), list(model["gen"].parameters())
    ema, losses, n = None, [], 0
    loader = gan.loader()
    for epoch in range(epochs):
        loader.generator.manual_seed(gan.SEED + epoch)  # as the Loop seeds each epoch
        for batch in loader:
            for group in opt_d.param_groups:
                group["lr"] = gan.LR_D(n)
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_d = gan.d_loss(model, batch)
            scaler_d.scale(loss_d).backward()
            scaler_d.unscale_(opt_d)
            torch.nn.utils.clip_grad_norm_(disc, gan.CLIP_D)
            scaler_d.step(opt_d)
            scaler_d.update()
            for group in opt_g.param_groups:
                group["lr"] = gan.LR_G(n)
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = gan.g_loss(model, batch)
            scaler_g.scale(loss_g).backward()
            scaler_g.unscale_(opt_g)
            torch.nn.utils.clip_grad_norm_(gen, gan.CLIP_G)
            scale = scaler_g.get_scale()
            scaler_g.step(opt_g)
            scaler_g.update()
            with torch.no_grad():
                if ema is None:
                    ema = [p.detach().clone() for p in gen]
                elif scaler_g.get_scale() >= scale:  # not skipped for an overflow
                    for e, p in zip(ema, gen):
                        e.lerp_(p, 1 - gan.EMA_DECAY)
            losses.append((loss_d.detach(), loss_g.detach()))
            n += 1
    return model, opts, (scaler_d, scaler_g), ema, losses


def record_losses(out):
    def hook(events):
        for ev in events:
            if isinstance(ev, StepEnd):
                out.append((ev.metrics["disc/loss"], ev.metrics["gen/loss"]))
            yield ev

    return hook


# ------------------------------------------------------------------ the GAN
def test_gan_example_equals_the_hand_written_two_optimizer_loop_bitwise():
    losses = []
    state = gan.build(None, hooks=[record_losses(losses)], epochs=EPOCHS).run()
    model, opts, scalers, ema, ref_losses = hand_written_gan(EPOCHS)

    rounds = EPOCHS * gan.POINTS // gan.BATCH
    assert (state.step, state.micro_step, state.epoch) == (rounds, rounds, EPOCHS)
    assert_same(state.model.state_dict(), model.state_dict())
    for name, opt in opts.items():
        assert_same(state.optimizers[name].state_dict()["state"], opt.state_dict()["state"])
        assert [g["lr"] for g in state.optimizers[name].param_groups] == [
            g["lr"] for g in opt.param_groups
        ]
    t = state.transforms
    assert t["disc/amp"].scaler.state_dict() == scalers[0].state_dict()
    assert t["gen/amp"].scaler.state_dict() == scalers[1].state_dict()
    assert_same(list(t["gen/ema"].params.values()), ema)
    assert sorted(t) == ["disc/amp", "disc/clip", "disc/schedule", "gen/amp", "gen/clip",
                         "gen/ema", "gen/schedule"]  # fmt: skip
    assert_same(losses, ref_losses)
    # each step leaves no gradient behind, on its parameters or the other's
    assert all(p.grad is None for p in state.model.parameters())


def test_gan_resumes_bitwise_from_a_mid_run_checkpoint_through_the_loop(tmp_path):
    straight = gan.build(None, hooks=[], epochs=EPOCHS).run()
    hooks = [ftrain.CheckpointHook(20, max_keep=None, save_last=False)]
    gan.build(tmp_path, hooks=hooks, epochs=EPOCHS).run()
    # a fresh process would do this: the same build, resumed from update 20 (mid-epoch 1)
    steps = []
    hooks = [lambda events: (steps.append(ev.state.step) or ev for ev in events)]
    resumed = gan.build(tmp_path, resume=tmp_path / "iter_20.pth", hooks=hooks, epochs=EPOCHS)
    assert_same(saved(resumed.run()), saved(straight))
    assert steps[:3] == [20, 20, 21], steps[:5]  # resumed at update 20, mid-epoch 1


def test_gan_resumes_bitwise_through_checkpoint_state_dicts():
    step = gan.make_step()
    data = list(gan.loader())
    straight = gan_state()
    torch.manual_seed(3)
    for batch in data:
        straight, _ = step(straight, batch)

    state = gan_state()
    torch.manual_seed(3)
    for batch in data[:5]:
        state, _ = step(state, batch)
    blob = ftrain.checkpoint.state_dict(state)  # with the RNG: the noise continues exactly
    assert sorted(blob["optimizers"]) == ["disc", "gen"] and "optimizer" not in blob
    torch.manual_seed(99)  # the load puts the saved RNG back
    restored = ftrain.checkpoint.load_state_dict(gan_state(), blob)
    assert restored.transforms["gen/amp"].__class__.__name__ == "Unloaded"  # restored lazily
    for batch in data[5:]:
        restored, _ = step(restored, batch)
    assert_same(saved(restored), saved(straight))


@pytest.mark.slow  # two subprocesses
def test_gan_sigint_mid_run_then_resume_is_bitwise(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import ftrain, gan
        g_loss = gan.g_loss
        def interrupting(model, batch, calls=[]):
            calls.append(1)
            if len(calls) == 27:  # Ctrl-C in the middle of round 27's generator step
                os.kill(os.getpid(), signal.SIGINT)
            return g_loss(model, batch)
        gan.g_loss = interrupting
        hooks = [ftrain.CheckpointHook(10), ftrain.hooks.AutoCheckpointHook()]
        gan.build({str(tmp_path)!r}, hooks=hooks, epochs={EPOCHS}).run()
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    # a script's Ctrl-C: exit 130 and one line, no traceback (issue 21 item 1)
    assert proc.returncode == 130 and "interrupted at update" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "interrupted.pth").is_file()
    blob = torch.load(tmp_path / "interrupted.pth", weights_only=False)
    assert blob["state"]["step"] == 27  # the interrupted round completed, then the save
    resumed = gan.build(tmp_path, hooks=[], epochs=EPOCHS).run()
    straight = gan.build(None, hooks=[], epochs=EPOCHS).run()
    assert_same(saved(resumed), saved(straight))


def test_gan_ema_of_the_generator_swaps_and_exports_only_its_part():
    state = gan.build(None, hooks=[], max_steps=6).run()
    avg = state.transforms["gen/ema"]
    assert set(avg.params) == {n for n, _ in state.model.named_parameters() if n.startswith("gen")}
    live = {k: v.clone() for k, v in state.model.state_dict().items()}
    with swap_ema(state, "gen") as model:
        for name, p in model.named_parameters():
            expected = avg.params[name] if name.startswith("gen") else live[name]
            assert torch.equal(p, expected), name
    assert_same(state.model.state_dict(), live)  # put back
    sd = ema_state_dict(state)  # the only average: no name needed
    assert sd.keys() == live.keys()
    assert torch.equal(sd["gen.0.weight"], avg.params["gen.0.weight"])
    assert torch.equal(sd["disc.0.weight"], live["disc.0.weight"])


# ------------------------------------------------- optimizers over subsets, one loss
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def subset_optimizers(net):
    return {
        "backbone": torch.optim.SGD(net.backbone.parameters(), lr=0.05, momentum=0.9),
        "head": torch.optim.AdamW(net.head.parameters(), lr=5e-3, weight_decay=0.01),
    }


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def batches(n=12):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(16, 8, generator=g), 3 * torch.randn(16, 4, generator=g)) for _ in range(n)
    ]


LR = ftrain.schedules.cosine(0.05, total=6)
ACCUM, MAX_NORM = 2, 0.5


def subset_step():
    step = ftrain.make_step(mse, optimizer=("backbone", "head"))
    step = ftrain.with_amp(step, "fp16", loss_scale={"init_scale": 2.0**20})
    step = ftrain.with_clip(step, "norm", max_norm=MAX_NORM)
    step = ftrain.with_schedule(step, lr=LR)
    return ftrain.with_grad_accum(step, every=ACCUM)


def hand_written_subsets(data):
    """One forward/backward per micro-batch, both optimizers step: one GradScaler (unscale_
    each, step each, one update), clipping over all the parameters, the lr ratio kept."""
    net = Net()
    opts = subset_optimizers(net)
    sgd, adamw = opts["backbone"], opts["head"]
    ratio = adamw.param_groups[0]["lr"] / sgd.param_groups[0]["lr"]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    params = [*net.backbone.parameters(), *net.head.parameters()]
    for i, batch in enumerate(data):
        u = i // ACCUM
        sgd.param_groups[0]["lr"] = LR(u)
        adamw.param_groups[0]["lr"] = LR(u) * ratio
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(net, batch)
        scaler.scale(loss / ACCUM).backward()
        if (i + 1) % ACCUM:
            continue
        scaler.unscale_(sgd)
        scaler.unscale_(adamw)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(sgd)
        scaler.step(adamw)
        scaler.update()
        sgd.zero_grad()
        adamw.zero_grad()
    return net, opts, scaler


def test_optimizers_over_parameter_subsets_with_one_loss_equal_the_hand_written_loop():
    data = batches()
    net = Net()
    state = ftrain.TrainState.create(net, subset_optimizers(net))
    step = subset_step()
    for batch in data:
        state, metrics = step(state, batch)
    ref, opts, scaler = hand_written_subsets(data)
    assert state.step == len(data) // ACCUM
    assert_same(state.model.state_dict(), ref.state_dict())
    for name, opt in opts.items():
        assert_same(state.optimizers[name].state_dict()["state"], opt.state_dict()["state"])
        assert state.optimizers[name].param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    amp = state.transforms["backbone+head/amp"]
    assert amp.scaler.state_dict() == scaler.state_dict()
    assert int(amp.skipped) >= 1  # init_scale 2**20 overflows fp16 at first


def test_subset_step_resumes_mid_window_bitwise():
    data = batches()
    step = subset_step()

    def fresh():
        net = Net()
        return ftrain.TrainState.create(net, subset_optimizers(net))

    straight = fresh()
    for batch in data:
        straight, _ = step(straight, batch)
    state = fresh()
    for batch in data[:5]:  # mid-window: the 5th micro-batch's gradients are pending
        state, _ = step(state, batch)
    assert step.pending(state) == 1
    blob = ftrain.checkpoint.state_dict(state)
    assert blob["grads"]  # the partial window's gradients are saved
    resumed = ftrain.checkpoint.load_state_dict(fresh(), blob)
    for batch in data[5:]:
        resumed, _ = step(resumed, batch)
    assert_same(saved(resumed), saved(straight))


@attrs.frozen
class RecordLRs(Transform):
    """Records each update's learning rates, after the LR finder wrote them (stage 1)."""

    seen: list = attrs.field(eq=False)
    name = "record_lrs"
    stage = 2

    def before_update(self, ctx):
        self.seen.append([g["lr"] for g in ctx.optimizer.param_groups])


def test_lr_find_on_a_step_over_several_optimizers_keeps_their_ratio():
    net = Net()
    state = ftrain.TrainState.create(net, subset_optimizers(net))
    seen = []
    step = ftrain.make_step(mse, optimizer=("backbone", "head")).with_transform(RecordLRs(seen))
    result = ftrain.lr_find(step, state, batches(), min_lr=1e-4, max_lr=1.0, num_training=8)
    assert len(result.lrs) == len(seen) >= 4 and state.step == 0  # the state is untouched
    for lr, (backbone, head) in zip(result.lrs, seen):
        assert backbone == lr and head == pytest.approx(lr * 5e-3 / 0.05, rel=1e-12)
    assert [g["lr"] for g in state.optimizers["head"].param_groups] == [5e-3]
    with pytest.raises(TypeError, match="one of the sequence's steps"):
        ftrain.lr_find(gan.make_step(), gan_state(), [None])


# ------------------------------------------------------- gradients kept apart
def test_a_bound_step_keeps_its_gradients_apart():
    model = gan.make_model()
    state = ftrain.TrainState.create(model, gan.make_optimizers(model))
    d = ftrain.with_grad_accum(ftrain.make_step(gan.d_loss, optimizer="disc"), every=2)
    g = ftrain.with_grad_accum(ftrain.make_step(gan.g_loss, optimizer="gen"), every=2)
    batch = next(iter(gan.loader()))
    state, _ = d(state, batch)  # disc: half a window
    d_grads = [p.grad.clone() for p in model["disc"].parameters()]
    assert all(p.grad is None for p in model["gen"].parameters())  # fake.detach(): none
    state, _ = g(state, batch)  # its backward reaches disc's parameters too
    for p, before in zip(model["disc"].parameters(), d_grads):
        assert torch.equal(p.grad, before)  # disc's window untouched by gen's backward
    # a window starts from clean gradients of its own parameters
    sequence = ftrain.make_step(gan.d_loss, optimizer="disc").then(
        ftrain.make_step(gan.g_loss, optimizer="gen")
    )
    clean, dirty = gan_state(), gan_state()
    for p in dirty.model.parameters():
        p.grad = torch.full_like(p, 1e3)  # stale gradients, e.g. of a manual backward
    torch.manual_seed(0)
    clean, _ = sequence(clean, batch)
    torch.manual_seed(0)
    dirty, _ = sequence(dirty, batch)
    assert_same(clean.model.state_dict(), dirty.model.state_dict())


def test_sequence_counts_one_round_and_flushes_pending_and_observes():
    plateau = ftrain.schedules.plateau("score", mode="max", patience=0, factor=0.5)
    d = ftrain.with_grad_accum(ftrain.make_step(gan.d_loss, optimizer="disc"), every=2)
    g = ftrain.with_schedule(
        ftrain.with_grad_accum(ftrain.make_step(gan.g_loss, optimizer="gen"), every=2),
        plateau=plateau,
    )
    seq = d.then(g)
    state = seq.init(gan_state())
    assert sorted(state.transforms) == ["disc/accum", "gen/accum", "gen/schedule"]
    batch = next(iter(gan.loader()))
    state, metrics = seq(state, batch)
    assert (state.step, state.micro_step, seq.pending(state)) == (0, 1, 1)
    assert sorted(metrics) == ["disc/loss", "gen/loss"]
    state, metrics = seq.flush(state)
    assert (state.step, state.micro_step, seq.pending(state)) == (1, 1, 0)
    state = seq.observe(state, {"score": 1.0})
    state = seq.observe(state, {"score": 0.5})  # worse: the generator's lr ceiling halves
    assert state.transforms["gen/schedule"].plateau.ceilings == (0.5e-3,)
    assert "disc:" in repr(seq) and "gen:" in repr(seq)


def test_loop_flushes_a_sequence_at_the_end_of_the_data():
    d = ftrain.with_grad_accum(ftrain.make_step(gan.d_loss, optimizer="disc"), every=3)
    g = ftrain.with_grad_accum(ftrain.make_step(gan.g_loss, optimizer="gen"), every=3)
    data = list(gan.loader())[:4]  # one window and a partial one
    state = ftrain.Loop(d.then(g), gan_state(), data, hooks=[], epochs=1).run()
    assert (state.step, state.micro_step) == (2, 4)
    assert all(p.grad is None for p in state.model.parameters())


@pytest.mark.slow  # compiles
def test_compiled_bound_steps_match_eager():
    import torch._inductor.config as inductor_config

    def run(compiled):
        d = ftrain.with_clip(ftrain.make_step(gan.d_loss, optimizer="disc"), "norm", max_norm=1.0)
        g = ftrain.with_clip(ftrain.make_step(gan.g_loss, optimizer="gen"), "norm", max_norm=5.0)
        net = Net()
        sub = ftrain.TrainState.create(net, subset_optimizers(net))
        both = ftrain.make_step(mse, optimizer=("backbone", "head"))
        if compiled:
            d, g, both = (ftrain.with_compile(s) for s in (d, g, both))
        state, seq = gan_state(), d.then(g)
        torch.manual_seed(0)
        for batch in list(gan.loader())[:3]:
            state, _ = seq(state, batch)
        for batch in batches(3):
            sub, _ = both(sub, batch)
        return saved(state), saved(sub)

    eager = run(False)
    # every bound optimizer's rule is traced, a group's members each: no eager fallback
    with inductor_config.patch(fallback_random=True), warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        compiled = run(True)
    for a, b in zip(eager, compiled):
        fa, fb = flat(a["model"]), flat(b["model"])
        for k in fa:
            torch.testing.assert_close(fa[k], fb[k], rtol=1e-5, atol=1e-6, msg=k)


# ------------------------------------------------------------------ bad input
def test_overlapping_optimizers_are_refused_naming_both_and_the_parameter():
    net = Net()
    with pytest.raises(ValueError, match=r"'all' and 'head' both hold the parameter 'head.weight'"):
        ftrain.TrainState.create(net, {
            "all": torch.optim.SGD(net.parameters(), lr=0.1),
            "head": torch.optim.SGD(net.head.parameters(), lr=0.1),
        })  # fmt: skip
    with pytest.raises(ValueError, match="without '/' or '\\+'"):
        ftrain.TrainState.create(net, {"a/b": torch.optim.SGD(net.parameters(), lr=0.1)})
    with pytest.raises(TypeError, match="optimizer 'x' must be a torch.optim.Optimizer"):
        ftrain.TrainState.create(net, {"x": net.parameters()})
    with pytest.raises(TypeError, match="non-empty dict"):
        ftrain.TrainState.create(net, {})


def test_reading_the_single_optimizer_of_a_multi_optimizer_state_names_the_fix():
    state = gan_state()
    with pytest.raises(AttributeError, match=r"several optimizers.*state.optimizers\['gen'\]"):
        state.optimizer  # noqa: B018
    single = ftrain.TrainState.create(net := Net(), torch.optim.SGD(net.parameters(), lr=0.1))
    assert dict(single.optimizers) == {}
    assert "optimizers={gen: Adam(lr=0.001, 1 group), disc: Adam(" in repr(state)


def test_steps_bound_to_unknown_or_missing_optimizers_are_refused():
    batch = next(iter(gan.loader()))
    with pytest.raises(KeyError, match=r"\['discriminator'\] that the state does not hold"):
        ftrain.make_step(gan.d_loss, optimizer="discriminator")(gan_state(), batch)
    with pytest.raises(AttributeError, match="make_step\\(loss_fn, optimizer='gen'\\)"):
        ftrain.make_step(gan.d_loss)(gan_state(), batch)  # not bound, on several
    with pytest.raises(AttributeError, match="make_step\\(loss_fn, optimizer='gen'\\)"):
        ftrain.with_clip(ftrain.make_step(gan.d_loss), "norm", max_norm=1.0)(gan_state(), batch)
    single = ftrain.TrainState.create(net := Net(), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="created with one optimizer, not by name"):
        ftrain.make_step(mse, optimizer="head")(single, batches(1)[0])
    with pytest.raises(ValueError, match="distinct names"):
        ftrain.make_step(mse, optimizer=("head", "head"))


def test_a_sequence_refuses_an_optimizer_twice_unbound_steps_and_uneven_windows():
    d = ftrain.make_step(gan.d_loss, optimizer="disc")
    with pytest.raises(ValueError, match="optimizer 'disc' is updated by two steps"):
        d.then(ftrain.make_step(gan.g_loss, optimizer="disc"))
    with pytest.raises(ValueError, match="every step of a sequence is bound"):
        d.then(ftrain.make_step(gan.g_loss))
    g2 = ftrain.with_grad_accum(ftrain.make_step(gan.g_loss, optimizer="gen"), every=2)
    with pytest.raises(ValueError, match="different windows"):
        d.then(g2)
    seq = d.then(ftrain.make_step(gan.g_loss, optimizer="gen"))
    with pytest.raises(TypeError, match="compose .* on the step\\(s\\) it applies to"):
        ftrain.with_amp(seq, "bf16")


def test_checkpoints_of_other_optimizers_are_refused_before_loading():
    blob = ftrain.checkpoint.state_dict(gan_state())
    single = ftrain.TrainState.create(net := Net(), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(
        CheckpointError, match=r"optimizers \['disc', 'gen'\], and this run's state holds one"
    ):
        ftrain.checkpoint.load_state_dict(single, blob)
    renamed = {**blob, "optimizer_classes": {"d": "Adam", "gen": "Adam"}}
    with pytest.raises(
        CheckpointError, match=r"\['d', 'gen'\], and this run's state holds \['disc', 'gen'\]"
    ):
        ftrain.checkpoint.load_state_dict(gan_state(), renamed)
    with pytest.raises(CheckpointError, match="written with one optimizer"):
        ftrain.checkpoint.load_state_dict(gan_state(), ftrain.checkpoint.state_dict(single))
    # a one-optimizer checkpoint keeps its format
    assert {"optimizer", "optimizer_class"} <= ftrain.checkpoint.state_dict(single).keys()
    assert "optimizers" not in ftrain.checkpoint.state_dict(single)


# ------------------------------------------------- the migration guide's rows
def clipped_gan_sequence():
    d = ftrain.with_clip(
        ftrain.make_step(gan.d_loss, optimizer="disc"), "norm", max_norm=gan.CLIP_D
    )
    g = ftrain.with_clip(ftrain.make_step(gan.g_loss, optimizer="gen"), "norm", max_norm=gan.CLIP_G)
    return d.then(g)


def ftrain_rounds(data, seed_of):
    state, step = gan_state(), clipped_gan_sequence()
    for i, batch in enumerate(data):
        torch.manual_seed(seed_of(i))
        state, _ = step(state, batch)
    return state


def assert_trained_alike(state, model, optimizers):
    assert_same(state.model.state_dict(), model.state_dict())
    for name, opt in optimizers.items():
        assert_same(state.optimizers[name].state_dict()["state"], opt.state_dict()["state"])


def test_mmengine_optim_wrapper_dict_trains_as_the_sequence():
    pytest.importorskip("mmengine", reason="the MMEngine reference needs the extra")
    from mmengine.optim import OptimWrapper, OptimWrapperDict

    data = list(gan.loader())[:8]
    model = gan.make_model()
    opts = gan.make_optimizers(model)
    wrappers = OptimWrapperDict(
        disc=OptimWrapper(opts["disc"], clip_grad=dict(max_norm=gan.CLIP_D)),
        gen=OptimWrapper(opts["gen"], clip_grad=dict(max_norm=gan.CLIP_G)),
    )
    with pytest.raises(NotImplementedError):  # the dict does not update: each wrapper does
        wrappers.update_params(torch.zeros((), requires_grad=True))
    for i, batch in enumerate(data):  # an mmagic-style train_step
        torch.manual_seed(100 + i)
        with wrappers["disc"].optim_context(model["disc"]):
            wrappers["disc"].update_params(gan.d_loss(model, batch))
        model["disc"].requires_grad_(False)  # mmagic's set_requires_grad(discriminator, False)
        with wrappers["gen"].optim_context(model["gen"]):
            wrappers["gen"].update_params(gan.g_loss(model, batch))
        model["disc"].requires_grad_(True)
    assert_trained_alike(ftrain_rounds(data, lambda i: 100 + i), model, opts)


def test_lightning_manual_optimization_trains_as_the_sequence():
    L = pytest.importorskip("lightning", reason="the Lightning reference needs the extra")

    class LitGAN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.gan = gan.make_model()

        def configure_optimizers(self):
            opts = gan.make_optimizers(self.gan)
            return [opts["disc"], opts["gen"]]

        def training_step(self, batch, batch_idx):
            torch.manual_seed(100 + batch_idx)
            for opt, loss_fn, clip in zip(
                self.optimizers(), (gan.d_loss, gan.g_loss), (gan.CLIP_D, gan.CLIP_G)
            ):
                self.toggle_optimizer(opt)
                loss = loss_fn(self.gan, batch)
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
                opt.step()
                self.untoggle_optimizer(opt)

    data = list(gan.loader())[:8]
    lit = LitGAN()
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    opts = dict(zip(("disc", "gen"), (o.optimizer for o in lit.optimizers())))
    assert_trained_alike(ftrain_rounds(data, lambda i: 100 + i), lit.gan, opts)


def test_docs_page_runs(tmp_path, monkeypatch):
    import re

    page = ROOT / "docs" / "multi_optimizer.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/multi_optimizer.md block {i + 1}", "exec"), namespace)  # noqa: S102
    assert namespace["state"].step == 20 and namespace["both"].step == 2


@pytest.mark.parametrize(
    "module",
    ["ftrain.state", "ftrain.step", "ftrain.binding", "ftrain.sequence", "ftrain.optim.group",
     "ftrain.persist.state", "ftrain.transforms.schedule"],
)  # fmt: skip
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def accumulating_gan(every=2, interrupt_at=None):
    calls = []

    def g_loss(model, batch):
        calls.append(1)
        if len(calls) == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C inside a micro-batch
        return gan.g_loss(model, batch)

    d = ftrain.with_grad_accum(ftrain.make_step(gan.d_loss, optimizer="disc"), every=every)
    d = ftrain.with_amp(ftrain.with_clip(d, "norm", max_norm=gan.CLIP_D), "fp16")
    g = ftrain.with_grad_accum(ftrain.make_step(g_loss, optimizer="gen"), every=every)
    g = ftrain.with_ema(ftrain.with_amp(g, "fp16"), decay=gan.EMA_DECAY)
    return d.then(g)


def test_sequence_resumes_mid_window_through_the_loop(tmp_path):
    def loop(step, work_dir=None, hooks=()):
        return ftrain.Loop(step, gan_state(), gan.loader(), list(hooks), epochs=2,
                           work_dir=work_dir, resume="auto" if work_dir else None)  # fmt: skip

    straight = loop(accumulating_gan()).run()
    interrupted = loop(
        accumulating_gan(interrupt_at=21), tmp_path, [ftrain.hooks.AutoCheckpointHook()]
    )
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    blob = torch.load(tmp_path / "interrupted.pth", weights_only=False)
    assert blob["state"]["micro_step"] == 21 and blob["state"]["step"] == 10  # mid-window
    assert blob["state"]["transforms"]["disc/accum"]["pending"] == 1 and blob["state"]["grads"]
    resumed = loop(accumulating_gan(), tmp_path).run()
    assert_same(saved(resumed), saved(straight))


def test_a_nonfinite_loss_skips_only_its_own_step():
    d = ftrain.make_step(gan.d_loss, optimizer="disc")
    poisoned = []

    def g_loss(model, batch):
        loss = gan.g_loss(model, batch)
        return loss * float("nan") if poisoned else loss

    g = ftrain.with_nonfinite_check(ftrain.make_step(g_loss, optimizer="gen"), "skip")
    seq, state = d.then(g), gan_state()
    batch = next(iter(gan.loader()))
    state, _ = seq(state, batch)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    poisoned.append(1)
    state, metrics = seq(state, batch)
    assert bool(metrics["gen/skipped"]) and state.step == 2
    after = state.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("gen."))
    assert not torch.equal(after["disc.0.weight"], before["disc.0.weight"])  # disc trained
    assert state.transforms["gen/nonfinite"].skipped == 1


def test_default_hooks_log_each_optimizers_lr_and_config(tmp_path: Path) -> None:
    """A GAN run with the default hooks (TensorBoard and JSONL on): each optimizer's lr is
    logged under its name, and the config table names both optimizers."""
    import orjson

    hooks = ftrain.default_hooks(log_every=2, checkpoint_every=100, progress=False)
    run = gan.build(str(tmp_path), hooks=hooks, max_steps=4)
    run.run()
    lrs = {n: o.param_groups[0]["lr"] for n, o in run.state.optimizers.items()}
    rows = [orjson.loads(line) for line in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    train = [r for r in rows if "lr/gen" in r]
    assert [r["step"] for r in train] == [2, 4]
    assert (train[-1]["lr/gen"], train[-1]["lr/disc"]) == (lrs["gen"], lrs["disc"])
    assert lrs["gen"] != lrs["disc"]  # the generator's warm-up: the names are not swapped
    assert not any("lr" in r for r in rows)  # no single "lr" that names one of them
    cfg = ftrain.hooks.sinks.base.run_config(gan.build(None, max_steps=1))
    assert cfg["optimizer.gen"] == "Adam" and cfg["optimizer.disc.lr"] == 1e-3
    assert any(p.name.startswith("events.out") for p in (tmp_path / "tb").rglob("*"))


def test_a_param_group_added_to_a_bound_optimizer_is_trained_like_torch():
    """Progressive unfreezing: ``state.optimizers["b"].add_param_group(...)`` after a bound
    step ran; that step then trains the new parameters, as a hand-written torch loop does
    (the binding was cached with the parameters it had)."""
    import copy

    def build():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3),
                                     "c": torch.nn.Linear(3, 1)})  # fmt: skip
        return model, {"a": torch.optim.SGD(model["a"].parameters(), lr=0.1),
                       "b": torch.optim.SGD(model["b"].parameters(), lr=0.1)}  # fmt: skip

    def loss(m, x):
        return m["c"](m["b"](m["a"](x))).pow(2).mean()

    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model, opts = build()
    ref_model, ref_opts = copy.deepcopy(model), None
    ref_opts = {"b": torch.optim.SGD(ref_model["b"].parameters(), lr=0.1)}
    state = ftrain.TrainState.create(model, opts)
    step = ftrain.make_step(loss, optimizer="b")
    for i, x in enumerate(xs):
        if i == 2:  # unfreeze the head into b's optimizer, in both runs
            state.optimizers["b"].add_param_group({"params": model["c"].parameters()})
            ref_opts["b"].add_param_group({"params": ref_model["c"].parameters()})
        state, _ = step(state, x)
        ref_model.zero_grad(set_to_none=True)
        loss(ref_model, x).backward()
        ref_opts["b"].step()
    for name, p in ref_model.named_parameters():
        assert torch.equal(p, dict(state.model.named_parameters())[name]), name
    assert not torch.equal(ref_model["c"].weight, build()[0]["c"].weight)  # c did train


def test_a_sequence_left_out_of_step_by_a_failure_is_refused_until_flushed():
    """d then g, each accumulating 2; g fails on the 2nd batch after d counted it: the next
    call is refused naming both windows (they would update on alternate rounds); flush()
    applies them and the sequence runs in step again."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"d": torch.nn.Linear(2, 1), "g": torch.nn.Linear(2, 1)})
    opts = {n: torch.optim.SGD(model[n].parameters(), lr=0.1) for n in ("d", "g")}
    state = ftrain.TrainState.create(model, opts)
    fail = [False]

    def g_loss(m, x):
        if fail[0]:
            raise RuntimeError("a bad batch")
        return m["g"](x).pow(2).mean()

    d = ftrain.with_grad_accum(ftrain.make_step(lambda m, x: m["d"](x).pow(2).mean(),
                                                optimizer="d"), every=2)  # fmt: skip
    g = ftrain.with_grad_accum(ftrain.make_step(g_loss, optimizer="g"), every=2)
    seq = d.then(g)
    x = torch.ones(4, 2)
    state, _ = seq(state, x)
    fail[0] = True
    with pytest.raises(RuntimeError, match="a bad batch"):
        seq(state, x)
    fail[0] = False
    state = state.latest()
    with pytest.raises(ValueError, match=r"different partial accumulation windows \(d 0, g 1"):
        seq(state, x)
    state, _ = seq.flush(state)
    assert (d.pending(state), g.pending(state)) == (0, 0)
    state, _ = seq(state, x)
    assert (d.pending(state), g.pending(state)) == (1, 1)
