"""Learning-rate and momentum schedules: small immutable values, pure in the step.

A schedule is a frozen value you call with a step number; it returns the
*absolute* value (a learning rate, a momentum) at that step:

>>> from ftrain import schedules as S
>>> sched = S.warmup(S.cosine(base=0.1, total=100), iters=10, ratio=0.01)
>>> sched
Warmup(schedule=Cosine(base=0.1, total=100, final=0.0, final_ratio=None), iters=10, ratio=0.01, kind='linear', inverse=False)
>>> round(sched(0), 6), round(sched(50), 6), sched(100)
(0.001, 0.05, 0.0)

Pure in the step
    ``sched(n)`` depends on ``n`` only: nothing is counted, cached or
    mutated, so calling steps out of order, twice, or after a resume gives
    exactly the same value, and there is nothing to save in a checkpoint.
    Schedules are hashable and compare by value.

By iteration or by epoch
    A schedule is a function of a number. Pass the global step for an
    iteration-based schedule. For MMCV's ``by_epoch=True`` policies wrap the
    schedule in :func:`by_epoch`, which turns the global step into the epoch
    index (floor), so the value only changes at epoch boundaries and
    ``total``/``milestones`` count epochs. Warmup counts iterations, as in
    MMCV: put :func:`warmup` *outside* :func:`by_epoch` (for MMCV's
    ``warmup_by_epoch=True`` pass ``iters=warmup_epochs * steps_per_epoch``).

Applying to an optimizer
    :func:`apply_schedules` writes the values into every param group each
    step and keeps the per-group ratios (e.g. a backbone at 0.1x).

MMCV ``lr_config`` / ``momentum_config`` equivalents (``lr`` is the optimizer's
``lr``, ``E`` the steps per epoch, ``T`` the total number of iterations):

* ``policy='fixed'``: ``constant(lr)``
* ``policy='step', step=[8, 11], warmup='linear', warmup_iters=500,
  warmup_ratio=0.001`` (by epoch): ``warmup(by_epoch(multistep(lr, [8, 11]), E),
  iters=500, ratio=0.001)``
* ``policy='step', step=30, gamma=0.5`` (by epoch):
  ``by_epoch(step_decay(lr, 30, gamma=0.5), E)``
* ``policy='exp', gamma=0.99, by_epoch=False``: ``exponential(lr, 0.99)``
* ``policy='poly', power=0.9, min_lr=1e-4, by_epoch=False``:
  ``polynomial(lr, T, power=0.9, min_value=1e-4)``
* ``policy='CosineAnnealing', min_lr_ratio=1e-3`` (by epoch, ``max_epochs``):
  ``by_epoch(cosine(lr, max_epochs, final_ratio=1e-3), E)``
* ``policy='cyclic', target_ratio=(10, 1e-4)``: ``cyclic(lr, T, target_ratio=(10, 1e-4))``
  and ``momentum_config=dict(policy='cyclic')``: ``cyclic_momentum(momentum, T)``
* a momentum ``warmup='linear', warmup_ratio=0.5``:
  ``warmup(momentum_schedule, iters, ratio=0.5, inverse=True)``

Differences from MMCV: :func:`cosine` and :func:`polynomial` hold their final
value after ``total`` (MMCV would rise again / leave the real numbers), and
every bad argument raises :class:`ValueError` naming the argument and the fix.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "Schedule",
    "Constant",
    "StepDecay",
    "MultiStep",
    "Exponential",
    "Cosine",
    "Polynomial",
    "Cyclic",
    "Warmup",
    "Join",
    "ByEpoch",
    "WARMUP_KINDS",
    "ANNEAL_KINDS",
    "constant",
    "step_decay",
    "multistep",
    "exponential",
    "cosine",
    "polynomial",
    "cyclic",
    "cyclic_momentum",
    "warmup",
    "linear_warmup",
    "exponential_warmup",
    "constant_warmup",
    "join",
    "by_epoch",
    "apply_schedules",
]

#: Valid ``kind`` values of :func:`warmup` (MMCV's ``warmup`` names).
WARMUP_KINDS = ("linear", "exp", "constant")
#: Valid ``anneal`` values of :func:`cyclic` (MMCV's ``anneal_strategy``).
ANNEAL_KINDS = ("cos", "linear")

# Keys apply_schedules stores in each param group (saved with optimizer.state_dict()).
LR_INITIAL_KEY = "ftrain_initial_lr"
LR_MULT_KEY = "ftrain_lr_mult"
MOMENTUM_INITIAL_KEY = "ftrain_initial_momentum"
MOMENTUM_MULT_KEY = "ftrain_momentum_mult"


# --------------------------------------------------------------------------- checks


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_finite(value: Any, what: str, fix: str) -> None:
    if not _is_real(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}; {fix}")


def _check_positive(value: Any, what: str, fix: str) -> None:
    if not _is_real(value) or value <= 0:
        raise ValueError(f"{what} must be a number > 0, got {value!r}; {fix}")


def _check_positive_int(value: Any, what: str, fix: str) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be an integer > 0, got {value!r}; {fix}")


def _check_callable(value: Any, what: str) -> None:
    if not callable(value):
        raise ValueError(
            f"{what} must be a schedule (a callable step -> value such as "
            f"ftrain.schedules.constant(0.1)), got {value!r}"
        )


def _as_tuple(value: Any) -> Any:
    """attrs converter: lists become tuples (hashable); anything else is kept for the check."""
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return tuple(value)
    return value


def _anneal_cos(start: float, end: float, frac: float) -> float:
    return end + 0.5 * (start - end) * (math.cos(math.pi * frac) + 1)


def _anneal_linear(start: float, end: float, frac: float) -> float:
    return start + (end - start) * frac


# --------------------------------------------------------------------------- schedules


@attrs.frozen
class Schedule:
    """Base of all schedules: a frozen value, ``schedule(step) -> float``.

    Any callable ``step -> float`` can stand in for a schedule (in :func:`join`,
    :func:`warmup`, :func:`apply_schedules`); subclass this for a readable repr
    and value equality.

    >>> import attrs
    >>> @attrs.frozen
    ... class Halving(Schedule):
    ...     base: float
    ...     def __call__(self, step):
    ...         return self.base / 2 ** step
    >>> Halving(1.0)(3)
    0.125
    """

    def __call__(self, step: int | float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


@attrs.frozen
class Constant(Schedule):
    """The same value at every step. See :func:`constant`."""

    value: float

    def __attrs_post_init__(self) -> None:
        _check_finite(self.value, "constant(value)", "pass the learning rate, e.g. constant(0.1)")

    def __call__(self, step: int | float) -> float:
        return float(self.value)


@attrs.frozen
class StepDecay(Schedule):
    """``base * gamma ** (step // step_size)``, clipped at ``min_value``. See :func:`step_decay`."""

    base: float
    step_size: int | float
    gamma: float = 0.1
    min_value: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_finite(self.base, "step_decay(base)", "pass the initial value, e.g. 0.1")
        _check_positive(
            self.step_size,
            "step_decay(step_size)",
            "it is the number of steps between decays; for decays at given steps use "
            "multistep(base, milestones)",
        )
        _check_positive(self.gamma, "step_decay(gamma)", "use e.g. gamma=0.1 to divide by 10")
        if self.min_value is not None:
            _check_finite(self.min_value, "step_decay(min_value)", "pass a number or None")

    def __call__(self, step: int | float) -> float:
        value = self.base * self.gamma ** (step // self.step_size)
        if self.min_value is not None:
            value = max(value, self.min_value)
        return float(value)


@attrs.frozen
class MultiStep(Schedule):
    """``base * gamma ** (number of milestones <= step)``. See :func:`multistep`."""

    base: float
    milestones: tuple[int | float, ...] = attrs.field(converter=_as_tuple)
    gamma: float = 0.1
    min_value: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_finite(self.base, "multistep(base)", "pass the initial value, e.g. 0.1")
        if not isinstance(self.milestones, tuple) or not self.milestones:
            raise ValueError(
                f"multistep(milestones) must be a non-empty list of steps, got "
                f"{self.milestones!r}; e.g. milestones=[8, 11]"
            )
        for m in self.milestones:
            _check_positive(m, "each multistep milestone", "milestones are steps > 0, e.g. [8, 11]")
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])):
            raise ValueError(
                f"multistep(milestones) must be strictly increasing, got {list(self.milestones)}; "
                "sort them and remove duplicates (to decay twice at one step use gamma**2)"
            )
        _check_positive(self.gamma, "multistep(gamma)", "use e.g. gamma=0.1 to divide by 10")
        if self.min_value is not None:
            _check_finite(self.min_value, "multistep(min_value)", "pass a number or None")

    def __call__(self, step: int | float) -> float:
        value = self.base * self.gamma ** bisect_right(self.milestones, step)
        if self.min_value is not None:
            value = max(value, self.min_value)
        return float(value)


@attrs.frozen
class Exponential(Schedule):
    """``base * gamma ** step``. See :func:`exponential`."""

    base: float
    gamma: float

    def __attrs_post_init__(self) -> None:
        _check_finite(self.base, "exponential(base)", "pass the initial value, e.g. 0.1")
        _check_positive(self.gamma, "exponential(gamma)", "use e.g. gamma=0.99 per step")

    def __call__(self, step: int | float) -> float:
        return float(self.base * self.gamma**step)


@attrs.frozen
class Cosine(Schedule):
    """Half a cosine from ``base`` to the final value over ``total`` steps. See :func:`cosine`."""

    base: float
    total: int | float
    final: float | None = None
    final_ratio: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_finite(self.base, "cosine(base)", "pass the initial value, e.g. 0.1")
        _check_positive(
            self.total, "cosine(total)", "pass the number of steps (or epochs with by_epoch)"
        )
        if self.final is not None and self.final_ratio is not None:
            raise ValueError(
                "cosine() takes final (an absolute value) or final_ratio (a fraction of base), "
                f"not both; got final={self.final!r}, final_ratio={self.final_ratio!r}"
            )
        if self.final is not None:
            _check_finite(self.final, "cosine(final)", "pass e.g. final=0.0")
        if self.final_ratio is not None:
            _check_finite(self.final_ratio, "cosine(final_ratio)", "pass e.g. final_ratio=1e-3")

    def __call__(self, step: int | float) -> float:
        if self.final_ratio is not None:
            target = self.base * self.final_ratio
        else:
            target = self.final if self.final is not None else 0.0
        return float(_anneal_cos(self.base, target, min(step, self.total) / self.total))


@attrs.frozen
class Polynomial(Schedule):
    """``(base - min_value) * (1 - step/total) ** power + min_value``. See :func:`polynomial`."""

    base: float
    total: int | float
    power: float = 1.0
    min_value: float = 0.0

    def __attrs_post_init__(self) -> None:
        _check_finite(self.base, "polynomial(base)", "pass the initial value, e.g. 0.01")
        _check_positive(
            self.total, "polynomial(total)", "pass the number of steps (or epochs with by_epoch)"
        )
        if not _is_real(self.power) or self.power < 0:
            raise ValueError(
                f"polynomial(power) must be a number >= 0, got {self.power!r}; "
                "use power=1.0 for a linear decay, 0.9 as in MMCV's poly configs"
            )
        _check_finite(self.min_value, "polynomial(min_value)", "pass e.g. min_value=0.0")

    def __call__(self, step: int | float) -> float:
        coeff = (1 - min(step, self.total) / self.total) ** self.power
        return float((self.base - self.min_value) * coeff + self.min_value)


def _target_ratio(value: Any) -> Any:
    """attrs converter with MMCV's rules: ``r`` or ``(r,)`` means ``(r, r / 1e5)``."""
    if _is_real(value):
        return (value, value / 1e5)
    value = _as_tuple(value)
    if isinstance(value, tuple) and len(value) == 1 and _is_real(value[0]):
        return (value[0], value[0] / 1e5)
    return value


@attrs.frozen
class Cyclic(Schedule):
    """MMCV's ``CyclicLrUpdaterHook`` / ``CyclicMomentumUpdaterHook``. See :func:`cyclic`."""

    base: float
    total: int
    target_ratio: tuple[float, float] = attrs.field(default=(10, 1e-4), converter=_target_ratio)
    cyclic_times: int = 1
    step_ratio_up: float = 0.4
    anneal: str = "cos"
    gamma: float = 1.0

    def __attrs_post_init__(self) -> None:
        _check_finite(self.base, "cyclic(base)", "pass the initial value, e.g. 1e-3")
        _check_positive_int(self.total, "cyclic(total)", "pass the total number of iterations")
        _check_positive_int(self.cyclic_times, "cyclic(cyclic_times)", "use e.g. cyclic_times=1")
        if self.total < self.cyclic_times:
            raise ValueError(
                f"cyclic(total={self.total}) must be >= cyclic_times={self.cyclic_times} "
                "(each cycle needs at least one step); lower cyclic_times"
            )
        tr = self.target_ratio
        if not (isinstance(tr, tuple) and len(tr) == 2 and all(_is_real(r) for r in tr)):
            raise ValueError(
                f"cyclic(target_ratio) must be a number or a pair (peak_ratio, final_ratio), "
                f"got {tr!r}; e.g. target_ratio=(10, 1e-4)"
            )
        if not _is_real(self.step_ratio_up) or not 0 <= self.step_ratio_up < 1:
            raise ValueError(
                f"cyclic(step_ratio_up) must be in [0, 1), got {self.step_ratio_up!r}; it is the "
                "fraction of each cycle spent going up, e.g. 0.4"
            )
        if self.anneal not in ANNEAL_KINDS:
            raise ValueError(f"cyclic(anneal) must be one of {ANNEAL_KINDS}, got {self.anneal!r}")
        if not _is_real(self.gamma) or not 0 < self.gamma <= 1:
            raise ValueError(
                f"cyclic(gamma) must be in (0, 1], got {self.gamma!r}; it shrinks the peak of "
                "each later cycle, use gamma=1.0 for identical cycles"
            )

    def __call__(self, step: int | float) -> float:
        phase = self.total // self.cyclic_times
        up = int(self.step_ratio_up * phase)
        cycle, pos = divmod(step, phase)
        scale = self.gamma**cycle
        peak = 1 - scale + self.target_ratio[0] * scale
        anneal = _anneal_cos if self.anneal == "cos" else _anneal_linear
        if pos < up:
            return float(anneal(self.base, self.base * peak, pos / up))
        return float(
            anneal(self.base * peak, self.base * self.target_ratio[1], (pos - up) / (phase - up))
        )


@attrs.frozen
class Warmup(Schedule):
    """MMCV warmup over the first ``iters`` steps of any schedule. See :func:`warmup`."""

    schedule: Callable[[int | float], float]
    iters: int | float
    ratio: float = 0.1
    kind: str = "linear"
    inverse: bool = False

    def __attrs_post_init__(self) -> None:
        _check_callable(self.schedule, "warmup(schedule)")
        _check_positive(
            self.iters,
            "warmup(iters)",
            "it is the number of warmup iterations; drop the warmup() wrapper for none",
        )
        if not _is_real(self.ratio) or not 0 < self.ratio <= 1:
            raise ValueError(
                f"warmup(ratio) must be in (0, 1], got {self.ratio!r}; it is the fraction of "
                "the value used at step 0, e.g. ratio=0.001"
            )
        if self.kind not in WARMUP_KINDS:
            raise ValueError(f"warmup(kind) must be one of {WARMUP_KINDS}, got {self.kind!r}")

    def __call__(self, step: int | float) -> float:
        value = self.schedule(step)
        if step >= self.iters:
            return float(value)
        if self.kind == "linear":
            factor = 1 - (1 - step / self.iters) * (1 - self.ratio)
        elif self.kind == "exp":
            factor = self.ratio ** (1 - step / self.iters)
        else:
            factor = self.ratio
        return float(value / factor if self.inverse else value * factor)


@attrs.frozen
class Join(Schedule):
    """Schedules one after another, each restarted at its boundary. See :func:`join`."""

    schedules: tuple[Callable[[int | float], float], ...] = attrs.field(converter=_as_tuple)
    boundaries: tuple[int | float, ...] = attrs.field(converter=_as_tuple)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.schedules, tuple) or not self.schedules:
            raise ValueError(
                f"join(schedules) must be a non-empty list of schedules, got {self.schedules!r}"
            )
        for i, s in enumerate(self.schedules):
            _check_callable(s, f"join(schedules)[{i}]")
        if not isinstance(self.boundaries, tuple):
            raise ValueError(f"join(boundaries) must be a list of steps, got {self.boundaries!r}")
        if len(self.boundaries) != len(self.schedules) - 1:
            raise ValueError(
                f"join() needs one boundary between each pair of schedules: "
                f"{len(self.schedules)} schedules need {len(self.schedules) - 1} boundaries, "
                f"got {len(self.boundaries)}; pass boundaries=[step where schedule 1 starts, ...]"
            )
        for b in self.boundaries:
            _check_positive(
                b,
                "each join boundary",
                "boundaries are the steps > 0 where the next schedule starts",
            )
        if any(b <= a for a, b in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(
                f"join(boundaries) must be strictly increasing, got {list(self.boundaries)}; "
                "sort them and remove duplicates"
            )

    def __call__(self, step: int | float) -> float:
        i = bisect_right(self.boundaries, step)
        if i == 0:
            return float(self.schedules[0](step))
        return float(self.schedules[i](step - self.boundaries[i - 1]))


@attrs.frozen
class ByEpoch(Schedule):
    """Evaluate a schedule at the epoch index ``step // steps_per_epoch``. See :func:`by_epoch`."""

    schedule: Callable[[int | float], float]
    steps_per_epoch: int

    def __attrs_post_init__(self) -> None:
        _check_callable(self.schedule, "by_epoch(schedule)")
        _check_positive_int(
            self.steps_per_epoch,
            "by_epoch(steps_per_epoch)",
            "pass the number of optimizer steps per epoch, e.g. len(loader) // accum_every",
        )

    def __call__(self, step: int | float) -> float:
        return float(self.schedule(int(step // self.steps_per_epoch)))


# --------------------------------------------------------------------------- constructors


def constant(value: float) -> Constant:
    """The same value at every step (MMCV ``policy='fixed'``).

    >>> constant(0.1)(12345)
    0.1
    """
    return Constant(value)


def step_decay(
    base: float, step_size: int | float, gamma: float = 0.1, min_value: float | None = None
) -> StepDecay:
    """Multiply by ``gamma`` every ``step_size`` steps (MMCV ``policy='step', step=int``).

    ``base * gamma ** (step // step_size)``, never below ``min_value`` when given
    (MMCV's ``min_lr``); ``torch.optim.lr_scheduler.StepLR`` without ``min_value``.

    >>> s = step_decay(1.0, step_size=10, gamma=0.5)
    >>> s(9), s(10), s(25)
    (1.0, 0.5, 0.25)
    """
    return StepDecay(base, step_size, gamma, min_value)


def multistep(
    base: float,
    milestones: Sequence[int | float],
    gamma: float = 0.1,
    min_value: float | None = None,
) -> MultiStep:
    """Multiply by ``gamma`` at each milestone (MMCV ``policy='step', step=[...]``).

    The value at ``step`` is ``base * gamma ** k`` with ``k`` the number of
    milestones ``<= step`` (so the decay takes effect *at* the milestone), as
    ``torch.optim.lr_scheduler.MultiStepLR``; never below ``min_value``.

    >>> s = multistep(0.1, milestones=[8, 11])
    >>> s(7), s(8), round(s(11), 6)
    (0.1, 0.010000000000000002, 0.001)
    """
    return MultiStep(base, milestones, gamma, min_value)


def exponential(base: float, gamma: float) -> Exponential:
    """``base * gamma ** step`` (MMCV ``policy='exp'``, ``torch``'s ``ExponentialLR``).

    >>> exponential(1.0, 0.5)(3)
    0.125
    """
    return Exponential(base, gamma)


def cosine(
    base: float,
    total: int | float,
    final: float | None = None,
    final_ratio: float | None = None,
) -> Cosine:
    """Cosine annealing from ``base`` to the final value (MMCV ``CosineAnnealing``).

    ``final + (base - final) * (1 + cos(pi * step / total)) / 2``; the final value
    is ``final`` (default 0, MMCV's ``min_lr``) or ``base * final_ratio`` (MMCV's
    ``min_lr_ratio``) -- give at most one. After ``total`` steps the value stays
    at the final value. Equals ``torch``'s ``CosineAnnealingLR(T_max=total,
    eta_min=final)`` for ``step <= total``.

    >>> s = cosine(base=0.1, total=1000, final_ratio=0.01)
    >>> s(0), round(s(500), 6), round(s(1000), 6), round(s(5000), 6)
    (0.1, 0.0505, 0.001, 0.001)
    """
    if final is None and final_ratio is None:
        final = 0.0
    return Cosine(base, total, final, final_ratio)


def polynomial(
    base: float, total: int | float, power: float = 1.0, min_value: float = 0.0
) -> Polynomial:
    """Polynomial decay to ``min_value`` over ``total`` steps (MMCV ``policy='poly'``).

    ``(base - min_value) * (1 - step / total) ** power + min_value``, then
    ``min_value`` after ``total``; ``torch``'s ``PolynomialLR`` when ``min_value=0``.

    >>> s = polynomial(0.01, total=100, power=2.0)
    >>> s(0), round(s(50), 6), s(100), s(200)
    (0.01, 0.0025, 0.0, 0.0)
    """
    return Polynomial(base, total, power, min_value)


def cyclic(
    base: float,
    total: int,
    target_ratio: float | tuple[float, float] = (10, 1e-4),
    cyclic_times: int = 1,
    step_ratio_up: float = 0.4,
    anneal: str = "cos",
    gamma: float = 1.0,
) -> Cyclic:
    """Cyclic schedule of MMCV's ``CyclicLrUpdaterHook`` (``policy='cyclic'``).

    ``total`` iterations are split into ``cyclic_times`` cycles of
    ``phase = total // cyclic_times`` steps (a remainder starts a new cycle). In
    each cycle the value anneals (``anneal='cos'`` or ``'linear'``) from ``base``
    up to ``base * target_ratio[0]`` during the first
    ``int(step_ratio_up * phase)`` steps, then down to ``base * target_ratio[1]``.
    A single number ``r`` means ``(r, r / 1e5)``. With ``gamma < 1`` the peak of
    cycle ``c`` shrinks to ``1 + (target_ratio[0] - 1) * gamma ** c`` times ``base``.

    >>> s = cyclic(base=0.02, total=10, target_ratio=(10, 1))
    >>> round(s(0), 6), round(s(4), 6), round(s(6), 6), round(s(9), 6)
    (0.02, 0.2, 0.155, 0.032058)
    """
    return Cyclic(base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma)


def cyclic_momentum(
    base: float,
    total: int,
    target_ratio: float | tuple[float, float] = (0.85 / 0.95, 1),
    cyclic_times: int = 1,
    step_ratio_up: float = 0.4,
    anneal: str = "cos",
    gamma: float = 1.0,
) -> Cyclic:
    """The momentum companion of :func:`cyclic` (MMCV's ``CyclicMomentumUpdaterHook``).

    Same shape as :func:`cyclic` with MMCV's momentum defaults: while the
    learning rate rises the momentum falls to ``base * 0.85 / 0.95`` and comes
    back to ``base``. Use the same ``total``, ``cyclic_times`` and
    ``step_ratio_up`` as the learning-rate schedule.

    >>> m = cyclic_momentum(base=0.95, total=10)
    >>> m(0), round(m(4), 6), round(m(6), 6)
    (0.95, 0.85, 0.875)
    """
    return Cyclic(base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma)


def warmup(
    schedule: Callable[[int | float], float],
    iters: int | float,
    ratio: float = 0.1,
    kind: str = "linear",
    inverse: bool = False,
) -> Warmup:
    """Warm any schedule up over its first ``iters`` steps, as MMCV's ``warmup=...``.

    The warmed-up value multiplies the schedule's own value ``v = schedule(step)``
    (the schedule is *not* shifted; from ``step >= iters`` on it is ``v``):

    * ``kind='linear'``: ``v * (1 - (1 - step / iters) * (1 - ratio))``, from
      ``ratio * v`` up to ``v`` (``torch``'s ``LinearLR(start_factor=ratio)``);
    * ``kind='exp'``: ``v * ratio ** (1 - step / iters)``;
    * ``kind='constant'``: ``v * ratio``.

    ``ratio`` is MMCV's ``warmup_ratio`` in ``(0, 1]``. ``inverse=True`` divides
    by the factor instead, as MMCV's momentum warmup does (momentum starts at
    ``v / ratio`` and comes down to ``v``).

    >>> s = warmup(constant(0.1), iters=10, ratio=0.01)
    >>> round(s(0), 6), round(s(5), 6), s(10)
    (0.001, 0.0505, 0.1)
    >>> round(warmup(constant(0.95), iters=5, ratio=0.5, inverse=True)(0), 6)
    1.9
    """
    return Warmup(schedule, iters, ratio, kind, inverse)


def linear_warmup(
    schedule: Callable[[int | float], float],
    iters: int | float,
    ratio: float = 0.1,
    inverse: bool = False,
) -> Warmup:
    """``warmup(schedule, iters, ratio, kind='linear')``.

    >>> round(linear_warmup(constant(1.0), iters=4, ratio=0.2)(2), 6)
    0.6
    """
    return Warmup(schedule, iters, ratio, "linear", inverse)


def exponential_warmup(
    schedule: Callable[[int | float], float],
    iters: int | float,
    ratio: float = 0.1,
    inverse: bool = False,
) -> Warmup:
    """``warmup(schedule, iters, ratio, kind='exp')``.

    >>> round(exponential_warmup(constant(1.0), iters=4, ratio=0.01)(2), 6)
    0.1
    """
    return Warmup(schedule, iters, ratio, "exp", inverse)


def constant_warmup(
    schedule: Callable[[int | float], float],
    iters: int | float,
    ratio: float = 0.1,
    inverse: bool = False,
) -> Warmup:
    """``warmup(schedule, iters, ratio, kind='constant')``.

    >>> s = constant_warmup(constant(1.0), iters=4, ratio=0.1)
    >>> s(3), s(4)
    (0.1, 1.0)
    """
    return Warmup(schedule, iters, ratio, "constant", inverse)


def join(
    schedules: Sequence[Callable[[int | float], float]], boundaries: Sequence[int | float]
) -> Join:
    """Run schedules one after another, like ``optax.join_schedules``.

    ``schedules[i]`` is used from ``boundaries[i - 1]`` (inclusive) to
    ``boundaries[i]`` and sees the step *relative to its start*,
    ``step - boundaries[i - 1]``; the first sees the step itself. There is one
    boundary fewer than schedules.

    >>> s = join([constant(0.0), exponential(1.0, 0.5)], boundaries=[10])
    >>> s(9), s(10), s(12)
    (0.0, 1.0, 0.25)
    """
    return Join(schedules, boundaries)


def by_epoch(schedule: Callable[[int | float], float], steps_per_epoch: int) -> ByEpoch:
    """Make a schedule epoch-based: it sees ``step // steps_per_epoch`` (MMCV ``by_epoch=True``).

    The wrapped schedule's ``total``, ``milestones``, ``step_size`` count
    epochs, and the value changes only at epoch boundaries (the first step of
    an epoch), exactly as MMCV's epoch-based updaters, which set the value in
    ``before_train_epoch``. ``steps_per_epoch`` is the number of *optimizer
    steps* per epoch (divide by the accumulation window if you use one). Wrap
    the result in :func:`warmup` for MMCV's per-iteration warmup.

    >>> s = by_epoch(multistep(0.1, milestones=[2]), steps_per_epoch=100)
    >>> s(0), s(199), round(s(200), 6)
    (0.1, 0.1, 0.01)
    """
    return ByEpoch(schedule, steps_per_epoch)


# --------------------------------------------------------------------------- optimizer


def _momentum_key(group: dict[str, Any], optimizer: Any) -> str:
    if "momentum" in group:
        return "momentum"
    if "betas" in group:
        return "betas"
    raise ValueError(
        f"{type(optimizer).__name__} has no momentum: its param groups have neither "
        "'momentum' (SGD, RMSprop) nor 'betas' (Adam-type); pass momentum=None"
    )


def _read_momentum(group: dict[str, Any], key: str) -> float:
    return float(group["betas"][0]) if key == "betas" else float(group["momentum"])


def _init_mult(
    groups: list[dict[str, Any]],
    group: dict[str, Any],
    read: Callable[[dict[str, Any]], float],
    initial_key: str,
    mult_key: str,
    what: str,
) -> float:
    """First application to ``group``: its multiplier is its initial value over group 0's."""
    reference = groups[0].setdefault(initial_key, read(groups[0]))
    own = group.setdefault(initial_key, read(group))
    if reference != 0:
        mult = own / reference
    elif own == 0:
        mult = 1.0
    else:
        raise ValueError(
            f"param group 0 has {what}=0, so the {what} multiplier of a group with "
            f"{what}={own} is undefined; set group[{mult_key!r}] in each param group "
            "(e.g. 1.0 for group 0, 0.1 for a backbone) before apply_schedules"
        )
    group[mult_key] = mult
    return mult


def _write(group: dict[str, Any], key: str, value: float) -> None:
    current = group[key]
    if isinstance(current, torch.Tensor):  # tensor lr/betas (fused, capturable, compiled)
        current.fill_(value)
    else:
        group[key] = value


def apply_schedules(
    optimizer: torch.optim.Optimizer,
    step: int,
    lr: Callable[[int | float], float] | None = None,
    momentum: Callable[[int | float], float] | None = None,
) -> dict[str, float]:
    """Set ``lr`` (and ``momentum``) of every param group from schedules at ``step``.

    Call it before each optimizer step (``step`` is the number of updates done
    so far, e.g. ``state.step``). It is cheap: one schedule call per schedule
    and a float multiply per group, no tensor operations (a tensor ``lr`` or
    ``betas[0]`` is updated in place with ``fill_`` so it keeps its identity).

    Momentum is ``group['momentum']`` (SGD, RMSprop) or ``group['betas'][0]``
    (Adam, AdamW, NAdam, ...); an optimizer with neither raises ValueError.

    Per-group ratios: the schedule's value goes to param group 0; every other
    group gets it times its multiplier. The first time a group is seen its
    multiplier is its value then divided by group 0's value then (so groups
    built with ``lr=1e-3`` and ``lr=1e-4`` stay 10x apart) and is stored in
    the group as ``'ftrain_lr_mult'`` / ``'ftrain_momentum_mult'`` (with the
    initial values in ``'ftrain_initial_lr'`` / ``'ftrain_initial_momentum'``).
    These keys are saved by ``optimizer.state_dict()``, so a resumed run keeps
    the ratios; set ``'ftrain_lr_mult'`` in a group yourself to choose it.

    Returns the scheduled values (those of group 0), for logging.

    >>> import torch
    >>> w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.01}], lr=0.1, momentum=0.9)
    >>> apply_schedules(opt, 500, lr=cosine(0.1, total=1000), momentum=constant(0.85))
    {'lr': 0.05, 'momentum': 0.85}
    >>> [round(g["lr"], 6) for g in opt.param_groups], [g["momentum"] for g in opt.param_groups]
    ([0.05, 0.005], [0.85, 0.85])
    """
    groups = optimizer.param_groups
    applied: dict[str, float] = {}
    if lr is not None:
        _check_callable(lr, "apply_schedules(lr)")
        value = float(lr(step))
        for group in groups:
            mult = group.get(LR_MULT_KEY)
            if mult is None:
                mult = _init_mult(
                    groups, group, lambda g: float(g["lr"]), LR_INITIAL_KEY, LR_MULT_KEY, "lr"
                )
            _write(group, "lr", value * mult)
        applied["lr"] = value
    if momentum is not None:
        _check_callable(momentum, "apply_schedules(momentum)")
        value = float(momentum(step))
        for group in groups:
            key = _momentum_key(group, optimizer)
            mult = group.get(MOMENTUM_MULT_KEY)
            if mult is None:
                mult = _init_mult(
                    groups,
                    group,
                    lambda g: _read_momentum(g, _momentum_key(g, optimizer)),
                    MOMENTUM_INITIAL_KEY,
                    MOMENTUM_MULT_KEY,
                    "momentum",
                )
            if key == "momentum":
                _write(group, "momentum", value * mult)
            else:
                betas = group["betas"]
                if isinstance(betas[0], torch.Tensor):
                    betas[0].fill_(value * mult)
                else:
                    group["betas"] = (value * mult, *betas[1:])
        applied["momentum"] = value
    return applied
