"""A save trigger by wall time: save when ``minutes`` have passed since the last save.

The clock is a parameter (``time.monotonic`` by default), so a test drives it by hand and
the saves it triggers are deterministic. It counts from the start of each run (a resumed
run's first timed save comes ``minutes`` after it starts).

Example:
    >>> now = [0.0]
    >>> t = WallClock(30, clock=lambda: now[0])
    >>> start = t.clock()
    >>> now[0] = 29 * 60.0; t.due(start)
    False
    >>> now[0] = 30 * 60.0; t.due(start)
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import attrs

__all__ = ["WallClock", "every_minutes"]


def _minutes(_: object, __: attrs.Attribute, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"every_minutes(minutes): minutes must be a number > 0, got {value!r} "
            "(e.g. every_minutes(30) saves every half hour of wall time)."
        )


def _callable(_: object, __: attrs.Attribute, value: object) -> None:
    if not callable(value):
        raise TypeError(
            f"every_minutes(minutes, clock=): clock must be a function returning seconds "
            f"(like time.monotonic), got {value!r}."
        )


@attrs.frozen
class WallClock:
    """Save every ``minutes`` of wall time, read from ``clock()`` (seconds)."""

    minutes: float = attrs.field(validator=_minutes)
    clock: Callable[[], float] = attrs.field(default=time.monotonic, validator=_callable)

    def due(self, since: float) -> bool:
        """Whether ``minutes`` have passed since ``since`` (a ``clock()`` reading)."""
        return self.clock() - since >= 60.0 * self.minutes


def every_minutes(minutes: float, *, clock: Callable[[], float] = time.monotonic) -> WallClock:
    """A :class:`WallClock` save trigger for ``CheckpointHook(save_every=...)``.

    Example:
        >>> every_minutes(30).minutes
        30
    """
    return WallClock(minutes, clock)
