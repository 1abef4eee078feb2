"""Checkpoint saves: training-thread blocked time of a background save vs ``torch.save``.

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
from types import SimpleNamespace
from typing import Any

import torch

from ftrain.bench.verdict import Target, judge, median_interval, paired

__all__ = ["run_checkpoint", "checkpoint_table", "make_state", "SaveSource", "TARGET"]

#: The blocked time of a background save over torch.save's, for a 1 GiB state (issue 12).
TARGET = Target("blocked time vs torch.save (lower is better)", 0.25, "x", full_size=True)


def make_state(size_mb: float, *, tensors: int = 16) -> dict[str, torch.Tensor]:
    """A dict of ``tensors`` float32 tensors totalling ``size_mb`` MiB."""
    numel = max(1, int(size_mb * 2**20 / 4 / tensors))
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(tensors)}


class SaveSource:
    """The little of a loop a :class:`~ftrain.persist.checkpointer.Checkpointer` reads:
    ``state`` (its counters), ``run_id`` and ``checkpoint()``, here a dict of tensors.

    Example:
        >>> from ftrain.persist.checkpointer import Checkpointer
        >>> import tempfile
        >>> src = SaveSource(make_state(0.01))
        >>> ckpt = Checkpointer(src.state.model)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     entry = ckpt.save(src, d, "a.pth", "periodic", background=True)
        ...     ckpt.close()
        >>> entry["name"]
        'a.pth'
    """

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.payload = state
        self.state = SimpleNamespace(step=0, micro_step=0, epoch=0, model=torch.nn.Module())
        self.run_id = "bench"

    def checkpoint(self) -> dict[str, Any]:
        return {"format": "bench", "state": self.payload}


def _summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2], "first_s": times[0]}


def _time_pairs(
    state: dict[str, torch.Tensor], repeats: int, root: Path
) -> tuple[list[float], list[float], list[float]]:
    """``repeats`` rounds of torch.save then a background save: (sync, blocked, completed)."""
    from ftrain.persist.checkpointer import Checkpointer

    sync: list[float] = []
    blocked: list[float] = []
    completed: list[float] = []
    loop = SaveSource(state)
    ckpt = Checkpointer(loop.state.model)
    for i in range(repeats):
        path = root / "sync.pth"
        t0 = time.perf_counter()
        torch.save(state, path)
        sync.append(time.perf_counter() - t0)
        path.unlink()
        loop.state.step = i
        t0 = time.perf_counter()
        ckpt.save(loop, root / "run", "iter.pth", "periodic", background=True,
                  prune=lambda m: [])  # fmt: skip
        blocked.append(time.perf_counter() - t0)
        ckpt.wait()
        completed.append(time.perf_counter() - t0)
    ckpt.close()
    return sync, blocked, completed


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
        sync, blocked, completed = _time_pairs(state, repeats, Path(tmp))
    results = [
        {"variant": "torch.save", "bytes": nbytes, "blocked": _summary(sync), "blocked_s": sync},
        {
            "variant": "ftrain background",
            "bytes": nbytes,
            "blocked": _summary(blocked),
            "completed": _summary(completed),
            "blocked_s": blocked,
        },
    ]
    interval = median_interval(paired(blocked, sync, "ratio"))
    verdict = judge(TARGET, interval, quick=quick)
    return {"results": results, "ratio": interval.median, "interval": interval.as_dict(),
            "repeats": repeats, "targets": [verdict.line()],
            "verdicts": [verdict.as_dict()]}  # fmt: skip


def checkpoint_table(out: dict[str, Any]) -> str:
    """The results as a text table; ``vs torch.save``: the paired ratio of blocked times.

    Example:
        >>> print(checkpoint_table(run_checkpoint(size_mb=1, repeats=1)))  # doctest: +ELLIPSIS
        variant            MiB  blocked s      p25-p75  first s  completed s  vs torch.save
        ...
    """
    from ftrain.bench.report import format_table
    from ftrain.bench.verdict import fmt_ratio

    rows = []
    for r in out["results"]:
        b = r["blocked"]
        done = f"{r['completed']['median_s']:.3f}" if "completed" in r else "-"
        ratio = fmt_ratio(out["ratio"]) if "completed" in r else "1.00x"
        rows.append([r["variant"], f"{r['bytes'] / 2**20:.0f}", f"{b['median_s']:.3f}",
                     f"{b['p25_s']:.3f}-{b['p75_s']:.3f}", f"{b['first_s']:.3f}", done,
                     ratio])  # fmt: skip
    headers = ["variant", "MiB", "blocked s", "p25-p75", "first s", "completed s", "vs torch.save"]
    return format_table(headers, [rows])
