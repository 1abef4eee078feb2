"""Checkpoint saves: training-thread blocked time of a background save vs ``torch.save``.

Also what the background save holds: its host buffer's bytes against the state's (one
allocation; pinned tensor by tensor, each would be rounded up to a power of two), the
allocations it made over all repeats, and the blocked seconds the Checkpointer itself
recorded (what the logger shows as ``perf/ckpt_blocked_s``).

Example:
    >>> out = run_checkpoint(size_mb=1, repeats=1)
    >>> sorted(r["variant"] for r in out["results"])
    ['ftrain background', 'torch.save']
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ftrain.persist.snapshot import Snapshot

__all__ = ["run_checkpoint", "checkpoint_table", "make_state"]


def make_state(size_mb: float, *, tensors: int = 16) -> dict[str, torch.Tensor]:
    """A dict of ``tensors`` float32 tensors totalling ``size_mb`` MiB."""
    numel = max(1, int(size_mb * 2**20 / 4 / tensors))
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}


def _snapshot(payload: dict[str, torch.Tensor], step: int) -> Snapshot:
    """The snapshot a Checkpointer saves: ``payload`` at update ``step``."""
    return Snapshot({"format": "bench", "state": payload}, step, step, 0, run_id="bench")


def _pow2_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes PyTorch's pinned caching allocator takes to pin each tensor on its own."""
    return sum(1 << max(0, (t.numel() * t.element_size() - 1).bit_length()) for t in state.values())


def _summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2], "first_s": times[0]}


def run_checkpoint(
    size_mb: float = 1024, repeats: int = 3, directory: str | None = None
) -> dict[str, Any]:
    """Time both variants ``repeats`` times, interleaved; return ``{"results", "ratio"}``."""
    from ftrain.persist.checkpointer import Checkpointer

    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    sync: list[float] = []
    blocked: list[float] = []
    completed: list[float] = []
    logged: list[float] = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        root = Path(tmp)
        ckpt = Checkpointer(torch.nn.Module())
        for i in range(repeats):
            path = root / "sync.pth"
            t0 = time.perf_counter()
            torch.save(state, path)
            sync.append(time.perf_counter() - t0)
            path.unlink()
            t0 = time.perf_counter()
            ckpt.save(_snapshot(state, i), root / "run", "iter.pth", "periodic", background=True,
                      prune=lambda m: [])  # fmt: skip
            blocked.append(time.perf_counter() - t0)
            ckpt.wait()
            completed.append(time.perf_counter() - t0)
            logged.append(ckpt.times.last.blocked_s)
        host = {"host_bytes": ckpt.host_buffer.capacity, "allocations": ckpt.host_buffer.allocations,
                "pinned": ckpt.host_buffer.pinned, "per_tensor_pinned_bytes": _pow2_bytes(state)}  # fmt: skip
        ckpt.close()
    results = [
        {"variant": "torch.save", "bytes": nbytes, "blocked": _summary(sync)},
        {
            "variant": "ftrain background",
            "bytes": nbytes,
            "blocked": _summary(blocked),
            "completed": _summary(completed),
            "logged_blocked": _summary(logged),
            **host,
        },
    ]
    ratio = results[1]["blocked"]["median_s"] / results[0]["blocked"]["median_s"]
    return {"results": results, "ratio": ratio, "repeats": repeats}


def checkpoint_table(out: dict[str, Any]) -> str:
    """The results as a text table.

    Example:
        >>> print(checkpoint_table(run_checkpoint(size_mb=1, repeats=1)))  # doctest: +ELLIPSIS
        variant ...
    """
    lines = [
        f"{'variant':<20} {'MiB':>8} {'blocked s (p25-p75)':>26} {'first s':>8} {'completed s':>12}"
        f" {'logged s':>9} {'host MiB':>9} {'allocs':>6}"
    ]
    for r in out["results"]:
        b = r["blocked"]
        done = f"{r['completed']['median_s']:.3f}" if "completed" in r else "-"
        logged = f"{r['logged_blocked']['median_s']:.3f}" if "logged_blocked" in r else "-"
        host = f"{r['host_bytes'] / 2**20:.0f}" if "host_bytes" in r else "-"
        lines.append(
            f"{r['variant']:<20} {r['bytes'] / 2**20:>8.0f} "
            f"{b['median_s']:>9.3f} ({b['p25_s']:.3f}-{b['p75_s']:.3f}) {b['first_s']:>8.3f} "
            f"{done:>12} {logged:>9} {host:>9} {r.get('allocations', '-'):>6}"
        )
    lines.append(f"blocked time vs torch.save (medians): {out['ratio']:.1%} (target <= 25%)")
    bg = out["results"][1]
    lines.append(
        f"host buffer: {bg['host_bytes'] / bg['bytes']:.3f}x the state in one allocation "
        f"({'pinned' if bg['pinned'] else 'not pinned: no CUDA'}; pinned tensor by tensor: "
        f"{bg['per_tensor_pinned_bytes'] / bg['bytes']:.3f}x), {bg['allocations']} allocation(s) "
        f"over {out['repeats']} saves"
    )
    lines.append(
        "logged: the blocked seconds the Checkpointer recorded (manifest blocked_s, the "
        "logger's perf/ckpt_blocked_s); host MiB, allocs: the background save's host buffer"
    )
    return "\n".join(lines)
