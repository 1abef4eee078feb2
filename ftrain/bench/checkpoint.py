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

from ftrain.bench.verdict import Target, judge, median_interval, paired
from ftrain.persist.snapshot import Snapshot

__all__ = ["run_checkpoint", "checkpoint_table", "make_state", "TARGET"]

#: The blocked time of a background save over torch.save's, for a 1 GiB state (issue 12).
TARGET = Target("blocked time vs torch.save (lower is better)", 0.25, "x", full_size=True)


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


def _time_pairs(state: dict[str, torch.Tensor], repeats: int, root: Path) -> dict[str, Any]:
    """``repeats`` rounds of torch.save then a background save: the seconds of each (sync,
    blocked, completed, logged by the Checkpointer) and what its host buffer held."""
    from ftrain.persist.checkpointer import Checkpointer

    times: dict[str, list[float]] = {"sync": [], "blocked": [], "completed": [], "logged": []}
    ckpt = Checkpointer(torch.nn.Module())
    for i in range(repeats):
        path = root / "sync.pth"
        t0 = time.perf_counter()
        torch.save(state, path)
        times["sync"].append(time.perf_counter() - t0)
        path.unlink()
        t0 = time.perf_counter()
        ckpt.save(_snapshot(state, i), root / "run", "iter.pth", "periodic", background=True,
                  prune=lambda m: [])  # fmt: skip
        times["blocked"].append(time.perf_counter() - t0)
        ckpt.wait()
        times["completed"].append(time.perf_counter() - t0)
        times["logged"].append(ckpt.times.last.blocked_s)
    buffer = ckpt.host_buffer
    host = {"host_bytes": buffer.capacity, "allocations": buffer.allocations,
            "pinned": buffer.pinned, "per_tensor_pinned_bytes": _pow2_bytes(state)}  # fmt: skip
    ckpt.close()
    return {**times, "host": host}


def run_checkpoint(
    size_mb: float = 1024,
    repeats: int = 5,
    directory: str | None = None,
    *,
    quick: bool = False,
) -> dict[str, Any]:
    """Time both variants ``repeats`` times, interleaved; ``{"results", "ratio", "targets"}``.

    ``ratio``: the median of the per-repeat ratios blocked / torch.save; ``interval``: where
    that median lies; the target is judged at full size only (not when ``quick``).
    """
    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        t = _time_pairs(state, repeats, Path(tmp))
    sync, blocked = t["sync"], t["blocked"]
    results = [
        {"variant": "torch.save", "bytes": nbytes, "blocked": _summary(sync), "blocked_s": sync},
        {
            "variant": "ftrain background",
            "bytes": nbytes,
            "blocked": _summary(blocked),
            "completed": _summary(t["completed"]),
            "blocked_s": blocked,
            "logged_blocked": _summary(t["logged"]),
            **t["host"],
        },
    ]
    interval = median_interval(paired(blocked, sync, "ratio"))
    verdict = judge(TARGET, interval, quick=quick)
    return {"results": results, "ratio": interval.median, "interval": interval.as_dict(),
            "repeats": repeats, "targets": [verdict.line()],
            "verdicts": [verdict.as_dict()]}  # fmt: skip


def _host_line(out: dict[str, Any]) -> str:
    bg = out["results"][1]
    return (
        f"host buffer: {bg['host_bytes'] / bg['bytes']:.3f}x the state in one allocation "
        f"({'pinned' if bg['pinned'] else 'not pinned: no CUDA'}; pinned tensor by tensor: "
        f"{bg['per_tensor_pinned_bytes'] / bg['bytes']:.3f}x), {bg['allocations']} allocation(s) "
        f"over {out['repeats']} saves; logged: the blocked seconds the Checkpointer recorded "
        "(manifest blocked_s, the logger's perf/ckpt_blocked_s)"
    )


def checkpoint_table(out: dict[str, Any]) -> str:
    """The results as a text table; ``vs torch.save``: the paired ratio of blocked times.

    Example:
        >>> print(checkpoint_table(run_checkpoint(size_mb=1, repeats=1)))  # doctest: +ELLIPSIS
        variant            MiB  blocked s      p25-p75  first s  completed s  logged s ...
        ...
    """
    from ftrain.bench.report import format_table
    from ftrain.bench.verdict import fmt_ratio

    rows = []
    for r in out["results"]:
        b = r["blocked"]
        done = f"{r['completed']['median_s']:.3f}" if "completed" in r else "-"
        logged = f"{r['logged_blocked']['median_s']:.3f}" if "logged_blocked" in r else "-"
        host = f"{r['host_bytes'] / 2**20:.0f}" if "host_bytes" in r else "-"
        ratio = fmt_ratio(out["ratio"]) if "completed" in r else "1.00x"
        rows.append([r["variant"], f"{r['bytes'] / 2**20:.0f}", f"{b['median_s']:.3f}",
                     f"{b['p25_s']:.3f}-{b['p75_s']:.3f}", f"{b['first_s']:.3f}", done, logged,
                     host, str(r.get("allocations", "-")), ratio])  # fmt: skip
    headers = ["variant", "MiB", "blocked s", "p25-p75", "first s", "completed s", "logged s",
               "host MiB", "allocs", "vs torch.save"]  # fmt: skip
    return format_table(headers, [rows]) + "\n" + _host_line(out)
