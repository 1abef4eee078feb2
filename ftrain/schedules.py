"""Learning-rate, momentum and weight-decay schedules: small immutable values, pure in the step.

Each schedule has one name, a lowercase function returning a :class:`Schedule`:
a frozen, hashable, printable value you call with a step number to get the
*absolute* value (a learning rate, a momentum) at that step. Schedules compose
(:func:`warmup`, :func:`join`, :func:`by_epoch` take schedules); any callable
``step -> float`` can stand in for one.

>>> from ftrain import schedules as S
>>> sched = S.warmup(S.cosine(base=0.1, total=100), iters=10, ratio=0.01)
>>> sched
warmup(schedule=cosine(base=0.1, total=100, final=0.0), iters=10, ratio=0.01, kind='linear', inverse=False)
>>> round(sched(0), 6), round(sched(50), 6), sched(100)
(0.001, 0.05, 0.0)

``sched(n)`` depends on ``n`` only: nothing is counted or cached, so a resumed
run gets exactly the values of an uninterrupted one. Apply schedules with
:func:`ftrain.with_schedule` (or :func:`apply_schedules` in a loop of your own).

MMCV ``lr_config`` / ``momentum_config`` equivalents (``lr`` is the optimizer's
``lr``, ``E`` the optimizer steps per epoch, ``T`` the total number of iterations):

* ``policy='fixed'``: ``constant(lr)``
* ``policy='step', step=[8, 11], warmup='linear', warmup_iters=500,
  warmup_ratio=0.001`` (by epoch): ``warmup(by_epoch(multistep(lr, [8, 11]), E),
  iters=500, ratio=0.001)`` (warmup counts iterations: keep it outside
  :func:`by_epoch`; for ``warmup_by_epoch=True`` pass ``iters=epochs * E``)
* ``policy='step', step=30, gamma=0.5`` (by epoch): ``by_epoch(step_decay(lr, 30, gamma=0.5), E)``
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
value after ``total``, and every bad argument raises :class:`ValueError` naming
the argument and the fix.
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
    "constant",
    "step_decay",
    "multistep",
    "exponential",
    "cosine",
    "polynomial",
    "cyclic",
    "cyclic_momentum",
    "warmup",
    "join",
    "by_epoch",
    "apply_schedules",
]

ScheduleFn = Callable[[int | float], float]
WARMUP_KINDS = ("linear", "exp", "constant")  # MMCV's ``warmup`` names
ANNEAL_KINDS = ("cos", "linear")  # MMCV's ``anneal_strategy``
#: The optimizer settings :func:`apply_schedules` can schedule.
KEYS = ("lr", "momentum", "weight_decay")


# --------------------------------------------------------------------------- checks
def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _finite(value: Any, what: str, fix: str) -> None:
    if not _is_real(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}; {fix}")


def _positive(value: Any, what: str, fix: str, integer: bool = False) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) if integer else True
    if not (ok and _is_real(value) and value > 0):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{what} must be {kind} > 0, got {value!r}; {fix}")


def _callable(value: Any, what: str) -> None:
    if not callable(value):
        raise ValueError(
            f"{what} must be a schedule (a callable step -> value such as "
            f"ftrain.schedules.constant(0.1)), got {value!r}"
        )


def _increasing(values: Any, what: str, each: str, fix: str) -> tuple:
    values = (
        tuple(values) if isinstance(values, Iterable) and not isinstance(values, str) else values
    )
    if not isinstance(values, tuple):
        raise ValueError(f"{what} must be a list of steps, got {values!r}; {fix}")
    for v in values:
        _positive(v, each, fix)
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"{what} must be strictly increasing, got {list(values)}; sort them and remove "
            "duplicates"
        )
    return values


def _cos(start: float, end: float, frac: float) -> float:
    return end + 0.5 * (start - end) * (math.cos(math.pi * frac) + 1)


def _linear(start: float, end: float, frac: float) -> float:
    return start + (end - start) * frac


# --------------------------------------------------------------------------- the value
@attrs.frozen(repr=False)
class Schedule:
    """What every schedule function returns: ``schedule(step) -> float``.

    A frozen value: it compares and hashes by its arguments, prints as the call
    that makes it, and its arguments read as attributes.

    >>> s = multistep(0.1, [8, 11])
    >>> s.milestones, s == multistep(0.1, (8, 11))
    ((8, 11), True)
    """

    name: str
    args: tuple[tuple[str, Any], ...]

    def __call__(self, step: int | float) -> float:
        return float(_FORMULAS[self.name](step, **dict(self.args)))

    def __getattr__(self, name: str) -> Any:
        for key, value in object.__getattribute__(self, "args"):
            if key == name:
                return value
        raise AttributeError(name)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.args if v is not None)
        return f"{self.name}({shown})"


def _make(name: str, /, **args: Any) -> Schedule:
    return Schedule(name, tuple(args.items()))


# --------------------------------------------------------------------------- formulas
def _constant(step, value):
    return value


def _decay(step, base, gamma, min_value, step_size=None, milestones=None):
    k = bisect_right(milestones, step) if milestones is not None else step // step_size
    value = base * gamma**k
    return value if min_value is None else max(value, min_value)


def _exponential(step, base, gamma):
    return base * gamma**step


def _cosine(step, base, total, final, final_ratio):
    target = base * final_ratio if final_ratio is not None else final
    return _cos(base, target, min(step, total) / total)


def _polynomial(step, base, total, power, min_value):
    return (base - min_value) * (1 - min(step, total) / total) ** power + min_value


def _cyclic(step, base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma):
    phase = total // cyclic_times
    up = int(step_ratio_up * phase)
    cycle, pos = divmod(step, phase)
    scale = gamma**cycle
    peak = base * (1 - scale + target_ratio[0] * scale)
    fn = _cos if anneal == "cos" else _linear
    if pos < up:
        return fn(base, peak, pos / up)
    return fn(peak, base * target_ratio[1], (pos - up) / (phase - up))


def _warmup(step, schedule, iters, ratio, kind, inverse):
    value = schedule(step)
    if step >= iters:
        return value
    if kind == "linear":
        factor = 1 - (1 - step / iters) * (1 - ratio)
    else:
        factor = ratio ** (1 - step / iters) if kind == "exp" else ratio
    return value / factor if inverse else value * factor


def _join(step, schedules, boundaries):
    i = bisect_right(boundaries, step)
    return schedules[i](step if i == 0 else step - boundaries[i - 1])


def _by_epoch(step, schedule, steps_per_epoch):
    return schedule(int(step // steps_per_epoch))


_FORMULAS: dict[str, Callable[..., float]] = {
    "constant": _constant,
    "step_decay": _decay,
    "multistep": _decay,
    "exponential": _exponential,
    "cosine": _cosine,
    "polynomial": _polynomial,
    "cyclic": _cyclic,
    "cyclic_momentum": _cyclic,
    "warmup": _warmup,
    "join": _join,
    "by_epoch": _by_epoch,
}


# --------------------------------------------------------------------------- constructors
def constant(value: float) -> Schedule:
    """The same value at every step (MMCV ``policy='fixed'``).

    >>> constant(0.1)(12345)
    0.1
    """
    _finite(value, "constant(value)", "pass the learning rate, e.g. constant(0.1)")
    return _make("constant", value=value)


def step_decay(
    base: float, step_size: int | float, gamma: float = 0.1, min_value: float | None = None
) -> Schedule:
    """``base * gamma ** (step // step_size)``, never below ``min_value`` (MMCV ``policy='step'``).

    ``torch.optim.lr_scheduler.StepLR`` without ``min_value`` (MMCV's ``min_lr``).

    >>> s = step_decay(1.0, step_size=10, gamma=0.5)
    >>> s(9), s(10), s(25)
    (1.0, 0.5, 0.25)
    """
    _finite(base, "step_decay(base)", "pass the initial value, e.g. 0.1")
    _positive(
        step_size,
        "step_decay(step_size)",
        "it is the number of steps between decays; for decays at given steps use "
        "multistep(base, milestones)",
    )
    _positive(gamma, "step_decay(gamma)", "use e.g. gamma=0.1 to divide by 10")
    if min_value is not None:
        _finite(min_value, "step_decay(min_value)", "pass a number or None")
    return _make("step_decay", base=base, step_size=step_size, gamma=gamma, min_value=min_value)


def multistep(
    base: float,
    milestones: Sequence[int | float],
    gamma: float = 0.1,
    min_value: float | None = None,
) -> Schedule:
    """Multiply by ``gamma`` at each milestone (MMCV ``policy='step', step=[...]``).

    ``base * gamma ** k``, ``k`` the number of milestones ``<= step`` (the decay
    takes effect *at* the milestone), as ``torch``'s ``MultiStepLR``; never
    below ``min_value``.

    >>> s = multistep(0.1, milestones=[8, 11])
    >>> s(7), s(8), round(s(11), 6)
    (0.1, 0.010000000000000002, 0.001)
    """
    _finite(base, "multistep(base)", "pass the initial value, e.g. 0.1")
    if not isinstance(milestones, Iterable) or not milestones:
        raise ValueError(
            f"multistep(milestones) must be a non-empty list of steps, got {milestones!r}; "
            "e.g. milestones=[8, 11]"
        )
    milestones = _increasing(
        milestones,
        "multistep(milestones)",
        "each multistep milestone",
        "milestones are steps > 0, e.g. [8, 11]",
    )
    _positive(gamma, "multistep(gamma)", "use e.g. gamma=0.1 to divide by 10")
    if min_value is not None:
        _finite(min_value, "multistep(min_value)", "pass a number or None")
    return _make("multistep", base=base, milestones=milestones, gamma=gamma, min_value=min_value)


def exponential(base: float, gamma: float) -> Schedule:
    """``base * gamma ** step`` (MMCV ``policy='exp'``, ``torch``'s ``ExponentialLR``).

    >>> exponential(1.0, 0.5)(3)
    0.125
    """
    _finite(base, "exponential(base)", "pass the initial value, e.g. 0.1")
    _positive(gamma, "exponential(gamma)", "use e.g. gamma=0.99 per step")
    return _make("exponential", base=base, gamma=gamma)


def cosine(
    base: float, total: int | float, final: float | None = None, final_ratio: float | None = None
) -> Schedule:
    """Half a cosine from ``base`` to the final value over ``total`` steps (MMCV ``CosineAnnealing``).

    The final value is ``final`` (default 0, MMCV's ``min_lr``) or ``base *
    final_ratio`` (MMCV's ``min_lr_ratio``); it holds after ``total``. Equals
    ``torch``'s ``CosineAnnealingLR(T_max=total, eta_min=final)`` up to ``total``.

    >>> s = cosine(base=0.1, total=1000, final_ratio=0.01)
    >>> s(0), round(s(500), 6), round(s(1000), 6), round(s(5000), 6)
    (0.1, 0.0505, 0.001, 0.001)
    """
    _finite(base, "cosine(base)", "pass the initial value, e.g. 0.1")
    _positive(total, "cosine(total)", "pass the number of steps (or epochs with by_epoch)")
    if final is not None and final_ratio is not None:
        raise ValueError(
            "cosine() takes final (an absolute value) or final_ratio (a fraction of base), "
            f"not both; got final={final!r}, final_ratio={final_ratio!r}"
        )
    if final_ratio is not None:
        _finite(final_ratio, "cosine(final_ratio)", "pass e.g. final_ratio=1e-3")
    else:
        final = 0.0 if final is None else final
        _finite(final, "cosine(final)", "pass e.g. final=0.0")
    return _make("cosine", base=base, total=total, final=final, final_ratio=final_ratio)


def polynomial(
    base: float, total: int | float, power: float = 1.0, min_value: float = 0.0
) -> Schedule:
    """``(base - min_value) * (1 - step / total) ** power + min_value`` (MMCV ``policy='poly'``).

    ``min_value`` after ``total``; ``torch``'s ``PolynomialLR`` when ``min_value=0``.

    >>> s = polynomial(0.01, total=100, power=2.0)
    >>> s(0), round(s(50), 6), s(100), s(200)
    (0.01, 0.0025, 0.0, 0.0)
    """
    _finite(base, "polynomial(base)", "pass the initial value, e.g. 0.01")
    _positive(total, "polynomial(total)", "pass the number of steps (or epochs with by_epoch)")
    if not _is_real(power) or power < 0:
        raise ValueError(
            f"polynomial(power) must be a number >= 0, got {power!r}; "
            "use power=1.0 for a linear decay, 0.9 as in MMCV's poly configs"
        )
    _finite(min_value, "polynomial(min_value)", "pass e.g. min_value=0.0")
    return _make("polynomial", base=base, total=total, power=power, min_value=min_value)


def cyclic(
    base: float,
    total: int,
    target_ratio: float | tuple[float, float] = (10, 1e-4),
    cyclic_times: int = 1,
    step_ratio_up: float = 0.4,
    anneal: str = "cos",
    gamma: float = 1.0,
) -> Schedule:
    """MMCV's ``CyclicLrUpdaterHook`` (``policy='cyclic'``).

    ``total`` iterations make ``cyclic_times`` cycles of ``phase = total //
    cyclic_times`` steps. In each cycle the value anneals (``anneal='cos'`` or
    ``'linear'``) from ``base`` up to ``base * target_ratio[0]`` during the first
    ``int(step_ratio_up * phase)`` steps, then down to ``base * target_ratio[1]``.
    A number ``r`` means ``(r, r / 1e5)``. With ``gamma < 1`` the peak of cycle
    ``c`` shrinks to ``1 + (target_ratio[0] - 1) * gamma ** c`` times ``base``.

    >>> s = cyclic(base=0.02, total=10, target_ratio=(10, 1))
    >>> round(s(0), 6), round(s(4), 6), round(s(6), 6), round(s(9), 6)
    (0.02, 0.2, 0.155, 0.032058)
    """
    return _cyclic_of(
        "cyclic", base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma
    )


def _cyclic_of(name, base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma):
    _finite(base, f"{name}(base)", "pass the initial value, e.g. 1e-3")
    _positive(total, f"{name}(total)", "pass the total number of iterations", integer=True)
    _positive(cyclic_times, f"{name}(cyclic_times)", "use e.g. cyclic_times=1", integer=True)
    if total < cyclic_times:
        raise ValueError(
            f"{name}(total={total}) must be >= cyclic_times={cyclic_times} "
            "(each cycle needs at least one step); lower cyclic_times"
        )
    tr = target_ratio
    if _is_real(tr) or (isinstance(tr, Sequence) and len(tr) == 1 and _is_real(tr[0])):
        r = tr if _is_real(tr) else tr[0]
        tr = (r, r / 1e5)
    tr = tuple(tr) if isinstance(tr, Sequence) and not isinstance(tr, str) else tr
    if not (isinstance(tr, tuple) and len(tr) == 2 and all(_is_real(r) for r in tr)):
        raise ValueError(
            f"{name}(target_ratio) must be a number or a pair (peak_ratio, final_ratio), "
            f"got {target_ratio!r}; e.g. target_ratio=(10, 1e-4)"
        )
    if not _is_real(step_ratio_up) or not 0 <= step_ratio_up < 1:
        raise ValueError(
            f"{name}(step_ratio_up) must be in [0, 1), got {step_ratio_up!r}; it is the "
            "fraction of each cycle spent going up, e.g. 0.4"
        )
    if anneal not in ANNEAL_KINDS:
        raise ValueError(f"{name}(anneal) must be one of {ANNEAL_KINDS}, got {anneal!r}")
    if not _is_real(gamma) or not 0 < gamma <= 1:
        raise ValueError(
            f"{name}(gamma) must be in (0, 1], got {gamma!r}; it shrinks the peak of "
            "each later cycle, use gamma=1.0 for identical cycles"
        )
    return _make(
        name,
        base=base,
        total=total,
        target_ratio=tr,
        cyclic_times=cyclic_times,
        step_ratio_up=step_ratio_up,
        anneal=anneal,
        gamma=gamma,
    )


def cyclic_momentum(
    base: float,
    total: int,
    target_ratio: float | tuple[float, float] = (0.85 / 0.95, 1),
    cyclic_times: int = 1,
    step_ratio_up: float = 0.4,
    anneal: str = "cos",
    gamma: float = 1.0,
) -> Schedule:
    """The momentum companion of :func:`cyclic` (MMCV's ``CyclicMomentumUpdaterHook``).

    With MMCV's momentum defaults: while the learning rate rises the momentum
    falls to ``base * 0.85 / 0.95`` and comes back. Use the same ``total``,
    ``cyclic_times`` and ``step_ratio_up`` as the learning-rate schedule.

    >>> m = cyclic_momentum(base=0.95, total=10)
    >>> m(0), round(m(4), 6), round(m(6), 6)
    (0.95, 0.85, 0.875)
    """
    args = (base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma)
    return _cyclic_of("cyclic_momentum", *args)


def warmup(
    schedule: ScheduleFn,
    iters: int | float,
    ratio: float = 0.1,
    kind: str = "linear",
    inverse: bool = False,
) -> Schedule:
    """Warm any schedule up over its first ``iters`` steps, as MMCV's ``warmup=...``.

    The factor multiplies the schedule's own value ``v = schedule(step)`` (the
    schedule is not shifted; from ``step >= iters`` on the value is ``v``):

    * ``kind='linear'``: ``1 - (1 - step / iters) * (1 - ratio)``, from ``ratio``
      up to 1 (``torch``'s ``LinearLR(start_factor=ratio)``);
    * ``kind='exp'``: ``ratio ** (1 - step / iters)``;
    * ``kind='constant'``: ``ratio`` (``torch``'s ``ConstantLR(factor=ratio)``).

    ``ratio`` is MMCV's ``warmup_ratio``. ``inverse=True`` divides by the factor
    instead, as MMCV's momentum warmup does (from ``v / ratio`` down to ``v``).

    >>> s = warmup(constant(0.1), iters=10, ratio=0.01)
    >>> round(s(0), 6), round(s(5), 6), s(10)
    (0.001, 0.0505, 0.1)
    >>> round(warmup(constant(0.95), iters=5, ratio=0.5, inverse=True)(0), 6)
    1.9
    >>> round(warmup(constant(1.0), iters=4, ratio=0.01, kind="exp")(2), 6)
    0.1
    """
    _callable(schedule, "warmup(schedule)")
    _positive(
        iters,
        "warmup(iters)",
        "it is the number of warmup iterations; drop the warmup() wrapper for none",
    )
    if not _is_real(ratio) or not 0 < ratio <= 1:
        raise ValueError(
            f"warmup(ratio) must be in (0, 1], got {ratio!r}; it is the fraction of "
            "the value used at step 0, e.g. ratio=0.001"
        )
    if kind not in WARMUP_KINDS:
        raise ValueError(f"warmup(kind) must be one of {WARMUP_KINDS}, got {kind!r}")
    return _make("warmup", schedule=schedule, iters=iters, ratio=ratio, kind=kind, inverse=inverse)


def join(schedules: Sequence[ScheduleFn], boundaries: Sequence[int | float]) -> Schedule:
    """Run schedules one after another, like ``optax.join_schedules``.

    ``schedules[i]`` runs from ``boundaries[i - 1]`` (inclusive) to
    ``boundaries[i]`` and sees the step relative to its start; there is one
    boundary fewer than schedules.

    >>> s = join([constant(0.0), exponential(1.0, 0.5)], boundaries=[10])
    >>> s(9), s(10), s(12)
    (0.0, 1.0, 0.25)
    """
    if not isinstance(schedules, Iterable) or not (schedules := tuple(schedules)):
        raise ValueError(
            f"join(schedules) must be a non-empty list of schedules, got {schedules!r}"
        )
    for i, s in enumerate(schedules):
        _callable(s, f"join(schedules)[{i}]")
    fix = "boundaries are the steps > 0 where the next schedule starts"
    boundaries = _increasing(boundaries, "join(boundaries)", "each join boundary", fix)
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join() needs one boundary between each pair of schedules: "
            f"{len(schedules)} schedules need {len(schedules) - 1} boundaries, "
            f"got {len(boundaries)}; pass boundaries=[step where schedule 1 starts, ...]"
        )
    return _make("join", schedules=schedules, boundaries=boundaries)


def by_epoch(schedule: ScheduleFn, steps_per_epoch: int) -> Schedule:
    """Make a schedule epoch-based: it sees ``step // steps_per_epoch`` (MMCV ``by_epoch=True``).

    The wrapped schedule's ``total``, ``milestones``, ``step_size`` count
    epochs and the value changes at the first step of an epoch, as MMCV's
    epoch-based updaters. ``steps_per_epoch`` counts *optimizer steps* (divide
    by the accumulation window). Wrap the result in :func:`warmup` for MMCV's
    per-iteration warmup. (``with_schedule(..., by_epoch=True)`` instead calls
    the schedules with ``state.epoch``, for a whole run by epoch.)

    >>> s = by_epoch(multistep(0.1, milestones=[2]), steps_per_epoch=100)
    >>> s(0), s(199), round(s(200), 6)
    (0.1, 0.1, 0.01)
    """
    _callable(schedule, "by_epoch(schedule)")
    _positive(
        steps_per_epoch,
        "by_epoch(steps_per_epoch)",
        "pass the number of optimizer steps per epoch, e.g. len(loader) // accum_every",
        integer=True,
    )
    return _make("by_epoch", schedule=schedule, steps_per_epoch=steps_per_epoch)


# --------------------------------------------------------------------------- checks of values
def probe_steps(schedule: Any) -> list[int | float]:
    """The steps where a schedule is worth checking before training: 0 and its known ends.

    >>> probe_steps(join([constant(0.1), cosine(0.1, 90)], [10]))
    [0, 10, 100]
    """
    out = {0}
    if isinstance(schedule, Schedule):
        args = dict(schedule.args)
        out.update(v for k, v in args.items() if k in ("total", "iters", "step_size"))
        out.update(args.get("milestones", ()))
        if schedule.name == "join":
            starts = (0, *args["boundaries"])
            for start, s in zip(starts, args["schedules"]):
                out.update(start + n for n in probe_steps(s))
        elif schedule.name == "by_epoch":
            out.update(n * args["steps_per_epoch"] for n in probe_steps(args["schedule"]))
        elif schedule.name == "warmup":
            out.update(probe_steps(args["schedule"]))
    return sorted(out)


def check_value(value: float, key: str, schedule: Any, step: int | float) -> None:
    """Raise a ValueError naming the schedule, the step and the fix for a negative or NaN value."""
    if value >= 0 and value != math.inf:
        return
    raise ValueError(
        f"The {key} schedule {schedule!r} gives {key}={value!r} at step {step}: a {key} must be "
        f"a finite number >= 0. Fix the schedule's arguments (a final value, min_value or "
        f"base >= 0, a ratio in (0, 1]) or its formula so that it stays >= 0 at every step."
    )


# --------------------------------------------------------------------------- optimizer
def _momentum_key(group: dict[str, Any], optimizer: Any) -> str:
    for key in ("momentum", "betas"):
        if key in group:
            return key
    raise ValueError(
        f"{type(optimizer).__name__} has no momentum: its param groups have neither "
        "'momentum' (SGD, RMSprop) nor 'betas' (Adam-type); pass momentum=None"
    )


def _read(group: dict[str, Any], key: str) -> float:
    return float(group["betas"][0] if key == "betas" else group[key])


def _write(group: dict[str, Any], key: str, value: float) -> None:
    if key == "betas":
        betas = group["betas"]
        if isinstance(betas[0], torch.Tensor):
            betas[0].fill_(value)
        else:
            group["betas"] = (value, *betas[1:])
    elif isinstance(group[key], torch.Tensor):  # tensor lr (fused, capturable, compiled)
        group[key].fill_(value)
    else:
        group[key] = value


def _mult(groups: list[dict[str, Any]], group: dict[str, Any], what: str, key: str) -> float:
    """First application to ``group``: its multiplier is its initial value over group 0's."""
    initial, mult_key = f"ftrain_initial_{what}", f"ftrain_{what}_mult"
    reference = groups[0].setdefault(initial, _read(groups[0], key))
    own = group.setdefault(initial, _read(group, key))
    if reference == 0 and own != 0:
        raise ValueError(
            f"param group 0 has {what}=0, so the {what} multiplier of a group with "
            f"{what}={own} is undefined; set group[{mult_key!r}] in each param group "
            "(e.g. 1.0 for group 0, 0.1 for a backbone) before apply_schedules"
        )
    group[mult_key] = own / reference if reference != 0 else 1.0
    return group[mult_key]


def apply_schedules(
    optimizer: torch.optim.Optimizer,
    step: int | float,
    lr: ScheduleFn | None = None,
    momentum: ScheduleFn | None = None,
    weight_decay: ScheduleFn | None = None,
) -> dict[str, float]:
    """Set ``lr``, ``momentum`` and ``weight_decay`` of every param group from schedules at ``step``.

    What :func:`ftrain.with_schedule` calls before each update; call it
    yourself in a plain loop. Cheap: one call per schedule and a float
    multiply per group (a tensor ``lr`` or ``betas[0]`` is filled in place).
    Momentum is ``group['momentum']`` (SGD, RMSprop) or ``group['betas'][0]``
    (Adam-type); an optimizer with neither raises ValueError. A value that is
    negative or NaN raises ValueError naming the schedule and the step, before
    anything is written.

    Per-group ratios: group 0 gets the schedule's value, every other group it
    times its multiplier, which is its value divided by group 0's value the
    first time the group is seen (groups built with ``lr=1e-3`` and ``1e-4``
    stay 10x apart). It is stored in the group as ``'ftrain_lr_mult'``
    (``'ftrain_momentum_mult'``, ``'ftrain_weight_decay_mult'``; the initial
    values as ``'ftrain_initial_lr'``...), saved by ``optimizer.state_dict()``
    so a resumed run keeps the ratios; set it in a group yourself to choose it.

    Returns the scheduled values (group 0's), for logging.

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
    for what, schedule in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if schedule is None:
            continue
        _callable(schedule, f"apply_schedules({what})")
        value = float(schedule(step))
        check_value(value, what, schedule, step)
        for group in groups:
            key = _momentum_key(group, optimizer) if what == "momentum" else what
            mult = group.get(f"ftrain_{what}_mult")
            if mult is None:
                mult = _mult(groups, group, what, key)
            _write(group, key, value * mult)
        applied[what] = value
    return applied
