"""Lower the learning rate when an evaluated metric stops improving (torch's ``ReduceLROnPlateau``).

A :class:`Plateau` is a frozen rule; its :class:`PlateauState` (best value, bad evaluations,
cooldown, each param group's ceiling) lives in the ``TrainState`` and is checkpointed with it.
:func:`~ftrain.transforms.schedule.with_schedule` applies it (``plateau=``): each param group's
learning rate is its schedule's value capped by the group's ceiling, and every evaluation
(``EvalHook``) hands its metrics to the step (:meth:`ftrain.step.Step.observe`), which
updates the state exactly as ``ReduceLROnPlateau.step(metric)`` updates the scheduler.

>>> from ftrain import schedules as S
>>> rule = S.plateau("val_loss", factor=0.5, patience=1)
>>> st = rule.init(groups=1)
>>> for loss in [1.0, 1.0, 1.0]:
...     st = rule.observe(st, loss, current=[min(0.1, c) for c in st.ceilings])
>>> st.ceilings
(0.05,)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["Plateau", "PlateauState", "plateau"]

MODES = ("min", "max")
THRESHOLD_MODES = ("rel", "abs")


@attrs.frozen
class PlateauState:
    """Where a :class:`Plateau` rule stands (``ReduceLROnPlateau``'s fields).

    Attributes:
        best: the best metric so far (``inf`` / ``-inf`` before the first evaluation).
        bad: evaluations since the last improvement (``num_bad_epochs``).
        cooldown: evaluations left in the cooldown (``cooldown_counter``).
        observed: evaluations seen (``last_epoch``).
        ceilings: each param group's learning-rate ceiling (``inf``: not lowered yet).
    """

    best: float
    bad: int = 0
    cooldown: int = 0
    observed: int = 0
    ceilings: tuple[float, ...] = ()


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@attrs.frozen
class Plateau:
    """The plateau rule's settings; build it with :func:`plateau`."""

    metric: str
    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_value: float | tuple[float, ...] = 0.0
    eps: float = 1e-8

    def init(self, groups: int) -> PlateauState:
        """The state before any evaluation, for an optimizer with ``groups`` param groups."""
        if isinstance(self.min_value, tuple) and len(self.min_value) != groups:
            raise ValueError(
                f"plateau(min_value) has {len(self.min_value)} values but the optimizer has "
                f"{groups} param groups; pass one number for all, or one per group."
            )
        best = math.inf if self.mode == "min" else -math.inf
        return PlateauState(best=best, ceilings=(math.inf,) * groups)

    def floor(self, group: int) -> float:
        """The lowest learning rate of param group ``group`` (torch's ``min_lrs[group]``)."""
        return self.min_value[group] if isinstance(self.min_value, tuple) else self.min_value

    def better(self, value: float, best: float) -> bool:
        """Whether ``value`` improves on ``best`` (``ReduceLROnPlateau.is_better``)."""
        if self.threshold_mode == "rel":
            if self.mode == "min":
                return value < best * (1.0 - self.threshold)
            return value > best * (self.threshold + 1.0)
        if self.mode == "min":
            return value < best - self.threshold
        return value > best + self.threshold

    def observe(self, st: PlateauState, value: float, current: Sequence[float]) -> PlateauState:
        """The state after an evaluation gave ``value``; ``current``: each group's learning
        rate now (its schedule's value under its ceiling). Lowers the ceilings as
        ``ReduceLROnPlateau.step(value)`` lowers the learning rates."""
        best, bad = st.best, st.bad + 1
        if self.better(value, best):
            best, bad = value, 0
        cooldown = st.cooldown
        if cooldown > 0:
            cooldown, bad = cooldown - 1, 0
        ceilings = st.ceilings
        if bad > self.patience:
            ceilings = tuple(
                self._lowered(i, lr, c) for i, (lr, c) in enumerate(zip(current, ceilings))
            )
            cooldown, bad = self.cooldown, 0
        return PlateauState(best, bad, cooldown, st.observed + 1, ceilings)

    def _lowered(self, group: int, lr: float, ceiling: float) -> float:
        new = max(lr * self.factor, self.floor(group))
        return new if lr - new > self.eps else ceiling


def plateau(
    metric: str,
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_value: float | Sequence[float] = 0.0,
    eps: float = 1e-8,
) -> Plateau:
    """Multiply the learning rate by ``factor`` once ``metric`` stopped improving for more than
    ``patience`` evaluations: torch's ``ReduceLROnPlateau`` (same arguments; ``min_value`` is
    its ``min_lr``, absolute, one number or one per param group).

    Give it to ``ftrain.with_schedule(step, plateau=...)``; every ``EvalHook`` evaluation
    returning ``metric`` feeds it.

    >>> plateau("val_loss", factor=0.5, patience=2)
    Plateau(metric='val_loss', mode='min', factor=0.5, patience=2, threshold=0.0001, threshold_mode='rel', cooldown=0, min_value=0.0, eps=1e-08)
    """
    floors = tuple(min_value) if isinstance(min_value, Sequence) else min_value
    _check_all(metric, mode, factor, patience, cooldown, threshold, threshold_mode, eps, floors)
    return Plateau(
        metric,
        mode,
        float(factor),
        patience,
        float(threshold),
        threshold_mode,
        cooldown,
        floors,
        float(eps),
    )


def _check_all(metric, mode, factor, patience, cooldown, threshold, threshold_mode, eps, floors):
    if not isinstance(metric, str) or not metric:
        raise ValueError(
            f"plateau(metric) must be the name of an evaluated metric, got {metric!r}; pass "
            "e.g. plateau('val_loss') for a key of the dict your evaluation returns."
        )
    _check(mode in MODES, "mode", mode, f"one of {MODES}", "'min' for a loss, 'max' for accuracy")
    ok = _real(factor) and 0 < factor < 1
    _check(ok, "factor", factor, "in (0, 1)", "the learning rate is multiplied by it, e.g. 0.1")
    for name, value in (("patience", patience), ("cooldown", cooldown)):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        _check(ok, name, value, "a whole number >= 0", "it counts evaluations")
    ok = _real(threshold) and math.isfinite(threshold) and threshold >= 0
    _check(ok, "threshold", threshold, "a number >= 0", "e.g. 1e-4")
    _check(
        threshold_mode in THRESHOLD_MODES, "threshold_mode", threshold_mode, "'rel' or 'abs'", ""
    )
    _check(_real(eps) and eps >= 0, "eps", eps, "a number >= 0", "torch's default is 1e-8")
    for v in floors if isinstance(floors, tuple) else (floors,):
        ok = _real(v) and math.isfinite(v) and v >= 0
        _check(ok, "min_value", floors, "numbers >= 0", "one for all groups or one per group")


def _check(ok: bool, name: str, value: Any, need: str, fix: str) -> None:
    if not ok:
        raise ValueError(
            f"plateau({name}) must be {need}, got {value!r}" + (f"; {fix}" if fix else "")
        )
