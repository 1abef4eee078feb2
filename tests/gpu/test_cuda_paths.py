"""CUDA code paths (skipped without CUDA; benchmarks/gpu_check.sh runs them).

The CPU suite checks the same logic with the device functions faked
(tests/test_agree_single.py) and the distributed rules on gloo
(tests/test_dist.py); these run the real thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
CHECK = Path(__file__).parent / "nccl_check.py"


def _cuda(batch, device="cuda"):
    return tuple(t.to(device) for t in batch)


def _torchrun(mode: str, out: Path, nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(CHECK), mode, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(nproc)]


# ------------------------------------------------------------------- autocast
def test_autocast_runs_on_the_cuda_device():
    model = make_model(0).cuda()
    seen = []

    def loss_fn(m, b):
        out = m(b[0])
        seen.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), b[1])

    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_amp(ftrain.make_step(loss_fn), "bf16")
    state, m = step(state, _cuda(make_batches(1)[0]))
    assert state.transforms["amp"].device_type == "cuda" and seen == [torch.bfloat16]
    step = ftrain.with_amp(ftrain.make_step(loss_fn), "fp16")
    state, m = step(state, _cuda(make_batches(1)[0]))
    assert seen[-1] == torch.float16 and float(m["loss_scale"]) > 0


def test_fsdp2_with_cpu_offload_gets_cuda_autocast(tmp_path):
    (res,) = _torchrun("offload", tmp_path, 1)
    assert res["param_device"] == "cpu" and res["amp_device"] == "cuda"
    assert all(res["cuda_autocast"])


# ------------------------------------------------------- fp16, several devices
class TwoGPUs(torch.nn.Module):
    """A model split over cuda:0 and cuda:1, with a probe whose gradient is ``s``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16).to("cuda:0")
        self.b = torch.nn.Linear(16, 4).to("cuda:1")
        self.probe = torch.nn.Parameter(torch.zeros(4, device="cuda:1"))

    def forward(self, x, s):
        h = torch.relu(self.a(x.to("cuda:0")))
        return self.b(h.to("cuda:1")), (self.probe * s.to("cuda:1")).sum()


@two_gpus
def test_fp16_overflow_of_a_model_over_two_gpus_is_skipped():
    torch.manual_seed(0)
    model = TwoGPUs()

    def loss_fn(m, batch):
        x, y, s = batch
        out, extra = m(x, s)
        return torch.nn.functional.mse_loss(out.float(), y.to("cuda:1")) + extra

    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))
    step = ftrain.with_amp(ftrain.make_step(loss_fn), "fp16", loss_scale={"init_scale": 256.0})
    skipped, scales = [], []
    for i, (x, y) in enumerate(make_batches(3)):
        s = torch.zeros(4)
        if i == 1:
            s[0] = 3e38  # overflows on cuda:1 only
        before = [p.detach().clone() for p in model.parameters()]
        state, m = step(state, (x, y, s))
        skipped.append(bool(m["skipped"]))
        scales.append(float(m["loss_scale"]))
        if i == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert skipped == [False, True, False] and scales == [256.0, 128.0, 128.0]
    assert int(state.transforms["amp"].skipped) == 1


# ------------------------------------------------------ dynamic planner, CUDA
def _planner_run(device: str):
    from ftrain.memory import dynamic, modules

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = dynamic(2**40, warmup_iters=2, candidates=modules(["0", "2"]), measure="cuda")
    step = ftrain.with_activation_checkpoint(ftrain.make_step(mse_loss), plan)
    state = ftrain.TrainState.create(model, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(512, 256, generator=g), torch.randn(512, 256, generator=g)
        state, _ = step(state, (x.to(device), y.to(device)))
    torch.cuda.synchronize()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return state.transforms["activation_checkpoint"].planner, param_bytes


def test_dynamic_planner_cuda_measurement_keeps_the_users_peak():
    from ftrain.hooks.monitor import memory_stats
    from ftrain.memory import cuda_peak

    torch.cuda.synchronize()
    cuda_peak.clear_peaks()
    big = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # the user's peak
    del big
    user_peak = torch.cuda.max_memory_allocated()
    planner, param_bytes = _planner_run("cuda")
    # issue 20: each warm-up sample resets CUDA's counter (its own peak, not the user's);
    # ftrain keeps the maximum, and the logger reports it
    assert torch.cuda.max_memory_allocated() < user_peak
    assert cuda_peak.max_memory_allocated() >= user_peak
    assert memory_stats("cuda")["memory/max_allocated_mib"] >= user_peak / 2**20
    # the baseline includes AdamW's two moments (created by the first update)
    assert planner.baseline >= 3 * param_bytes
    activations = 512 * 1024 * 4  # at least the hidden layer's output, float32
    assert planner.fitted and len(planner.samples) == 2
    assert all(activations <= s["memory"] < user_peak for s in planner.samples)


@two_gpus
def test_dynamic_planner_reads_the_models_device():
    torch.cuda.set_device(0)
    planner, _ = _planner_run("cuda:1")  # the current device (cuda:0) holds nothing
    activations = 512 * 1024 * 4
    assert all(s["memory"] >= activations for s in planner.samples)


# ------------------------------------------------------------------ CUDA RNG
def test_cuda_dropout_resumes_exactly(tmp_path):
    """A checkpoint restores the CUDA generator: dropout masks continue identically."""

    def run(work_dir, epochs, resume):
        torch.manual_seed(0)
        model = make_model(0, dropout=0.5).cuda()
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = [_cuda(b) for b in make_batches(3)]
        hooks = [ftrain.CheckpointHook(interval=1, by_epoch=True)]
        state = ftrain.Loop(
            ftrain.make_step(mse_loss),
            state,
            data,
            hooks=hooks,
            epochs=epochs,
            work_dir=work_dir,
            resume="auto" if resume else None,
        ).run()
        return [p.detach().cpu() for p in state.model.parameters()]

    straight = run(tmp_path / "straight", 2, False)
    run(tmp_path / "split", 1, False)
    torch.manual_seed(123)  # the resumed run must not depend on the process's RNG
    torch.cuda.manual_seed_all(123)
    resumed = run(tmp_path / "split", 2, True)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@two_gpus
def test_nccl_ranks_agree(tmp_path):
    """The gloo 'agree' checks on NCCL (2 GPUs); see tests/gpu/nccl_check.py."""
    res = _torchrun("agree", tmp_path, 2)
    for r in res:
        assert r["skip/ddp"]["skipped"] == [False, True, False]
        assert r["skip/fsdp2"]["skipped"] == [False, True, False]
        assert r["tokens"] < 1e-5 and r["clone"] < 1e-6
