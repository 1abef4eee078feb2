"""Checkpoints at scale on CUDA (issue 20 item 7; skipped without CUDA).

The CPU suite (tests/test_ckpt_scale.py) checks the layout, the reuse, the order of the
copies and the waits with the pinning and the events faked; these run the real thing: one
pinned region (not the pinned caching allocator), device copies waited for by their event
(never a device-wide synchronize), and the FSDP2 stager on a GPU under NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ftrain
from ftrain.persist.checkpointer import Checkpointer
from ftrain.persist.hostbuffer import MAX_SLACK
from ftrain.persist.snapshot import Snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TESTS = Path(__file__).parent.parent


def cuda_state() -> dict[str, torch.Tensor]:
    """About 150 MiB of CUDA tensors of sizes no power of two (bf16 and fp32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3000, 5000), (5000,), (1500, 3000), (777, 4096)]
    out = {f"w{i}": torch.randn(s, device="cuda", generator=g) for i, s in enumerate(shapes)}
    out["half"] = torch.randn(2049, 3001, device="cuda", generator=g).bfloat16()
    return out


def test_background_saves_copy_into_one_pinned_region_waited_by_event(tmp_path, monkeypatch):
    state = cuda_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.current", 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("device sync"))
    ckpt = Checkpointer(torch.nn.Module())
    at_save = []
    for i in range(3):
        at_save.append({k: v.cpu() for k, v in state.items()})  # (.cpu() syncs its stream only)
        snap = Snapshot({"format": "demo", "state": state}, step=i, micro_step=i, epoch=0)
        ckpt.save(snap, tmp_path, f"iter_{i}.pth", "periodic", background=True)
        for t in state.values():
            t.mul_(1.5)  # queued behind the copies on the same stream: never seen by the write
    ckpt.wait()
    buf = ckpt.host_buffer
    assert buf.pinned and all(v.is_pinned() for v in buf.current)
    assert buf.allocations == 1 and total <= buf.capacity <= MAX_SLACK * total
    # pinned by registering the region: nothing from the pinned caching allocator
    assert stats().get("allocated_bytes.current", 0) == before
    for i in range(3):
        saved = ftrain.checkpoint.load_checkpoint(tmp_path / f"iter_{i}.pth")["state"]
        for k, v in at_save[i].items():
            assert torch.equal(saved[k], v), (i, k)
    ckpt.close()
    per_tensor = sum(1 << (t.numel() * t.element_size() - 1).bit_length() for t in state.values())
    print(f"\nhost bytes: one region {buf.capacity / total:.3f}x the state; tensor by tensor "
          f"through the pinned caching allocator {per_tensor / total:.3f}x")  # fmt: skip


def test_fsdp2_stager_on_a_gpu_overlaps_the_next_step_with_one_pinned_buffer(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(TESTS / "ckpt_worker.py"), "stager", str(tmp_path)]  # fmt: skip
    path = os.pathsep.join(p for p in (str(TESTS.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "stager_rank0.json").read_text())
    for kind in ("eager", "compiled"):
        run = res[kind]
        want = ["saved", "forward", "fence", "copied"]
        want += ["update", "stepped"] if kind == "eager" else ["stepped"]
        assert run["orders"] == [want] * 3, run["orders"]
        assert run["pinned"] and run["allocations"] == 1
        assert len(set(map(tuple, run["storages"]))) == 1
        assert run["state_bytes"] <= run["capacity"] <= MAX_SLACK * max(run["state_bytes"], 4096)
        assert run["written"] == [[], [], []], run["written"]
