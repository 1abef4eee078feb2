"""MFU (issue 20.10): the peak table by device name and compute dtype, and FLOPs counted once
on fake tensors.

References: the vendor data sheets' figures written out here (dense = half the 2:4-sparsity
figure where a sheet gives only that), ``FlopCounterMode`` over a real forward and backward
on the CPU, the closed form 6 * N * tokens of a transformer, and the loop's own logged
``iter_time``. No CUDA runs here: a CUDA device is faked by its name only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss, read_jsonl
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import FlopCounterMode

import ftrain
from ftrain.hooks import monitor
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.monitor import Throughput, compute_dtype, count_flops, peak_flops_for
from ftrain.hooks.timer import TimerHook

TESTS = Path(__file__).parent
T = 1e12
# name torch reports -> (bf16/fp16, tf32, fp32) dense FLOP/s, from the data sheets
DATASHEET = {
    "NVIDIA H100 80GB HBM3": (1978.9 * T / 2, 989.4 * T / 2, 66.9 * T),  # H100 SXM5
    "NVIDIA H100 PCIe": (1512 * T / 2, 756 * T / 2, 51.2 * T),
    "NVIDIA H100 NVL": (1671 * T / 2, 835 * T / 2, 60 * T),
    "NVIDIA H200": (1978.9 * T / 2, 989.4 * T / 2, 66.9 * T),  # the H100 SXM5's GPU
    "NVIDIA H200 NVL": (1671 * T / 2, 835 * T / 2, 60 * T),
    "NVIDIA H800": (1978.9 * T / 2, 989.4 * T / 2, 66.9 * T),
    "NVIDIA H800 PCIe": (1512 * T / 2, 756 * T / 2, 51.2 * T),
    "NVIDIA H20": (148 * T, 74 * T, 44 * T),
    "NVIDIA A100-SXM4-80GB": (624 * T / 2, 312 * T / 2, 19.5 * T),
    "NVIDIA A100-PCIE-40GB": (624 * T / 2, 312 * T / 2, 19.5 * T),
    "NVIDIA A100 80GB PCIe": (624 * T / 2, 312 * T / 2, 19.5 * T),
    "NVIDIA A800 80GB PCIe": (624 * T / 2, 312 * T / 2, 19.5 * T),
    "NVIDIA A800-SXM4-80GB": (624 * T / 2, 312 * T / 2, 19.5 * T),
    "NVIDIA A10G": (250 * T / 2, 125 * T / 2, 31.2 * T),
    "NVIDIA L4": (242 * T / 2, 120 * T / 2, 30.3 * T),
    "NVIDIA L40": (362.1 * T / 2, 181 * T / 2, 90.5 * T),
    "NVIDIA L40S": (724.1 * T / 2, 366 * T / 2, 91.6 * T),
    "NVIDIA B200": (4.5e15 / 2, 2.25e15 / 2, 75 * T),
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_peak_table_matches_the_data_sheets(name):
    half, tf32, fp32 = DATASHEET[name]
    assert peak_flops_for(name) == pytest.approx(half, rel=1e-3)  # bf16 by default
    assert peak_flops_for(name, dtype=torch.bfloat16) == pytest.approx(half, rel=1e-3)
    assert peak_flops_for(name, dtype=torch.float16) == pytest.approx(half, rel=1e-3)
    assert peak_flops_for(name, dtype="tf32") == pytest.approx(tf32, rel=1e-3)
    assert peak_flops_for(name, dtype=torch.float32) == pytest.approx(fp32, rel=1e-3)


def test_names_do_not_shadow_each_other():
    # issue 20: "H100 NVL"/"H200 NVL" got the SXM figure, "L40" got L4's
    assert peak_flops_for("NVIDIA H100 NVL") < peak_flops_for("NVIDIA H100 80GB HBM3")
    assert peak_flops_for("NVIDIA H200 NVL") < peak_flops_for("NVIDIA H200")
    assert peak_flops_for("NVIDIA L40") > peak_flops_for("NVIDIA L4")
    assert peak_flops_for("NVIDIA H20") < peak_flops_for("NVIDIA H200")
    for unknown in ("NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "cpu", "NVIDIA A1000"):
        assert peak_flops_for(unknown) is None, unknown
    assert peak_flops_for("Tesla V100-SXM2-16GB", dtype="bf16") is None  # no bf16 units
    assert peak_flops_for("Tesla V100-SXM2-16GB", dtype="tf32") == 15.7e12  # fp32 rate
    with pytest.raises(ValueError, match="compute dtype"):
        peak_flops_for("NVIDIA H100 PCIe", dtype=torch.int8)


def test_compute_dtype_follows_amp_and_tf32(monkeypatch):
    model = torch.nn.Linear(2, 2)
    plain = ftrain.make_step(mse_loss)
    assert compute_dtype(plain, model) == "fp32"
    assert compute_dtype(ftrain.with_amp(plain, dtype="bf16"), model) == "bf16"
    assert compute_dtype(ftrain.with_amp(plain, dtype="fp16"), model) == "fp16"
    assert compute_dtype(plain, model.to(torch.bfloat16)) == "bf16"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert compute_dtype(plain, torch.nn.Linear(2, 2)) == "tf32"


# ------------------------------------------------------------- MFU in a run
def _fake_gpu(monkeypatch, name: str) -> None:
    """A model 'on' a CUDA device called ``name`` (only its name is asked for)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(monitor, "model_device", lambda state: torch.device("cuda", 0))
    monkeypatch.setattr(monitor, "memory_stats", lambda device=None: {})


def _run(tmp_path, step, throughput):
    hooks = [TimerHook(skip_first_k=0),
             LoggerHook(every=2, progress=False, tensorboard=False, throughput=throughput)]  # fmt: skip
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    ftrain.Loop(step, state, make_batches(4), hooks, epochs=1, work_dir=tmp_path).run()
    return read_jsonl(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize(
    ("amp", "precision", "peak"),
    [(None, "highest", 66.9e12), (None, "high", 494.7e12), ("bf16", "highest", 989.4e12)],
)
def test_mfu_divides_by_the_peak_of_the_compute_dtype(tmp_path, monkeypatch, amp, precision, peak):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
    step = ftrain.make_step(mse_loss)
    step = step if amp is None else ftrain.with_amp(step, dtype=amp)
    throughput = Throughput(flops="auto")
    records = _run(tmp_path, step, throughput)
    flops = count_flops(mse_loss, make_model(0), make_batches(1)[0])
    assert len(records) == 2
    for r in records:
        assert r["perf/mfu"] == pytest.approx(flops / r["iter_time"] / peak, rel=1e-9)


def test_an_unknown_device_gets_no_mfu_and_one_warning(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA Quadro Something")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = _run(tmp_path, ftrain.make_step(mse_loss), Throughput(flops="auto"))
    notes = [w for w in caught if "peak FLOP/s" in str(w.message)]
    assert len(notes) == 1 and "NVIDIA Quadro Something" in str(notes[0].message)
    assert "Throughput(peak_flops=...)" in str(notes[0].message)
    assert all("perf/mfu" not in r and r["perf/tflops"] > 0 for r in records)


def test_a_failing_count_is_reported_once_not_swallowed(tmp_path):
    def loss_fn(model, batch):
        if isinstance(batch[0], FakeTensor):
            raise RuntimeError("shape-dependent code the fake run cannot take")
        return mse_loss(model, batch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = _run(tmp_path, ftrain.make_step(loss_fn), Throughput(flops="auto"))
    notes = [w for w in caught if "counting the FLOPs" in str(w.message)]
    assert len(notes) == 1
    assert "RuntimeError: shape-dependent code" in str(notes[0].message)
    assert all("perf/tflops" not in r for r in records) and len(records) == 2
    with pytest.raises(RuntimeError, match="shape-dependent"):
        count_flops(loss_fn, make_model(0), make_batches(1)[0])


# ------------------------------------------------------------ fake counting
class Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        a = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.out(a.transpose(1, 2).reshape(b, t, d))


class GPT(torch.nn.Module):
    """Pre-LN decoder: embeddings, ``layers`` x (attention, 4x MLP), LayerNorm, head."""

    def __init__(self, vocab=256, d=128, layers=2, heads=4, seq=32, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(d), "attn": Attention(d, heads),
                "ln2": torch.nn.LayerNorm(d), "drop": torch.nn.Dropout(dropout),
                "mlp": torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                           torch.nn.Linear(4 * d, d)),
            })  # fmt: skip
            self.blocks.append(block)
        self.norm, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = x + b["drop"](b["attn"](b["ln1"](x)))
            x = x + b["mlp"](b["ln2"](x))
        return self.head(self.norm(x))


def lm_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def tokens_batch(b=4, t=32, vocab=256):
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (b, t), generator=g) for _ in range(2))
    return x, y


def real_count(loss_fn, model, batch) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        loss = loss_fn(model, batch)
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return int(counter.get_total_flops())


def test_fake_count_equals_a_real_run_and_6_n_tokens():
    d, layers, seq, vocab, b = 128, 2, 32, 256, 4
    model = GPT(vocab, d, layers, seq=seq, dropout=0.1)
    batch = tokens_batch(b, seq, vocab)
    fake = count_flops(lm_loss, model, batch)
    assert fake == real_count(lm_loss, model, batch)
    tokens = b * seq
    embeddings = ("tok.", "pos.")
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(embeddings))
    matmul = layers * 12 * d * d + d * vocab  # the weights of the matmuls (no biases, norms)
    # 6 N tokens for the weights (forward 2, backward 4) plus attention's scores and mixing
    # (forward 4 T d per token and layer, backward 8), which 6 N leaves out: T / (6 d) of it
    assert fake == 6 * matmul * tokens + 12 * layers * seq * d * tokens
    # stated tolerance: |count - 6 N tokens| <= (T / (6 d) + 1%) of 6 N tokens
    assert abs(fake - 6 * n * tokens) <= (seq / (6 * d) + 0.01) * 6 * n * tokens


def test_counting_runs_no_real_compute_and_changes_nothing():
    inputs = []

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.bn = torch.nn.BatchNorm1d(8)

        def forward(self, x):
            inputs.append(x)
            return self.bn(torch.nn.functional.dropout(self.lin(x), 0.5))

    model = Recorder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 8)
    rng = torch.get_rng_state()
    flops = count_flops(lambda m, b: m(b).pow(2).mean(), model, x)
    assert flops == 4 * 16 * 8 * 8  # forward and weight gradient of the Linear (closed form)
    assert len(inputs) == 1 and isinstance(inputs[0], FakeTensor)  # the forward saw no data
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    # a model with no weights in memory at all counts the same
    with torch.device("meta"):
        meta = GPT(dropout=0.0)
    real = GPT(dropout=0.0)
    batch = tokens_batch()
    assert count_flops(lm_loss, meta, batch) == count_flops(lm_loss, real, batch)


def test_a_collective_in_the_loss_is_an_error():
    import torch.distributed as tdist

    def loss_fn(model, batch):
        out = model(batch[0])
        tdist.all_reduce(out)  # SyncBatchNorm does this in its forward
        return out.sum()

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="calls the collective c10d.allreduce_"):
            count_flops(loss_fn, make_model(0), make_batches(1)[0])
    finally:
        tdist.destroy_process_group()


# ------------------------------------------------------------ 2 gloo ranks
def test_ddp_and_fsdp2_count_without_collectives_on_two_ranks(tmp_path):
    """Rank 0 counts while rank 1 waits on the store: a collective would hang rank 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(TESTS / "flops_worker.py"), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "flops.json").read_text())
    assert res["ddp"] == res["fsdp2"] == res["plain_real"] == res["plain"]
    assert res["fsdp2_shard_numel"] < res["full_numel"]  # really sharded
