"""Small hooks: invalid-loss check, empty CUDA cache, early stopping.

* :class:`InvalidLossHook`: MMEngine ``CheckInvalidLossHook``.
* :class:`EmptyCacheHook`: MMEngine ``EmptyCacheHook``.
* :class:`EarlyStoppingHook`: MMEngine ``EarlyStoppingHook`` (on the
  :class:`~ftrain.events.Evaluated` events of an evaluation hook).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ftrain.events import EpochBegin, EpochEnd, Evaluated, Event, StepEnd
from ftrain.hooks.rules import infer_mode

__all__ = ["InvalidLossHook", "EmptyCacheHook", "EarlyStoppingHook"]


def _whole(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be a whole number >= {minimum}, got {value!r}.")
    return value


class InvalidLossHook:
    """Raise ``FloatingPointError`` when the loss is NaN or infinite.

    Every ``interval`` optimizer updates (a ``StepEnd`` with ``is_update``
    and ``state.step % interval == 0``) the step's ``metrics[key]`` is
    checked with ``torch.isfinite``: that one ``.item()`` is the hook's only
    host synchronisation, so a large interval keeps the loop asynchronous.
    The error names the step, the range of steps where the loss first went
    bad, and what to do.

    To stop *before* a bad update touches the weights (and skip or raise at
    the exact step), use the step transform
    :func:`ftrain.with_nonfinite_check` instead; this hook is the cheap
    periodic check of MMEngine's ``CheckInvalidLossHook``.

    Runs at priority ``HIGH``: before the EMA, evaluation, logger and
    checkpoint hooks see the broken step.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).mean() * b.sum())
        >>> data = [torch.ones(1, 2), torch.full((1, 2), float("nan"))]
        >>> ftrain.Loop(step, state, data, hooks=[InvalidLossHook(interval=1)]).run()
        Traceback (most recent call last):
        ...
        FloatingPointError: The loss is nan at step 2 ...
    """

    priority = "HIGH"
    name = "invalid_loss"

    def __init__(self, interval: int = 50, *, key: str = "loss") -> None:
        self.interval = _whole(interval, "InvalidLossHook: interval", 1)
        if not isinstance(key, str) or not key:
            raise ValueError(f"InvalidLossHook: key must be a metric name, got {key!r}.")
        self.key = key

    def __repr__(self) -> str:
        return f"InvalidLossHook(interval={self.interval}, key={self.key!r})"

    def check(self, metrics: Mapping[str, Any], step: int) -> None:
        """Raise ``FloatingPointError`` if ``metrics[key]`` is not finite."""
        if self.key not in metrics:
            raise KeyError(
                f"InvalidLossHook: the step's metrics have no {self.key!r} (they have "
                f"{sorted(metrics)}); pass key= the name of the loss metric."
            )
        loss = metrics[self.key]
        if isinstance(loss, torch.Tensor):
            finite = bool(torch.isfinite(loss.detach()).all())  # the one host sync
        else:
            finite = math.isfinite(float(loss))
        if finite:
            return
        value = loss.detach().float().reshape(-1)[0].item() if torch.is_tensor(loss) else loss
        since = max(step - self.interval + 1, 1)
        where = f"at step {step}" if since == step else f"between step {since} and step {step}"
        raise FloatingPointError(
            f"The loss is {value} at step {step} (checked every {self.interval} updates, so it "
            f"went bad {where}); the weights are probably NaN now. Fixes: lower the learning "
            "rate or warm it up, clip gradients (ftrain.with_clip), check the data for "
            "NaN/inf, use fp16 with a loss scale (ftrain.with_amp) or bf16; to stop before a bad "
            "update is applied use ftrain.with_nonfinite_check(step). Resume from the last good "
            "checkpoint."
        )

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        interval, check = self.interval, self.check
        for ev in events:
            if type(ev) is StepEnd and ev.is_update and ev.state.step % interval == 0:
                if ev.batch is None and self.key not in ev.metrics:
                    pass  # a partial window applied at the epoch's end: no new loss
                else:
                    check(ev.metrics, ev.state.step)
            yield ev


def _no_steps(step: int) -> None:
    return None


class EmptyCacheHook:
    """Release cached CUDA memory (``torch.cuda.empty_cache``) at chosen points.

    By default after each epoch (MMEngine's ``EmptyCacheHook``); also
    ``before_epoch`` and ``after_step`` (after each optimizer update:
    slow, use to debug fragmentation). Without CUDA it does nothing.

    Example:
        >>> EmptyCacheHook(after_step=True)
        EmptyCacheHook(before_epoch=False, after_step=True, after_epoch=True)
    """

    priority = "NORMAL"
    name = "empty_cache"

    def __init__(
        self, after_epoch: bool = True, after_step: bool = False, before_epoch: bool = False
    ) -> None:
        for what, value in (
            ("after_epoch", after_epoch),
            ("after_step", after_step),
            ("before_epoch", before_epoch),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"EmptyCacheHook: {what} must be True or False, got {value!r}.")
        self.after_epoch = after_epoch
        self.after_step = after_step
        self.before_epoch = before_epoch

    def __repr__(self) -> str:
        return (
            f"EmptyCacheHook(before_epoch={self.before_epoch}, after_step={self.after_step}, "
            f"after_epoch={self.after_epoch})"
        )

    @property
    def next_step(self) -> Any:
        """Every update with ``after_step``; else no ``StepEnd`` at all."""
        return None if self.after_step else _no_steps

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        kinds: tuple[type, ...] = ()
        if self.before_epoch:
            kinds += (EpochBegin,)
        if self.after_epoch:
            kinds += (EpochEnd,)
        if not torch.cuda.is_available() or not (kinds or self.after_step):
            yield from events
            return
        after_step, empty = self.after_step, torch.cuda.empty_cache
        for ev in events:
            kind = type(ev)
            if kind is StepEnd:
                if after_step and ev.is_update:
                    empty()
            elif kind in kinds:
                empty()
            yield ev


class EarlyStoppingHook:
    """Stop the run when an evaluation metric stops improving.

    Listens to :class:`~ftrain.events.Evaluated` events (from an
    :class:`~ftrain.hooks.evaluation.EvalHook` of higher priority). A value
    improves on the best so far when it is larger by at least ``min_delta``
    (``mode="max"``) or smaller by at least ``min_delta`` (``mode="min"``)
    (with ``min_delta=0``: when it is strictly better); the first finite
    value always does. After ``patience`` evaluations in a row without
    improvement it calls ``loop.request_stop(reason)``: the loop then ends
    normally (``RunEnd``, final checkpoint). A non-finite value (NaN, inf)
    counts as no improvement, or, with ``check_finite=True``, stops the run
    at once. With ``stopping_threshold``, a value better than it stops the
    run at once (the goal is reached).

    ``mode`` is inferred from the name when omitted, by MMEngine's rule
    (:func:`ftrain.hooks.rules.infer_mode`: case-insensitive; ``acc``,
    ``mAP``... → max, ``loss`` → min). The best value and the count are
    saved with checkpoints, so a resumed run keeps counting.

    MMEngine's ``EarlyStoppingHook(monitor, rule, min_delta=0.1,
    check_finite=True, patience=5, stopping_threshold=None)`` differs only
    in its defaults: ``EarlyStoppingHook(monitor, min_delta=0.1,
    check_finite=True)`` here decides exactly as MMEngine 0.10.7 does
    (``value >= best + 0.1`` improves, for ``greater``). ftrain's defaults
    are ``min_delta=0`` (MMEngine's 0.1 is an absolute change, too large
    for an accuracy in [0, 1]) and ``check_finite=False``.

    Example:
        >>> hook = EarlyStoppingHook("val/acc", patience=2)
        >>> [hook.observe(v) for v in (0.5, 0.6, 0.6, float("nan"))]
        [False, False, False, True]
        >>> hook.best, hook.wait
        (0.6, 2)
    """

    priority = "LOWEST"
    name = "early_stopping"

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
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"EarlyStoppingHook: metric must be a metric name, got {metric!r}.")
        if mode is None:
            mode = infer_mode(metric)
        if mode not in ("max", "min"):
            raise ValueError(f"EarlyStoppingHook: mode must be 'max' or 'min', got {mode!r}.")
        self.patience = _whole(patience, "EarlyStoppingHook: patience", 1)
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, numbers.Real)
            or not math.isfinite(min_delta)
            or min_delta < 0
        ):
            raise ValueError(
                f"EarlyStoppingHook: min_delta must be a number >= 0 (the smallest change that "
                f"counts as an improvement), got {min_delta!r}."
            )
        self.metric = metric
        self.mode = mode
        self.min_delta = float(min_delta)
        self.strict = strict
        if not isinstance(check_finite, bool):
            raise TypeError(
                f"EarlyStoppingHook: check_finite must be True or False, got {check_finite!r}."
            )
        self.check_finite = check_finite
        if stopping_threshold is not None:
            stopping_threshold = float(stopping_threshold)
        self.stopping_threshold = stopping_threshold
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
        self.best = saved.get("best")
        self.best_step = saved.get("best_step")
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

    def next_step(self, step: int) -> None:
        """None: this hook acts on ``Evaluated`` events only."""
        return None

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        metric = self.metric
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
                    raise KeyError(
                        f"EarlyStoppingHook: no {metric!r} in the evaluation metrics "
                        f"{sorted(ev.metrics)}."
                    )
                elif not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"EarlyStoppingHook: no {metric!r} in the evaluation metrics "
                        f"{sorted(ev.metrics)}; ignoring evaluations without it.",
                        stacklevel=2,
                    )
            yield ev
