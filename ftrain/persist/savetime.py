"""What checkpoint saves cost the training thread: measured per save, summed for the logger,
warned about when it is too much.

A save's *blocked* seconds are the time its ``save()`` call held the training thread (the
copy to host memory of a background save, the whole write of a synchronous one) plus, for a
background FSDP2 save, the time the next update waited for its copies to finish. The
*interval* is the wall time from the first save of the previous update that saved to the
first save of this one (a periodic and a best checkpoint of the same update share one).
Warned once per run each (rank 0; not under :data:`MIN_WARN_S`): saves of one update
blocking more than :data:`BLOCKED_SHARE` of their interval, and a save that first waits
for the previous update's background write (saves come faster than the storage writes).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import attrs

__all__ = ["SaveTime", "SaveClock", "BLOCKED_SHARE", "MIN_WARN_S"]

#: Saves blocking the training thread more than this share of the time between them warn.
BLOCKED_SHARE = 0.10
#: Seconds below which no save time is warned about (a toy run's milliseconds).
MIN_WARN_S = 0.05


@attrs.define
class SaveTime:
    """The training thread's seconds of one save.

    Attributes:
        name: the checkpoint written.
        blocked_s: seconds ``save()`` held the training thread (``waited_s`` included).
        waited_s: of those, waiting for the previous background write to finish.
        interval_s: wall seconds since the previous update's first save began (``None``
            for the run's first update that saved).
        fence_s: seconds the next update waited for this save's copies (FSDP2 background).
    """

    name: str
    blocked_s: float
    waited_s: float
    interval_s: float | None
    fence_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Every second this save held the training thread."""
        return self.blocked_s + self.fence_s


class SaveClock:
    """Times a run's saves (``clock``: seconds, ``time.perf_counter`` by default); ``saves``,
    ``blocked_s`` and ``waited_s`` are running totals (what the logger shows), ``last`` the
    newest :class:`SaveTime`. ``warn=False``: measure only (ranks other than 0).

    Example:
        >>> ticks = iter([0.0, 1.0, 10.0, 13.0])
        >>> c = SaveClock(clock=lambda: next(ticks), warn=False)
        >>> first = c.finish("a.pth", c.start(step=5), waited_s=0.0)
        >>> second = c.finish("b.pth", c.start(step=10), waited_s=0.0)
        >>> second.blocked_s, second.interval_s, c.saves, c.blocked_s
        (3.0, 10.0, 2, 4.0)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *, warn: bool = True):
        self.clock, self.warn = clock, warn
        self.saves = 0
        self.blocked_s = 0.0
        self.waited_s = 0.0
        self.last: SaveTime | None = None
        self._warned: set[str] = set()
        self._step: int | None = None  # the update the newest saves were at
        self._begun = 0.0  # when its first save began
        self._interval: float | None = None
        self._group: list[SaveTime] = []  # its saves

    def start(self, step: int) -> float:
        """A save at update ``step`` begins; its start time."""
        now = self.clock()
        if step != self._step:
            self._interval = None if self._step is None else now - self._begun
            self._step, self._begun, self._group = step, now, []
        return now

    @property
    def new_update(self) -> bool:
        """Whether the save begun last is its update's first."""
        return not self._group

    def waited(self, name: str, previous: str | None, seconds: float) -> None:
        """The save ``name`` had to wait ``seconds`` for the previous write to finish."""
        self.waited_s += seconds
        if self.new_update and seconds >= MIN_WARN_S:
            self._warn(
                "waited",
                f"Checkpoint {name} waited {seconds:.2f} s for the previous background write"
                f"{f' ({previous})' if previous else ''} to finish before it could start: "
                "saves come faster than the storage writes them. Save less often (a longer "
                "interval) or write to faster storage.",
            )

    def finish(self, name: str, start: float, *, waited_s: float) -> SaveTime:
        """The save ``name`` begun at ``start`` returned: record (and judge) it."""
        t = SaveTime(name, self.clock() - start, waited_s, self._interval)
        self.saves += 1
        self.blocked_s += t.blocked_s
        self.last = t
        self._group.append(t)
        self._judge(self._group)
        return t

    def add_fence(self, t: SaveTime, seconds: float) -> None:
        """The next update waited ``seconds`` for the copies of the save ``t``."""
        t.fence_s += seconds
        self.blocked_s += seconds
        if self._group and t in self._group:
            self._judge(self._group)

    def _judge(self, group: list[SaveTime]) -> None:
        interval = group[0].interval_s
        total = sum(t.total_s for t in group)
        if interval is None or total < MIN_WARN_S or total <= BLOCKED_SHARE * interval:
            return
        names = ", ".join(t.name for t in group)
        self._warn(
            "blocked",
            f"Checkpoint {names} blocked training for {total:.2f} s, {total / interval:.0%} "
            f"of the {interval:.3g} s since the previous save (more than "
            f"{BLOCKED_SHARE:.0%}). Save less often (a longer interval), in the background "
            "(CheckpointHook(background=True)), or to faster storage.",
        )

    def _warn(self, kind: str, message: str) -> None:
        if self.warn and kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(
                message + " (Warned once per run; LoggerHook logs perf/ckpt_blocked_s and "
                "perf/ckpt_waited_s.)",
                stacklevel=5,
            )
