"""Running time sums of a loop's steps, kept by the loop itself.

The loop adds every micro-batch's data and iteration time here (a few float
additions, no event, no hook call), so a timer needs no per-step work: it
reads these sums when it reports (:class:`~ftrain.hooks.timer.TimerStats`).
"""

from __future__ import annotations

__all__ = ["StepTiming"]


class StepTiming:
    """Sums over the micro-batches a loop ran since it (re)started.

    Attributes:
        n: micro-batches (step calls, plus applied partial windows).
        updates: optimizer updates among them.
        data_time: seconds spent waiting for batches.
        iter_time: seconds from one step's end to the next (data, step and hooks).

    Example:
        >>> t = StepTiming()
        >>> t.add(0.01, 0.1, True); t.add(0.03, 0.3, False)
        >>> t.n, t.updates, round(t.iter_time, 3)
        (2, 1, 0.4)
    """

    __slots__ = ("n", "updates", "data_time", "iter_time")

    def __init__(self) -> None:
        self.n = 0
        self.updates = 0
        self.data_time = 0.0
        self.iter_time = 0.0

    def add(self, data_time: float, iter_time: float, is_update: bool) -> None:
        """Count one micro-batch (the loop does the same inline)."""
        self.n += 1
        self.data_time += data_time
        self.iter_time += iter_time
        if is_update:
            self.updates += 1

    def snapshot(self) -> tuple[int, int, float, float]:
        """The current sums: ``(n, updates, data_time, iter_time)``."""
        return (self.n, self.updates, self.data_time, self.iter_time)

    def __repr__(self) -> str:
        return (
            f"StepTiming(n={self.n}, updates={self.updates}, data_time={self.data_time:.4g}s, "
            f"iter_time={self.iter_time:.4g}s)"
        )
