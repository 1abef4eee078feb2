"""The timer hook: data/iteration time, elapsed time and ETA (MMEngine ``IterTimerHook``).

The loop itself adds every micro-batch's ``data_time`` and ``iter_time``
to running sums (:class:`~ftrain.timing.StepTiming`: a few float additions
per step, no event, no tensor work). ``TimerHook`` marks where the warm-up
ends and publishes the sums as a :class:`TimerStats` in
``loop.info["timer"]``, where the logger (or any hook of lower priority)
reads averages, elapsed time and the ETA::

    @ftrain.hook(priority="LOW")
    def show_eta(events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.is_update and ev.state.step % 100 == 0:
                print(ev.loop.info["timer"].summary())
            yield ev
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import Any

from ftrain.events import Event, Paused, StepEnd
from ftrain.timing import StepTiming

__all__ = ["TimerHook", "TimerStats", "format_seconds"]

Mark = tuple[int, int, float, float]
_UNKNOWN = object()


def format_seconds(seconds: float | None) -> str:
    """``h:mm:ss`` (or ``d days, h:mm:ss``) for a duration; ``"?"`` when unknown.

    Past a year the exact figure means nothing (a ``max_steps`` set "large
    enough" gave "68204 days, ..."): it is ``"> 1 year"``.

    Example:
        >>> format_seconds(3725.4), format_seconds(None), format_seconds(2 * 86400 + 5)
        ('1:02:05', '?', '2 days, 0:00:05')
        >>> format_seconds(68204 * 86400.0)
        '> 1 year'
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


def batches_per_epoch(data: Any) -> int | None:
    """``len(data)`` when the data has a usable length, else ``None``.

    Example:
        >>> batches_per_epoch([1, 2, 3]), batches_per_epoch(iter([1, 2, 3]))
        (3, None)
    """
    try:
        n = len(data)
    except Exception:  # no __len__, or an IterableDataset loader that raises
        return None
    return n if isinstance(n, int) and n > 0 else None


def batch_in_epoch(loop: Any) -> int:
    """How many batches of the current epoch the loop has consumed."""
    value = getattr(loop, "batch_in_epoch", None)
    if value is None:
        value = getattr(loop, "_batch_in_epoch", 0)
    return int(value) if isinstance(value, int) else 0


class TimerStats:
    """Running time statistics of a run, published by :class:`TimerHook`.

    The sums cover the :class:`~ftrain.events.StepEnd` events of this run
    after the first ``skip_first_k`` optimizer updates (warm-up: compilation,
    worker start-up, cudnn autotuning). ``n`` counts those events
    (micro-batches), ``updates`` the optimizer updates among them. They are
    read from the loop's own running sums (:class:`~ftrain.timing.StepTiming`),
    so timing costs no per-step hook work.

    A consumer that wants averages over its own window (the logger's
    logging interval) keeps a :meth:`mark` and asks for :meth:`since` it.

    Example:
        >>> stats = TimerStats()
        >>> stats.add(0.01, 0.10, True); stats.add(0.03, 0.30, True)
        >>> stats.data_time_avg, round(stats.update_time_avg, 3)
        (0.02, 0.2)
        >>> mark = stats.mark(); stats.add(0.0, 0.5, True)
        >>> stats.since(mark)["iter_time"]
        0.5
    """

    __slots__ = ("_sums", "_base", "_loop", "_start", "_offset", "_stopped", "_per_epoch")

    def __init__(
        self,
        loop: Any = None,
        elapsed: float = 0.0,
        sums: StepTiming | None = None,
        *,
        counting: bool = True,
    ) -> None:
        self._sums = sums if sums is not None else StepTiming()
        # None: still in the warm-up, nothing counted until restart()
        self._base: tuple[int, int, float, float] | None = (
            self._sums.snapshot() if counting else None
        )
        self.loop = loop  # held weakly: the loop holds these stats (loop.info["timer"])
        self._offset = float(elapsed)
        self._start = time.perf_counter()
        self._stopped: float | None = None
        self._per_epoch: Any = _UNKNOWN

    @property
    def loop(self) -> Any:
        """The loop timed (``None`` when none, or once it is gone)."""
        return None if self._loop is None else self._loop()

    @loop.setter
    def loop(self, loop: Any) -> None:
        if loop is None:
            self._loop = None
            return
        try:
            self._loop = weakref.ref(loop)
        except TypeError:  # an object without weak references (a stand-in): hold it
            self._loop = lambda: loop

    def add(self, data_time: float, iter_time: float, is_update: bool) -> None:
        """Count one step (the loop counts its steps itself)."""
        self._sums.add(data_time, iter_time, is_update)

    def restart(self) -> None:
        """Count from now on: what was summed so far (the warm-up) is left out."""
        self._base = self._sums.snapshot()

    @property
    def n(self) -> int:
        """Micro-batches counted."""
        base = self._base
        return 0 if base is None else self._sums.n - base[0]

    @property
    def updates(self) -> int:
        """Optimizer updates counted."""
        base = self._base
        return 0 if base is None else self._sums.updates - base[1]

    @property
    def data_time(self) -> float:
        """Seconds waiting for batches, summed over the counted micro-batches."""
        base = self._base
        return 0.0 if base is None else self._sums.data_time - base[2]

    @property
    def iter_time(self) -> float:
        """Seconds per micro-batch (data, step and hooks), summed."""
        base = self._base
        return 0.0 if base is None else self._sums.iter_time - base[3]

    # ------------------------------------------------------------ averages
    @property
    def data_time_avg(self) -> float | None:
        """Mean seconds waiting for a batch, over the run (``None`` before any step)."""
        n = self.n
        return self.data_time / n if n else None

    @property
    def iter_time_avg(self) -> float | None:
        """Mean seconds per micro-batch (data, step and hooks), over the run."""
        n = self.n
        return self.iter_time / n if n else None

    @property
    def update_time_avg(self) -> float | None:
        """Mean seconds per optimizer update (all its micro-batches), over the run."""
        updates = self.updates
        return self.iter_time / updates if updates else None

    def mark(self) -> Mark:
        """The current sums, to compute window averages :meth:`since` later."""
        return (self.n, self.updates, self.data_time, self.iter_time)

    def since(self, mark: Mark | None) -> dict[str, float]:
        """Mean ``data_time`` and ``iter_time`` per micro-batch since ``mark``.

        Empty when no step was counted since then (all were warm-up).
        """
        n0, _, d0, i0 = mark if mark is not None else (0, 0, 0.0, 0.0)
        n = self.n - n0
        if n <= 0:
            return {}
        return {"data_time": (self.data_time - d0) / n, "iter_time": (self.iter_time - i0) / n}

    # ---------------------------------------------------------------- time
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
        """Estimated seconds left, or ``None`` when it cannot be estimated.

        With ``max_steps``: remaining optimizer updates × mean seconds per
        update. With ``epochs`` and data of known length: remaining batches
        × mean seconds per batch. When both are set, the sooner end wins.
        """
        loop = self.loop
        if loop is None:
            return None
        state = loop.state
        estimates = []
        max_steps = getattr(loop, "max_steps", None)
        if max_steps is not None and self.updates:
            remaining = max(max_steps - state.step, 0)
            estimates.append(remaining * self.iter_time / self.updates)
        epochs = getattr(loop, "epochs", None)
        if epochs is not None and self.n:
            per_epoch = self._per_epoch
            if per_epoch is _UNKNOWN:  # asked once per run (len() can be slow, or raise)
                per_epoch = self._per_epoch = batches_per_epoch(getattr(loop, "data", None))
            if per_epoch is not None:
                done = state.epoch * per_epoch + batch_in_epoch(loop)
                remaining = max(epochs * per_epoch - done, 0)
                estimates.append(remaining * self.iter_time / self.n)
        return min(estimates) if estimates else None

    def summary(self) -> dict[str, float | None]:
        """Run-wide averages, elapsed time and ETA as one dict.

        Example:
            >>> sorted(TimerStats().summary())
            ['data_time', 'elapsed', 'eta', 'iter_time', 'update_time']
        """
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
    """Time each step; publish averages, elapsed time and ETA in ``loop.info["timer"]``.

    The loop sums every step's ``data_time`` and ``iter_time`` itself; the
    hook needs one ``StepEnd``, where the warm-up ends. The first ``skip_first_k`` optimizer updates of each
    run (with their micro-batches) are left out of the statistics, since
    warm-up steps are slow. Elapsed time is saved with checkpoints, so it
    keeps counting across a resume.

    Runs at priority ``NORMAL`` (like MMEngine's ``IterTimerHook``), before
    the logger (``BELOW_NORMAL``) that reads it.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> timer = TimerHook(skip_first_k=1)
        >>> lp = ftrain.loop(step, state, [torch.ones(4, 2)] * 5, hooks=[timer], max_steps=5)
        >>> _ = lp.run()
        >>> stats = lp.info["timer"]
        >>> stats.updates, stats.eta
        (4, 0.0)
    """

    priority = "NORMAL"
    name = "timer"

    def __init__(self, skip_first_k: int = 5) -> None:
        if isinstance(skip_first_k, bool) or not isinstance(skip_first_k, int) or skip_first_k < 0:
            raise ValueError(
                f"TimerHook: skip_first_k must be a whole number >= 0, got {skip_first_k!r}."
            )
        self.skip_first_k = skip_first_k
        self._elapsed = 0.0
        self._warm_until = -1
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
        if self.stats is not None:  # loaded while not running: restart from the saved time
            self.stats = None

    def next_step(self, step: int) -> int | None:
        """The update whose ``StepEnd`` ends the warm-up (then none): see :mod:`ftrain.hooks.base`."""
        return self._warm_until if self._warm_until > step else None

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        warm = self.skip_first_k > 0
        stats = TimerStats(loop, self._elapsed, getattr(loop, "timing", None), counting=not warm)
        self.stats = stats
        loop.info["timer"] = stats
        # The loop sums every step's times itself; this hook marks where the warm-up
        # (the run's first skip_first_k updates) ends, and stops the clock while the
        # run is paused.
        self._warm_until = until = first.state.step + self.skip_first_k if warm else -1
        try:
            yield first
            for ev in events:
                kind = type(ev)
                if kind is StepEnd and warm and ev.is_update and ev.state.step >= until:
                    stats.restart()  # the sums so far include this update: left out
                    self._warm_until = -1
                    warm = False
                elif kind is Paused:
                    stats.stop()
                    yield ev
                    stats.resume()  # run() continued
                    continue
                yield ev
        finally:
            self._warm_until = -1
            stats.stop()
            self._elapsed = stats.elapsed
