"""The timer hook: data/iteration time, elapsed time and ETA (MMEngine ``IterTimerHook``).

The loop sums the times in ``loop.totals``; ``TimerHook`` marks where the warm-up ends and
keeps the run's clock; ``timer.stats`` (:class:`TimerStats`) gives averages, elapsed time and
the ETA, e.g. ``print(timer.stats.summary())`` after ``lp.run(steps=100)``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ftrain._checks import whole
from ftrain.events import Event, Paused, RunTotals, StepEnd
from ftrain.hooks.cadence import Every

if TYPE_CHECKING:
    from ftrain.run import Run

__all__ = ["TimerHook", "TimerStats", "format_seconds"]

Mark = tuple[int, int, float, float]
_UNKNOWN = object()


def format_seconds(seconds: float | None) -> str:
    """``h:mm:ss`` (or ``d days, h:mm:ss``) for a duration; ``"?"`` when unknown.

    Past a year the exact figure means nothing: it is ``"> 1 year"``.

    Example:
        >>> format_seconds(3725.4), format_seconds(None), format_seconds(2 * 86400 + 5)
        ('1:02:05', '?', '2 days, 0:00:05')
    """
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    if seconds > 365 * 86400:
        return "> 1 year"
    s = int(round(max(seconds, 0.0)))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    text = f"{hours}:{minutes:02d}:{s:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {text}" if days else text


def _mark(totals: RunTotals) -> Mark:
    return (totals.micro_batches, totals.updates, totals.data_time, totals.iter_time)


class TimerStats:
    """A run's times since its warm-up ended, over ``loop.totals``: averages, elapsed, ETA.

    ``n`` counts micro-batches, ``updates`` the optimizer updates among them. For
    averages over its own window a consumer keeps a :meth:`mark` and asks :meth:`since`.

    Example:
        >>> from ftrain.events import RunTotals
        >>> totals = RunTotals()
        >>> stats = TimerStats(None, totals=totals)  # counting from here
        >>> totals.micro_batches, totals.updates, totals.data_time, totals.iter_time = 2, 2, 0.04, 0.4
        >>> round(stats.data_time_avg, 3), round(stats.update_time_avg, 3)
        (0.02, 0.2)
        >>> mark = stats.mark(); totals.micro_batches += 1; totals.iter_time += 0.5
        >>> round(stats.since(mark)["iter_time"], 3)
        0.5
    """

    def __init__(
        self, loop: Run | None, elapsed: float = 0.0, *, totals: RunTotals, counting: bool = True
    ) -> None:
        self.totals = totals
        self._base: Mark | None = _mark(totals) if counting else None  # None: warming up
        self._loop = None if loop is None else weakref.ref(loop)  # the loop holds its hooks
        self._offset = float(elapsed)
        self._start = time.perf_counter()
        self._stopped: float | None = None
        self._per_epoch: Any = _UNKNOWN

    def restart(self) -> None:
        """Count from now on: what was summed so far (the warm-up) is left out."""
        self._base = _mark(self.totals)

    def mark(self) -> Mark:
        """The counted sums now: ``(n, updates, data_time, iter_time)``."""
        if self._base is None:
            return (0, 0, 0.0, 0.0)
        return tuple(a - b for a, b in zip(_mark(self.totals), self._base))  # type: ignore[return-value]

    n = property(lambda self: self.mark()[0], doc="Micro-batches counted.")
    updates = property(lambda self: self.mark()[1], doc="Optimizer updates counted.")
    data_time = property(lambda self: self.mark()[2], doc="Seconds waiting for batches.")
    iter_time = property(lambda self: self.mark()[3], doc="Seconds of data, step and hooks.")

    @property
    def data_time_avg(self) -> float | None:
        """Mean seconds waiting for a batch (``None`` before any counted step)."""
        return self.since(None).get("data_time")

    @property
    def iter_time_avg(self) -> float | None:
        """Mean seconds per micro-batch (data, step and hooks)."""
        return self.since(None).get("iter_time")

    @property
    def update_time_avg(self) -> float | None:
        """Mean seconds per optimizer update (all its micro-batches)."""
        _, updates, _, it = self.mark()
        return it / updates if updates else None

    def since(self, mark: Mark | None) -> dict[str, float]:
        """Mean ``data_time`` and ``iter_time`` per micro-batch since ``mark`` (empty: none)."""
        n0, _, d0, i0 = mark if mark is not None else (0, 0, 0.0, 0.0)
        n, _, data, it = self.mark()
        if n - n0 <= 0:
            return {}
        return {"data_time": (data - d0) / (n - n0), "iter_time": (it - i0) / (n - n0)}

    @property
    def elapsed(self) -> float:
        """Seconds of training so far, including earlier runs this one resumed."""
        end = self._stopped if self._stopped is not None else time.perf_counter()
        return self._offset + (end - self._start)

    def stop(self) -> None:
        """Freeze :attr:`elapsed` (the run ended, was interrupted or paused)."""
        if self._stopped is None:
            self._stopped = time.perf_counter()

    def resume(self) -> None:
        """Count time again after :meth:`stop` (a paused run continues)."""
        if self._stopped is not None:
            self._offset -= time.perf_counter() - self._stopped  # the pause is not training
            self._stopped = None

    @property
    def eta(self) -> float | None:
        """Estimated seconds left (``None``: unknown): the sooner of remaining updates (of
        ``max_steps``) and remaining batches (of ``epochs``) times their mean time."""
        loop = None if self._loop is None else self._loop()
        if loop is None:
            return None
        n, updates, _, it = self.mark()
        state = loop.state
        estimates = []
        if loop.max_steps is not None and updates:
            estimates.append(max(loop.max_steps - state.step, 0) * it / updates)
        if loop.epochs is not None and n:
            if self._per_epoch is _UNKNOWN:  # asked once per run (len() can be slow, or raise)
                self._per_epoch = loop.batches_per_epoch
            if (per_epoch := self._per_epoch) is not None:
                done = state.epoch * per_epoch + loop.batch_in_epoch
                estimates.append(max(loop.epochs * per_epoch - done, 0) * it / n)
        return min(estimates) if estimates else None

    def summary(self) -> dict[str, float | None]:
        """Run-wide averages, elapsed time and ETA as one dict."""
        return {
            "data_time": self.data_time_avg,
            "iter_time": self.iter_time_avg,
            "update_time": self.update_time_avg,
            "elapsed": self.elapsed,
            "eta": self.eta,
        }

    def __repr__(self) -> str:
        avg = self.iter_time_avg
        return (
            f"TimerStats(steps={self.n}, updates={self.updates}, "
            f"iter_time={'?' if avg is None else f'{avg:.4g}s'}, "
            f"elapsed={format_seconds(self.elapsed)}, eta={format_seconds(self.eta)})"
        )


class TimerHook:
    """Time the run: averages, elapsed time and ETA in ``stats`` (:class:`TimerStats`).

    The first ``skip_first_k`` updates of each run (warm-up) are left out of the
    statistics. Elapsed time is checkpointed (it keeps counting across a resume);
    a pause is not counted.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> timer = TimerHook(skip_first_k=1)
        >>> lp = ftrain.Loop(step, state, [torch.ones(4, 2)] * 5, hooks=[timer], max_steps=5)
        >>> _ = lp.run()
        >>> timer.stats.updates, timer.stats.eta
        (4, 0.0)
    """

    priority = "NORMAL"
    name = "timer"

    def __init__(self, skip_first_k: int = 5) -> None:
        self.skip_first_k = whole("TimerHook: skip_first_k", skip_first_k, 0)
        self._elapsed = 0.0
        #: The update whose ``StepEnd`` ends the warm-up (set when a run starts).
        self.cadence = Every()
        #: The current (or last) run's statistics; ``None`` before a run.
        self.stats: TimerStats | None = None

    def __repr__(self) -> str:
        return f"TimerHook(skip_first_k={self.skip_first_k})"

    @property
    def elapsed(self) -> float:
        """Seconds of training so far (across resumes)."""
        return self.stats.elapsed if self.stats is not None else self._elapsed

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._elapsed = float(saved.get("elapsed", 0.0))
        self.stats = None  # the next run restarts from the saved time

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        warm = self.skip_first_k > 0
        self.stats = stats = TimerStats(loop, self._elapsed, totals=loop.totals, counting=not warm)
        until = first.state.step + self.skip_first_k
        self.cadence = Every(at=(until,)) if warm else Every()
        try:
            yield first
            for ev in events:
                kind = type(ev)
                if kind is StepEnd and warm and ev.is_update and ev.state.step >= until:
                    stats.restart()  # the sums so far include this update: left out
                    warm = False
                elif kind is Paused:
                    stats.stop()
                    yield ev
                    stats.resume()  # run() continued
                    continue
                yield ev
        finally:
            stats.stop()
            self._elapsed = stats.elapsed
