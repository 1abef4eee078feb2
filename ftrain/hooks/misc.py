"""Small hooks: :class:`EmptyCacheHook`, :class:`EarlyStoppingHook` (MMEngine's names).
MMEngine's ``CheckInvalidLossHook`` is the step transform :func:`ftrain.with_nonfinite_check`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ftrain._checks import flag, number, whole
from ftrain.events import EpochBegin, EpochEnd, Evaluated, Event, StepEnd
from ftrain.hooks.base import EmitsEvents
from ftrain.hooks.cadence import Every
from ftrain.hooks.rules import infer_mode, missing_metric

if TYPE_CHECKING:
    from ftrain.run import Run

__all__ = ["EmptyCacheHook", "EarlyStoppingHook"]


class EmptyCacheHook:
    """Release cached CUDA memory (``torch.cuda.empty_cache``) after each epoch (default),
    before each, or after each update (``after_step``: slow, to debug fragmentation; its
    ``cadence`` is then every update, else none). Without CUDA it does nothing.

    Example:
        >>> EmptyCacheHook(after_step=True)
        EmptyCacheHook(before_epoch=False, after_step=True, after_epoch=True)
    """

    priority = "NORMAL"
    name = "empty_cache"

    def __init__(
        self, after_epoch: bool = True, after_step: bool = False, before_epoch: bool = False
    ) -> None:
        flags = {"after_epoch": after_epoch, "after_step": after_step, "before_epoch": before_epoch}
        for what, value in flags.items():
            flag(f"EmptyCacheHook: {what}", value)
        self.after_epoch, self.after_step, self.before_epoch = after_epoch, after_step, before_epoch
        self.cadence = Every(steps=1) if after_step else Every()

    def __repr__(self) -> str:
        return (
            f"EmptyCacheHook(before_epoch={self.before_epoch}, after_step={self.after_step}, "
            f"after_epoch={self.after_epoch})"
        )

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        kinds = {
            EpochBegin: self.before_epoch,
            EpochEnd: self.after_epoch,
            StepEnd: self.after_step,
        }
        if not torch.cuda.is_available() or not any(kinds.values()):
            yield from events
            return
        for ev in events:
            if kinds.get(type(ev)) and (type(ev) is not StepEnd or ev.is_update):
                torch.cuda.empty_cache()
            yield ev


def _check_metric(metric: object, mode: object) -> tuple[str, str]:
    """``EarlyStoppingHook``'s metric name and its mode (inferred from the name when ``None``)."""
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"EarlyStoppingHook: metric must be a metric name, got {metric!r}.")
    mode = infer_mode(metric) if mode is None else mode
    if mode not in ("max", "min"):
        raise ValueError(f"EarlyStoppingHook: mode must be 'max' or 'min', got {mode!r}.")
    return metric, mode


class EarlyStoppingHook:
    """Stop the run when an evaluation metric stops improving.

    On ``Evaluated`` events: a value improves when better by at least ``min_delta``
    (strictly, with 0). ``patience`` evaluations in a row without improvement call
    ``loop.request_stop(reason)``. NaN/inf is no improvement (``check_finite=True``: stop at
    once); a value better than ``stopping_threshold`` stops at once. ``mode``:
    :func:`~ftrain.hooks.rules.infer_mode`. A missing ``metric`` warns once (``strict=True``:
    ``KeyError``). MMEngine's defaults are ``min_delta=0.1, check_finite=True``. A run
    where no hook declares it emits ``Evaluated`` (:class:`~ftrain.hooks.base.EmitsEvents`:
    ``EvalHook`` does) warns when it starts: this hook would never stop it.

    Example:
        >>> hook = EarlyStoppingHook("val/acc", patience=2)
        >>> [hook.observe(v) for v in (0.5, 0.6, 0.6, float("nan"))]
        [False, False, False, True]
        >>> hook.best, hook.wait
        (0.6, 2)
    """

    priority = "LOWEST"
    name = "early_stopping"
    cadence = Every()  # Evaluated events only

    def __init__(
        self,
        metric: str,
        mode: str | None = None,
        patience: int = 5,
        min_delta: float = 0.0,
        *,
        strict: bool = False,
        check_finite: bool = False,
        stopping_threshold: float | None = None,
    ) -> None:
        self.metric, self.mode = _check_metric(metric, mode)
        self.patience = whole("EarlyStoppingHook: patience", patience, 1)
        self.min_delta = number(
            "EarlyStoppingHook: min_delta", min_delta, 0,
            why="the smallest change that counts as an improvement",
        )  # fmt: skip
        self.strict = flag("EarlyStoppingHook: strict", strict)
        self.check_finite = flag("EarlyStoppingHook: check_finite", check_finite)
        self.stopping_threshold = number(
            "EarlyStoppingHook: stopping_threshold", stopping_threshold, none=True,
            why=f"stop once {metric} is better than it",
        )  # fmt: skip
        self._stop_now: str | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self._warned = False

    def __repr__(self) -> str:
        return (
            f"EarlyStoppingHook({self.metric!r}, mode={self.mode!r}, patience={self.patience}, "
            f"min_delta={self.min_delta}, best={self.best}, wait={self.wait})"
        )

    def improves(self, value: float) -> bool:
        """Whether ``value`` improves on the best so far (NaN/inf never does)."""
        if not math.isfinite(value):
            return False
        best = self.best
        if best is None:
            return True
        delta = self.min_delta
        # MMEngine's test, written as it is: no improvement when best +/- delta is still
        # better than the value (so a change of exactly min_delta improves)
        if self.mode == "max":
            return not (best + delta > value) and (delta > 0 or value > best)
        return not (best - delta < value) and (delta > 0 or value < best)

    def observe(self, value: float, step: int | None = None) -> bool:
        """Record one evaluation; return True when the run should stop."""
        value = float(value)
        self._stop_now = None
        if self.check_finite and not math.isfinite(value):
            self._stop_now = f"early stopping: {self.metric} is {value} (check_finite=True)"
            return True
        threshold = self.stopping_threshold
        if threshold is not None and math.isfinite(value):
            if value > threshold if self.mode == "max" else value < threshold:
                self.best, self.best_step = value, step
                self._stop_now = (
                    f"early stopping: {self.metric} = {value:.6g} reached the stopping "
                    f"threshold {threshold:g}"
                )
                return True
        if self.improves(value):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        return self.wait >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.best, self.best_step = saved.get("best"), saved.get("best_step")
        self.wait = int(saved.get("wait", 0))

    def _reason(self) -> str:
        if self._stop_now is not None:
            return self._stop_now
        best = "no finite value" if self.best is None else f"best {self.best:.6g}"
        if self.best_step is not None:
            best += f" at step {self.best_step}"
        delta = f" by at least {self.min_delta:g}" if self.min_delta else ""
        return (
            f"early stopping: {self.metric} did not improve ({self.mode}){delta} for "
            f"{self.wait} evaluations ({best})"
        )

    def _warn_if_nothing_evaluates(self, run: Run) -> None:
        """At the start: no hook of the run declares it emits ``Evaluated``, so this hook
        would never see its metric, nor stop the run."""
        if any(Evaluated in h.emits for h in run.hooks.of_type(EmitsEvents)):
            return
        warnings.warn(
            f"EarlyStoppingHook({self.metric!r}): no hook of this run evaluates (none declares "
            "it emits Evaluated events), so the run is never stopped early. Add an evaluation, "
            f"e.g. ftrain.EvalHook(evaluate) with evaluate(state) returning {{{self.metric!r}: "
            "...}; a hook of your own that yields Evaluated events declares it with a class "
            "attribute `emits = (ftrain.events.Evaluated,)`.",
            stacklevel=2,
        )

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        metric = self.metric
        first = next(events)  # RunBegin
        self._warn_if_nothing_evaluates(first.run)
        yield first
        for ev in events:
            if type(ev) is Evaluated:
                if metric in ev.metrics:
                    try:
                        value = float(ev.metrics[metric])
                    except (TypeError, ValueError):
                        raise TypeError(
                            f"EarlyStoppingHook: metric {metric!r} must be a number, got "
                            f"{ev.metrics[metric]!r}."
                        ) from None
                    if self.observe(value, ev.state.step):
                        ev.loop.request_stop(self._reason())
                elif self.strict:
                    raise KeyError(missing_metric("EarlyStoppingHook", metric, ev.metrics))
                elif not self._warned:
                    self._warned = True
                    msg = missing_metric("EarlyStoppingHook", metric, ev.metrics)
                    warnings.warn(msg + " Evaluations without it are ignored.", stacklevel=2)
            yield ev
