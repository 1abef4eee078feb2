"""Timing: interleaved round-robin repeats, device synchronisation, median and spread.

Example:
    >>> t = Timed("noop", lambda: None)
    >>> interleave([t], rounds=5)
    >>> len(t.times), summarize(t.times).median >= 0
    (5, True)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Stats", "Timed", "summarize", "synchronize", "interleave", "cuda_peak"]


@dataclass(frozen=True)
class Stats:
    """Median and spread (25th-75th percentile) of a list of samples.

    Example:
        >>> s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
        >>> s.median, s.p25, s.p75, s.n
        (3.0, 2.0, 4.0, 5)
    """

    median: float
    p25: float
    p75: float
    n: int

    def scaled(self, factor: float) -> Stats:
        """The same statistics multiplied by ``factor`` (e.g. seconds to milliseconds).

        Example:
            >>> summarize([0.001, 0.002, 0.003]).scaled(1e3).median
            2.0
        """
        return Stats(self.median * factor, self.p25 * factor, self.p75 * factor, self.n)

    def as_dict(self, unit: str) -> dict[str, float]:
        """``{"<unit>": median, "<unit>_p25": ..., "<unit>_p75": ...}`` for JSON.

        Example:
            >>> summarize([1.0, 2.0, 3.0]).as_dict("ms")
            {'ms': 2.0, 'ms_p25': 1.5, 'ms_p75': 2.5}
        """
        return {unit: self.median, f"{unit}_p25": self.p25, f"{unit}_p75": self.p75}


def summarize(samples: Sequence[float]) -> Stats:
    """Median, 25th and 75th percentiles (inclusive method) of ``samples``.

    Example:
        >>> summarize([5.0]).p75
        5.0
    """
    xs = [float(x) for x in samples]
    if not xs:
        return Stats(math.nan, math.nan, math.nan, 0)
    if len(xs) == 1:
        return Stats(xs[0], xs[0], xs[0], 1)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return Stats(statistics.median(xs), q[0], q[2], len(xs))


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU.

    Example:
        >>> synchronize("cpu")
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cuda_peak(device: torch.device, fn: Callable[[], Any]) -> int:
    """The CUDA allocator peak of ``fn()`` above what was allocated before it."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@dataclass
class Timed:
    """A variant to time: ``run()`` does one timed unit (a step, or an accumulation window).

    ``times`` (seconds per unit) is filled by :func:`interleave`; ``spent`` counts against
    ``max_seconds`` (set it to include set-up work); ``capped``: the limit made it skip rounds.

    Example:
        >>> t = Timed("x", lambda: None)
        >>> t.time_once() >= 0, len(t.times)
        (True, 1)
    """

    name: str
    run: Callable[[], Any]
    device: torch.device | str = "cpu"
    max_seconds: float | None = None
    times: list[float] = field(default_factory=list)
    spent: float = 0.0
    capped: bool = False

    def time_once(self) -> float:
        """Run one unit between synchronisations; record and return its seconds."""
        synchronize(self.device)
        t0 = time.perf_counter()
        self.run()
        synchronize(self.device)
        dt = time.perf_counter() - t0
        self.times.append(dt)
        self.spent += dt
        return dt

    def over_limit(self) -> bool:
        """Whether one more unit would pass ``max_seconds`` (never before the first sample)."""
        if self.max_seconds is None or not self.times:
            return False
        return self.spent + statistics.median(self.times) > self.max_seconds

    def stats(self) -> Stats:
        """:func:`summarize` of the samples."""
        return summarize(self.times)


def interleave(
    items: Sequence[Timed], rounds: int, *, on_unit: Callable[[Timed], None] | None = None
) -> None:
    """Time ``rounds`` units of each item, round-robin, rotating who goes first.

    Example:
        >>> a, b, order = Timed("a", lambda: order.append("a")), Timed("b", lambda: order.append("b")), []
        >>> interleave([a, b], rounds=2)
        >>> order
        ['a', 'b', 'b', 'a']
    """
    k = len(items)
    for r in range(rounds):
        for i in range(k):
            item = items[(r + i) % k]
            if item.over_limit():
                item.capped = True
            else:
                item.time_once()
            if on_unit is not None:
                on_unit(item)
