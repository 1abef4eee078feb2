"""Issue 13 in one process: the logic behind the 2-process and GPU tests.

Device functions are faked only where no CPU equivalent exists (a CUDA
device count, an FSDP2 mesh on CUDA, overflow flags on two GPUs).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import dist
from ftrain._slurm import SLURM_PORT_BASE, first_host, slurm_env
from ftrain.transforms import amp as amp_mod


# ----------------------------------------------------------- summed losses
def _padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        mask = torch.zeros(6, dtype=torch.bool)
        mask[:n] = True
        out.append((x, y, mask))
    return out


def _summed(model, batch):
    x, y, mask = batch
    return ftrain.SummedLoss((model(x) - y).pow(2).mean(-1)[mask].sum(), mask.sum())


@pytest.mark.parametrize("every", [1, 3])
def test_summed_loss_update_is_the_token_mean_of_the_window(every):
    """SummedLoss(loss_sum, n_tokens) over unequal micro-batches = one full-batch token mean."""
    lengths = [1, 6, 2, 5, 3, 4]
    batches = _padded(lengths)
    base = make_model(0)
    step = ftrain.make_step(_summed)
    if every > 1:
        step = ftrain.with_grad_accum(step, every=every)
    model = copy.deepcopy(base)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(0, len(batches), every):
        window = batches[i : i + every]
        xs = torch.cat([x[mask] for x, _, mask in window])
        ys = torch.cat([y[mask] for _, y, mask in window])
        (ref(xs) - ys).pow(2).mean(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(ref.parameters(), state.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert m["loss_count"] == lengths[-1] and torch.isclose(m["loss"], m["loss_sum"] / 4)


def test_summed_loss_partial_window_and_metrics_and_mixed_forms():
    batches = _padded([2, 5, 1])
    base = make_model(0)
    model = copy.deepcopy(base)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = ftrain.with_grad_accum(ftrain.make_step(_summed), every=4)
    for b in batches:
        state, _ = step(state, b)
    state, _ = step.flush(state)  # 3 of 4 micro-batches: still the mean over their 8 tokens
    ref = copy.deepcopy(base)
    xs = torch.cat([x[m] for x, _, m in batches])
    ys = torch.cat([y[m] for _, y, m in batches])
    (ref(xs) - ys).pow(2).mean(-1).mean().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for p, q in zip(ref.parameters(), state.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)

    # one form per window
    def mixed(model, batch):
        return _summed(model, batch) if len(batch) == 3 else mse_loss(model, batch)

    step = ftrain.with_grad_accum(ftrain.make_step(mixed), every=4)
    state, _ = step(state, batches[0])
    with pytest.raises(TypeError, match="same form"):
        step(state, (batches[1][0], batches[1][1]))
    # the step checks SummedLoss's fields
    step = ftrain.make_step(lambda m, b: ftrain.SummedLoss(mse_loss(m, b), torch.ones(3)))
    with pytest.raises(TypeError, match="count must be a number or a 0-d tensor"):
        step(state, make_batches(1)[0])
    step = ftrain.make_step(lambda m, b: ftrain.SummedLoss(mse_loss(m, b), 3, 4))
    with pytest.raises(TypeError, match="metrics must be a dict"):
        step(state, make_batches(1)[0])


@pytest.mark.parametrize(
    "form", ["loss_acc", "loss_acc_tensor", "loss_count_metrics", "three_numbers"]
)
def test_a_plain_tuple_with_a_number_is_refused_and_names_summed_loss(form):
    """(loss, acc) was a user mistake before summed losses: it must not divide the gradient."""
    model = make_model(0)
    s = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]

    def loss_fn(m, b):
        loss = mse_loss(m, b)
        acc = torch.tensor(0.25)
        return {
            "loss_acc": (loss, 0.25),
            "loss_acc_tensor": (loss, acc),
            "loss_count_metrics": (loss, 4, {"acc": acc}),
            "three_numbers": (loss, 3, 4),
        }[form]

    for step in (ftrain.make_step(loss_fn), ftrain.with_grad_accum(ftrain.make_step(loss_fn), 2)):
        with pytest.raises(TypeError, match=r"ambiguous.*ftrain\.SummedLoss\(loss_sum, count\)"):
            step(s, make_batches(1)[0])
    # nothing was applied, the state is still usable
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    s, _ = ftrain.make_step(mse_loss)(s, make_batches(1)[0])
    assert s.step == 1


def test_summed_loss_metrics_are_reported_with_the_mean():
    model = make_model(0)
    s = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y, mask = _padded([3])[0]

    def loss_fn(m, b):
        out = _summed(m, b)
        return ftrain.SummedLoss(out.total, out.count, {"n": out.count.float()})

    s, metrics = ftrain.make_step(loss_fn)(s, (x, y, mask))
    with torch.no_grad():
        expected = (model(x[mask]) - y[mask]).pow(2).mean()
    assert float(metrics["n"]) == 3 and float(metrics["loss_count"]) == 3
    torch.testing.assert_close(metrics["loss"], expected)


def test_logger_logs_the_token_weighted_loss(tmp_path):
    import json

    batches = _padded([1, 6, 2, 5])
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step = ftrain.with_grad_accum(ftrain.make_step(_summed), every=4)
    ftrain.Loop(
        step,
        state,
        batches,
        hooks=[ftrain.LoggerHook(every=1, progress=False, console=False)],
        work_dir=tmp_path,
    ).run()
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    logged = [r["loss"] for r in rec if "loss" in r]
    xs = torch.cat([x[m] for x, _, m in batches])
    ys = torch.cat([y[m] for _, y, m in batches])
    with torch.no_grad():
        expected = float((model(xs) - ys).pow(2).mean(-1).mean())
    assert logged == [pytest.approx(expected, rel=1e-6)]
    assert not any("loss_sum" in r or "loss_count" in r for r in rec)


def test_summed_loss_makes_no_host_sync(monkeypatch):
    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_grad_accum(ftrain.make_step(_summed), every=2)
    batches = _padded([3, 4, 5, 6, 1])
    state, _ = step(state, batches[0])

    def boom(*a, **k):
        raise AssertionError("host synchronisation in the hot path")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for b in batches[1:]:
        state, metrics = step(state, b)
    monkeypatch.undo()
    assert state.step == 2


# ----------------------------------------------------------- non-finite
def _sqrt_at_zero(model, batch):
    out = model(batch[0])
    return mse_loss(model, batch) + (out - out.detach()).sqrt().sum()


def test_a_finite_loss_with_an_infinite_gradient_is_caught():
    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    step = ftrain.with_nonfinite_check(ftrain.make_step(_sqrt_at_zero), "skip")
    state, m = step(state, make_batches(1)[0])
    assert torch.isfinite(m["loss"]) and bool(m["skipped"])
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    # with clipping the check reuses its norm (and says so)
    step = ftrain.with_clip(
        ftrain.with_nonfinite_check(ftrain.make_step(_sqrt_at_zero)), max_norm=1
    )
    with pytest.raises(FloatingPointError, match="gradient became non-finite.*grad_norm") as info:
        step(state, make_batches(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(before, info.value.state.model.parameters()))


def test_nonfinite_check_reuses_the_clip_norm(monkeypatch):
    """With with_clip the gradient is not scanned a second time."""
    from ftrain.transforms import nonfinite

    calls = []
    monkeypatch.setattr(nonfinite, "_nonfinite", lambda *a: calls.append(a) or torch.zeros(()))
    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_nonfinite_check(ftrain.make_step(mse_loss))
    state, _ = step(state, make_batches(1)[0])
    assert len(calls) == 1
    step = ftrain.with_clip(step, max_norm=1.0)
    state, _ = step(state, make_batches(1)[0])
    assert len(calls) == 1


def test_fp16_scaler_still_owns_gradient_overflow():
    """A gradient overflow under a loss scaler is the scaler's (skipped, scale backed off)."""
    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_nonfinite_check(
        ftrain.with_amp(ftrain.make_step(_sqrt_at_zero), "fp16", loss_scale={"init_scale": 8.0})
    )
    state, m = step(state, make_batches(1)[0])  # no raise: an overflow, skipped
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 4.0


# ------------------------------------------------------------------- AMP
def test_autocast_device_is_where_compute_runs():
    """FSDP2 with CPU offload: parameters on the CPU, the mesh (compute) on CUDA."""

    class OffloadedParam(torch.nn.Parameter):
        device_mesh = types.SimpleNamespace(device_type="cuda")

    model = torch.nn.Linear(2, 1)
    model.weight = OffloadedParam(model.weight.detach())
    assert amp_mod._device_type(model) == "cuda"
    assert amp_mod._device_type(torch.nn.Linear(2, 1)) == "cpu"
    step = ftrain.with_amp(ftrain.make_step(mse_loss), "bf16")
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.init(state).transforms["amp"].device_type == "cuda"


def test_overflow_flags_of_several_devices_are_moved_before_summing():
    class Flag:
        """A flag on another device: adding it to a tensor elsewhere fails, as CUDA does."""

        def __init__(self, value):
            self.value = value
            self.moved_to = None

        def to(self, device, non_blocking=False):
            self.moved_to = torch.device(device)
            return torch.tensor(self.value, device=device)

        def __radd__(self, other):
            raise RuntimeError("Expected all tensors to be on the same device")

        __add__ = __radd__

    flags = {torch.device("cpu"): torch.tensor(0.0), "cuda:1": Flag(1.0)}
    total = amp_mod._found_inf(flags, torch.device("cpu"))
    assert float(total) == 1.0 and flags["cuda:1"].moved_to == torch.device("cpu")


# ------------------------------------------------------------------ Slurm
def test_srun_environment_is_translated():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08,11],cpu1",
        "SLURM_NODELIST": "other",
        "SLURM_JOB_ID": "123456",
        "SLURM_NTASKS_PER_NODE": "4",
    }
    got = slurm_env(env)
    assert got == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(SLURM_PORT_BASE + 123456 % 20000),
    }
    # the user's MASTER_* win; a one-task step (or a batch script) is one process
    assert "MASTER_ADDR" not in slurm_env({**env, "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert slurm_env({**env, "SLURM_NTASKS": "1"}) is None
    assert slurm_env({}) is None
    for nodes, first in [("n1,n2", "n1"), ("a[3]", "a3"), ("r[2-3]-gpu", "r2-gpu"), ("x", "x")]:
        assert first_host(nodes) == first
    with pytest.raises(RuntimeError, match="SLURM_LOCALID.*torchrun"):
        slurm_env({k: v for k, v in env.items() if k != "SLURM_LOCALID"})
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        slurm_env({**env, "SLURM_STEP_NODELIST": "bad[1-"})


def test_more_local_ranks_than_gpus_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert dist._cuda_device(1, 2) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="3 processes on this machine.*2 visible CUDA"):
        dist._cuda_device(1, 3)
    with pytest.raises(RuntimeError, match="local rank 2"):
        dist._cuda_device(2, None)


# ------------------------------------------------------------- evaluation
def test_eval_hook_reduce_option():
    with pytest.raises(ValueError, match="reduce must be"):
        ftrain.EvalHook(lambda s: {}, reduce="median")
    ev = ftrain.EvalHook(lambda s: {"acc": torch.tensor(0.5), "names": ["a"]}, reduce="max")
    model = make_model()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert ev.evaluate(state) == {"acc": 0.5, "names": ["a"]}  # one process: unchanged


# ----------------------------------------------------------- meta device
def test_wrap_materialises_a_meta_model_in_one_process():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    seen = []

    def init(m):
        seen.append(m)
        for p in m.parameters():
            p.fill_(1.0)

    model = dist.wrap(model, "fsdp2", init=init)
    assert seen == [model] and model[0].weight.device.type == "cpu"
    assert torch.equal(model[0].weight, torch.ones(8, 4))
    with torch.device("meta"):
        model = torch.nn.Linear(4, 8)
    model = dist.wrap(model, "ddp")  # reset_parameters()
    assert model.weight.is_cpu and float(model.weight.detach().abs().sum()) > 0


# ------------------------------------------------- dynamic planner, CUDA path
def _fake_cuda_counters(monkeypatch) -> tuple[dict, list, list]:
    """torch.cuda's memory counters from a dict: ``level`` (allocated and reserved) and
    ``peak``; the devices asked about and the resets are recorded."""
    fake = {"level": 100.0, "peak": 10_000.0}
    devices, resets = [], []

    def allocated(device=None):
        devices.append(device)
        return fake["level"]

    def peak(device=None):
        devices.append(device)
        return fake["peak"]

    def reset(device=None):
        resets.append(device)
        fake["peak"] = fake["level"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: fake["level"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: fake["level"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake, devices, resets


def test_dynamic_planner_cuda_measurement_with_faked_allocator(monkeypatch):
    """measure="cuda": baseline after the first update, peak over forward+backward only,
    read on the model's device; CUDA's peak counter reset per warm-up sample (issue 20),
    the process-wide peak kept by ftrain (allocator faked)."""
    from ftrain.memory import cuda_peak, dynamic, modules

    fake, devices, resets = _fake_cuda_counters(monkeypatch)

    def loss_fn(model, batch):
        fake["level"] = 600.0  # activations appear
        loss = mse_loss(model, batch)
        fake["level"] = 700.0  # the forward's end: every activation alive
        return loss

    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def after_optimizer_step(*args):
        fake["level"] = 300.0  # weights + Adam's moments: the new baseline
        fake["peak"] = 50_000.0  # a transient of the optimizer step: not activations

    opt.register_step_post_hook(after_optimizer_step)
    plan = dynamic(
        1e9, warmup_iters=2, candidates=modules(["fc1"]), measure="cuda", warmup_checkpoint=False
    )
    step = ftrain.with_activation_checkpoint(ftrain.make_step(loss_fn), plan)
    state = ftrain.TrainState.create(model, opt)
    for b in make_batches(3):
        fake["level"] = max(fake["level"], 100.0)
        state, _ = step(state, b)
    planner = state.transforms["activation_checkpoint"].planner
    # each sample: the peak of its forward+backward above the level before it
    assert [s["memory"] for s in planner.samples] == [600.0, 400.0]
    assert planner.baseline == 300.0 and planner.pending is None and planner.fitted
    assert set(devices) == {torch.device("cuda", 0)}
    assert resets == [torch.device("cuda", 0)] * 2  # one per warm-up sample, its device
    assert cuda_peak.max_memory_allocated(0) == 50_000  # the optimizer's transient, kept
    cuda_peak.clear_peaks(0)


# ------------------------------------------------------------ torch version
def test_declared_torch_minimum_covers_the_api_used_and_ci_keeps_the_pin():
    """pyproject says torch>=2.6 (public fully_shard, get_total_norm, clip_grads_with_norm_,
    torch.accelerator); the docs say the same; CI still installs the pinned 2.13.0."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    deps = (root / "pyproject.toml").read_text()
    (minimum,) = re.findall(r'"torch>=([0-9.]+)"', deps)
    assert tuple(int(x) for x in minimum.split(".")) >= (2, 6)
    for doc in ("README.md", "docs/index.md", "docs/getting-started.md"):
        text = (root / doc).read_text()
        found = re.findall(r"torch ?>= ?([0-9.]+)", text)
        assert found and set(found) == {minimum}, doc
    assert "pip install torch==2.13.0" in (root / ".ci" / "run").read_text()
    # the APIs that set the minimum exist in the torch under test
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    assert callable(torch.nn.utils.get_total_norm) and callable(
        torch.nn.utils.clip_grads_with_norm_
    )


def test_summed_loss_doctests():
    import doctest

    import ftrain.loss

    result = doctest.testmod(ftrain.loss, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 3
