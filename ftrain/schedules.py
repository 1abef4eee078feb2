"""Learning-rate, momentum and weight-decay schedules: small immutable values, pure in the step.

Each lowercase function returns a :class:`Schedule`, a frozen value giving the *absolute*
value at a step; they compose (:func:`warmup`, :func:`join`, :func:`by_epoch`) and any
callable ``step -> float`` can stand in for one. Nothing is counted, so a resumed run gets the
same values. Apply them with :func:`~ftrain.transforms.schedule.with_schedule`. Unlike MMCV,
:func:`cosine` and :func:`polynomial` hold their final value after ``total``. A param group
with another learning rate follows :meth:`Schedule.scaled`: ratios scale, absolute floors
stay (torch's and MMEngine's ``eta_min``). :func:`plateau` is the rule that lowers the
learning rate when an evaluated metric stops improving (``ReduceLROnPlateau``).

>>> from ftrain import schedules as S
>>> sched = S.warmup(S.cosine(base=0.1, total=100), iters=10, ratio=0.01)
>>> sched
warmup(schedule=cosine(base=0.1, total=100, final=0.0), iters=10, ratio=0.01, kind='linear', inverse=False)
>>> round(sched(0), 6), round(sched(50), 6), sched(100)
(0.001, 0.05, 0.0)
"""

from __future__ import annotations

import functools
import math
import numbers
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from ftrain._checks import flag
from ftrain.plateau import plateau

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
    "onecycle",
    "onecycle_momentum",
    "cosine_restarts",
    "plateau",
    "warmup",
    "join",
    "by_epoch",
    "apply_schedules",
]

ScheduleFn = Callable[[int | float], float]
WARMUP_KINDS = ("linear", "exp", "constant")  # MMCV's ``warmup`` names
ANNEAL_KINDS = ("cos", "linear")  # MMCV's ``anneal_strategy``


# --------------------------------------------------------------------------- checks
def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _need(ok: bool, what: str, value: Any, need: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"{what} must be {need}, got {value!r}" + (f"; {fix}" if fix else ""))


def _finite(value: Any, what: str, fix: str) -> None:
    _need(_is_real(value), what, value, "a finite number", fix)


def _positive(value: Any, what: str, fix: str, integer: bool = False) -> None:
    ok = _is_real(value) and value > 0
    ok = ok and (not integer or isinstance(value, numbers.Integral) and not isinstance(value, bool))
    _need(ok, what, value, f"{'an integer' if integer else 'a number'} > 0", fix)


def _callable(value: Any, what: str) -> None:
    schedule = "a schedule (a callable step -> value such as ftrain.schedules.constant(0.1))"
    _need(callable(value), what, value, schedule, "")


def _increasing(values: Any, what: str, each: str, fix: str) -> tuple:
    if isinstance(values, Iterable) and not isinstance(values, str):
        values = tuple(values)
    _need(isinstance(values, tuple), what, values, "a list of steps", fix)
    for v in values:
        _positive(v, each, fix)
    ok = all(a < b for a, b in zip(values, values[1:]))
    _need(ok, what, list(values), "strictly increasing", "sort them and remove duplicates")
    return values


def _cos(start: float, end: float, frac: float) -> float:
    return end + 0.5 * (start - end) * (math.cos(math.pi * frac) + 1)


def _linear(start: float, end: float, frac: float) -> float:
    return start + (end - start) * frac


# --------------------------------------------------------------------------- the value
@attrs.frozen(repr=False)
class Schedule:
    """A frozen ``schedule(step) -> float``: compares by its arguments, prints as its call.

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

    def scaled(self, factor: float) -> Schedule:
        """This schedule for a param group whose values are ``factor`` times group 0's.

        Starting values, peaks and ratio floors (``final_ratio``) scale; absolute floors
        (``cosine(final=)``, ``polynomial(min_value=)``, ``step_decay``/``multistep``
        ``min_value``, ``cosine_restarts(final=)``) stay, as ``eta_min`` in torch's and
        MMEngine's schedulers. What :func:`apply_schedules` gives a group with ``lr_mult``.

        >>> cosine(0.1, total=10, final=0.001).scaled(10)
        cosine(base=1.0, total=10, final=0.001)
        """
        out = []
        for key, value in self.args:
            if key in _SCALED_ARGS.get(self.name, ()):
                value = value * factor
            elif key == "schedule":
                value = _scaled(value, factor)
            elif key == "schedules":
                value = tuple(_scaled(v, factor) for v in value)
            out.append((key, value))
        return Schedule(self.name, tuple(out))


def _scaled(schedule: ScheduleFn, factor: float) -> ScheduleFn:
    if isinstance(schedule, Schedule):
        return schedule.scaled(factor)
    return _make("times", schedule=schedule, factor=factor)  # a plain callable: all relative


def has_absolute_floor(schedule: Any) -> bool:
    """Whether ``schedule`` (or a schedule inside it) has an absolute floor that a param
    group with another multiplier keeps (see :meth:`Schedule.scaled`).

    >>> has_absolute_floor(warmup(cosine(0.1, 100, final=1e-4), 5)), has_absolute_floor(cosine(0.1, 9))
    (True, False)
    """
    if not isinstance(schedule, Schedule):
        return False
    args = dict(schedule.args)
    name = schedule.name
    if name in ("cosine", "cosine_restarts"):
        own = args["final_ratio"] is None and args["final"] != 0
    elif name == "polynomial":
        own = args["min_value"] != 0
    else:
        own = name in ("step_decay", "multistep") and args["min_value"] is not None
    inner = args.get("schedules", ()) + ((args["schedule"],) if "schedule" in args else ())
    return own or any(has_absolute_floor(s) for s in inner)


def _make(name: str, /, **args: Any) -> Schedule:
    return Schedule(name, tuple(args.items()))


# --------------------------------------------------------------------------- formulas
def _cyclic(n, base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma):
    phase = total // cyclic_times
    up = int(step_ratio_up * phase)
    cycle, pos = divmod(n, phase)
    peak = base * (1 - gamma**cycle + target_ratio[0] * gamma**cycle)
    fn = _cos if anneal == "cos" else _linear
    if pos < up:
        return fn(base, peak, pos / up)
    return fn(peak, base * target_ratio[1], (pos - up) / (phase - up))


def _phases(n, points, ends, anneal):
    """torch's ``OneCycleLR``: anneal ``points[i] -> points[i + 1]`` until step ``ends[i]``."""
    fn = _cos if anneal == "cos" else _linear
    start = 0.0
    last = len(ends) - 1
    for i, end in enumerate(ends):
        if n <= end or i == last:
            return fn(points[i], points[i + 1], min((n - start) / (end - start), 1.0))
        start = end
    raise AssertionError("unreachable")


def _cycle_ends(total, pct_start, three_phase):
    up = float(pct_start * total) - 1
    return (up, float(2 * pct_start * total) - 2, total - 1) if three_phase else (up, total - 1)


def _onecycle(n, max_value, total, pct_start, anneal, div_factor, final_div_factor, three_phase):
    low = max_value / div_factor
    points = (low, max_value, low) if three_phase else (low, max_value)
    return _phases(
        n, (*points, low / final_div_factor), _cycle_ends(total, pct_start, three_phase), anneal
    )


def _onecycle_momentum(n, total, base, max_value, pct_start, anneal, three_phase):
    points = (
        (max_value, base, max_value, max_value) if three_phase else (max_value, base, max_value)
    )
    return _phases(n, points, _cycle_ends(total, pct_start, three_phase), anneal)


def _restarts(n, base, periods, restart_weights, final, final_ratio):
    start = 0
    for period, weight in zip(periods, restart_weights):  # noqa: B007 - used after
        if n < start + period:
            break
        start += period
    else:  # after the last period: hold its last value (as MMEngine's CosineRestartLR)
        n, start = start - 1, start - period
    low = base * final_ratio if final_ratio is not None else final
    return _cos(base * weight, low, (n - start) / period)


def _warmup(n, schedule, iters, ratio, kind, inverse):
    value = schedule(n)
    if n >= iters:
        return value
    linear = 1 - (1 - n / iters) * (1 - ratio)
    factor = linear if kind == "linear" else ratio ** (1 - n / iters) if kind == "exp" else ratio
    return value / factor if inverse else value * factor


def _decay(n, base, gamma, min_value, step_size=None, milestones=None):
    value = base * gamma ** (bisect_right(milestones, n) if milestones else n // step_size)
    return value if min_value is None else max(value, min_value)


# the arguments a param group's multiplier scales (Schedule.scaled); the others stay
_SCALED_ARGS: dict[str, tuple[str, ...]] = {
    "constant": ("value",),
    "onecycle": ("max_value",),
    "onecycle_momentum": ("base", "max_value"),
    **dict.fromkeys(
        ("step_decay", "multistep", "exponential", "cosine", "polynomial", "cosine_restarts"),
        ("base",),
    ),
    **dict.fromkeys(("cyclic", "cyclic_momentum"), ("base",)),
}

_FORMULAS: dict[str, Callable[..., float]] = {
    "constant": lambda n, value: value,
    "step_decay": _decay,
    "multistep": _decay,
    "exponential": lambda n, base, gamma: base * gamma**n,
    "cosine": lambda n, base, total, final, final_ratio: _cos(
        base, base * final_ratio if final_ratio is not None else final, min(n, total) / total
    ),
    "polynomial": lambda n, base, total, power, min_value: (
        (base - min_value) * (1 - min(n, total) / total) ** power + min_value
    ),
    "cyclic": _cyclic,
    "cyclic_momentum": _cyclic,
    "onecycle": _onecycle,
    "onecycle_momentum": _onecycle_momentum,
    "cosine_restarts": _restarts,
    "times": lambda n, schedule, factor: schedule(n) * factor,
    "warmup": _warmup,
    "join": lambda n, schedules, boundaries: schedules[i := bisect_right(boundaries, n)](
        n - boundaries[i - 1] if i else n
    ),
    "by_epoch": lambda n, schedule, steps_per_epoch: schedule(int(n // steps_per_epoch)),
}


# --------------------------------------------------------------------------- constructors
def constant(value: float) -> Schedule:
    """The same value at every step (MMCV ``policy='fixed'``).

    >>> constant(0.1)(12345)
    0.1
    """
    _finite(value, "constant(value)", "pass the learning rate, e.g. constant(0.1)")
    return _make("constant", value=value)


def _base_gamma(name: str, base: float, gamma: float, min_value: float | None = None) -> None:
    _finite(base, f"{name}(base)", "pass the initial value, e.g. 0.1")
    _positive(gamma, f"{name}(gamma)", "use e.g. gamma=0.1 to divide by 10")
    if min_value is not None:
        _finite(min_value, f"{name}(min_value)", "pass a number or None")


def step_decay(
    base: float, step_size: int | float, gamma: float = 0.1, min_value: float | None = None
) -> Schedule:
    """``base * gamma ** (step // step_size)``, at least ``min_value`` (MMCV ``policy='step'``).

    >>> s = step_decay(1.0, step_size=10, gamma=0.5)
    >>> s(9), s(10), s(25)
    (1.0, 0.5, 0.25)
    """
    _base_gamma("step_decay", base, gamma, min_value)
    fix = "it is the number of steps between decays (for given steps use multistep)"
    _positive(step_size, "step_decay(step_size)", fix)
    return _make("step_decay", base=base, step_size=step_size, gamma=gamma, min_value=min_value)


def multistep(
    base: float,
    milestones: Sequence[int | float],
    gamma: float = 0.1,
    min_value: float | None = None,
) -> Schedule:
    """``base * gamma ** k``, ``k`` the milestones ``<= step`` (MMCV ``policy='step', step=[...]``).

    The decay takes effect *at* the milestone, as ``torch``'s ``MultiStepLR``.

    >>> s = multistep(0.1, milestones=[8, 11])
    >>> s(7), s(8), round(s(11), 6)
    (0.1, 0.010000000000000002, 0.001)
    """
    _base_gamma("multistep", base, gamma, min_value)
    fix = "milestones are steps > 0, e.g. [8, 11]"
    ok = isinstance(milestones, Iterable) and bool(milestones)
    _need(ok, "multistep(milestones)", milestones, "a non-empty list of steps", fix)
    milestones = _increasing(milestones, "multistep(milestones)", "each multistep milestone", fix)
    return _make("multistep", base=base, milestones=milestones, gamma=gamma, min_value=min_value)


def exponential(base: float, gamma: float) -> Schedule:
    """``base * gamma ** step`` (MMCV ``policy='exp'``, ``torch``'s ``ExponentialLR``).

    >>> exponential(1.0, 0.5)(3)
    0.125
    """
    _base_gamma("exponential", base, gamma)
    return _make("exponential", base=base, gamma=gamma)


def _floor_of(name: str, final: float | None, final_ratio: float | None) -> float | None:
    """``final`` checked (0 when neither is given), or ``None`` with a checked ``final_ratio``."""
    if final is not None and final_ratio is not None:
        raise ValueError(
            f"{name}() takes final (an absolute value) or final_ratio (a fraction of base), "
            f"not both; got final={final!r}, final_ratio={final_ratio!r}"
        )
    if final_ratio is not None:
        _finite(final_ratio, f"{name}(final_ratio)", "pass e.g. final_ratio=1e-3")
        return None
    final = 0.0 if final is None else final
    _finite(final, f"{name}(final)", "pass e.g. final=0.0")
    return final


def cosine(
    base: float, total: int | float, final: float | None = None, final_ratio: float | None = None
) -> Schedule:
    """Half a cosine from ``base`` to ``final`` (default 0) or ``base * final_ratio``.

    Over ``total`` steps, then held (MMCV's ``CosineAnnealing``). ``final`` is absolute in
    every param group (torch's and MMEngine's ``CosineAnnealingLR(eta_min)``), ``final_ratio``
    scales with each group (MMEngine's ``eta_min_ratio``).

    >>> s = cosine(base=0.1, total=1000, final_ratio=0.01)
    >>> s(0), round(s(500), 6), round(s(1000), 6), round(s(5000), 6)
    (0.1, 0.0505, 0.001, 0.001)
    """
    _finite(base, "cosine(base)", "pass the initial value, e.g. 0.1")
    _positive(total, "cosine(total)", "pass the number of steps (or epochs with by_epoch)")
    final = _floor_of("cosine", final, final_ratio)
    return _make("cosine", base=base, total=total, final=final, final_ratio=final_ratio)


def polynomial(
    base: float, total: int | float, power: float = 1.0, min_value: float = 0.0
) -> Schedule:
    """``(base - min_value) * (1 - step / total) ** power + min_value`` (MMCV ``policy='poly'``).

    ``min_value`` is absolute in every param group (MMEngine's ``PolyLR(eta_min)``).

    >>> s = polynomial(0.01, total=100, power=2.0)
    >>> s(0), round(s(50), 6), s(100), s(200)
    (0.01, 0.0025, 0.0, 0.0)
    """
    _finite(base, "polynomial(base)", "pass the initial value, e.g. 0.01")
    _positive(total, "polynomial(total)", "pass the number of steps (or epochs with by_epoch)")
    fix = "use power=1.0 for a linear decay, 0.9 as in MMCV's poly configs"
    _need(_is_real(power) and power >= 0, "polynomial(power)", power, "a number >= 0", fix)
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

    ``cyclic_times`` cycles of ``total // cyclic_times`` steps; each anneals from ``base`` up
    to ``base * target_ratio[0]`` over the first ``step_ratio_up`` of the cycle, then down to
    ``base * target_ratio[1]`` (a number ``r`` means ``(r, r / 1e5)``); ``gamma < 1`` lowers
    each later cycle's peak.

    >>> s = cyclic(base=0.02, total=10, target_ratio=(10, 1))
    >>> round(s(0), 6), round(s(4), 6), round(s(6), 6), round(s(9), 6)
    (0.02, 0.2, 0.155, 0.032058)
    """
    args = (base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma)
    return _cyclic_of("cyclic", *args)


def cyclic_momentum(
    base: float,
    total: int,
    target_ratio: float | tuple[float, float] = (0.85 / 0.95, 1),
    cyclic_times: int = 1,
    step_ratio_up: float = 0.4,
    anneal: str = "cos",
    gamma: float = 1.0,
) -> Schedule:
    """:func:`cyclic` with MMCV's momentum defaults (``CyclicMomentumUpdaterHook``).

    Use the learning rate's ``total``, ``cyclic_times`` and ``step_ratio_up``.

    >>> m = cyclic_momentum(base=0.95, total=10)
    >>> m(0), round(m(4), 6), round(m(6), 6)
    (0.95, 0.85, 0.875)
    """
    args = (base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma)
    return _cyclic_of("cyclic_momentum", *args)


def _cyclic_of(name, base, total, target_ratio, cyclic_times, step_ratio_up, anneal, gamma):
    _finite(base, f"{name}(base)", "pass the initial value, e.g. 1e-3")
    _positive(total, f"{name}(total)", "pass the total number of iterations", integer=True)
    _positive(cyclic_times, f"{name}(cyclic_times)", "use e.g. cyclic_times=1", integer=True)
    fix = "each cycle needs at least one step; lower cyclic_times"
    _need(total >= cyclic_times, f"{name}(total)", total, f">= cyclic_times={cyclic_times}", fix)
    tr = target_ratio
    if _is_real(tr) or (isinstance(tr, Sequence) and len(tr) == 1 and _is_real(tr[0])):
        tr = (r := tr if _is_real(tr) else tr[0], r / 1e5)  # MMCV: r means (r, r / 1e5)
    tr = tuple(tr) if isinstance(tr, Sequence) and not isinstance(tr, str) else tr
    ok = isinstance(tr, tuple) and len(tr) == 2 and all(_is_real(r) for r in tr)
    pair = "a number or a pair (peak_ratio, final_ratio)"
    _need(ok, f"{name}(target_ratio)", target_ratio, pair, "e.g. target_ratio=(10, 1e-4)")
    ok = _is_real(step_ratio_up) and 0 <= step_ratio_up < 1
    fix = "it is the fraction of each cycle spent going up, e.g. 0.4"
    _need(ok, f"{name}(step_ratio_up)", step_ratio_up, "in [0, 1)", fix)
    _need(anneal in ANNEAL_KINDS, f"{name}(anneal)", anneal, f"one of {ANNEAL_KINDS}", "")
    fix = "it shrinks the peak of each later cycle, use gamma=1.0 for identical cycles"
    _need(_is_real(gamma) and 0 < gamma <= 1, f"{name}(gamma)", gamma, "in (0, 1]", fix)
    return _make(
        name,
        **dict(base=base, total=total, target_ratio=tr, cyclic_times=cyclic_times),
        **dict(step_ratio_up=step_ratio_up, anneal=anneal, gamma=gamma),
    )


def _cycle_checks(name, total, pct_start, anneal, three_phase):
    _positive(total, f"{name}(total)", "pass the number of steps of the whole cycle")
    fix = "it is the fraction of the steps spent going up, e.g. 0.3"
    _need(
        _is_real(pct_start) and 0 <= pct_start <= 1,
        f"{name}(pct_start)",
        pct_start,
        "in [0, 1]",
        fix,
    )
    _need(anneal in ANNEAL_KINDS, f"{name}(anneal)", anneal, f"one of {ANNEAL_KINDS}", "")
    flag(f"{name}: three_phase", three_phase)
    ends = (0.0, *_cycle_ends(total, pct_start, three_phase))
    ok = all(a < b for a, b in zip(ends, ends[1:]))
    fix = "each phase needs more than one step: raise total or move pct_start away from 0 and 1"
    _need(
        ok,
        f"{name}(pct_start)",
        pct_start,
        f"one that leaves every phase of total={total} a step",
        fix,
    )


def onecycle(
    max_value: float,
    total: int,
    pct_start: float = 0.3,
    anneal: str = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle policy, as ``torch.optim.lr_scheduler.OneCycleLR`` (same arguments).

    From ``max_value / div_factor`` up to ``max_value`` until step ``pct_start * total - 1``,
    then down to ``max_value / div_factor / final_div_factor`` at step ``total - 1`` (held
    after). ``three_phase=True``: up, back down to the start by ``2 * pct_start * total - 2``,
    then down to the end. ``anneal``: ``'cos'`` or ``'linear'``. Pair it with
    :func:`onecycle_momentum` as torch's ``cycle_momentum=True``.

    >>> s = onecycle(0.1, total=100)
    >>> round(s(0), 9), s(29), round(s(99), 9)
    (0.004, 0.1, 4e-07)
    """
    _finite(max_value, "onecycle(max_value)", "pass the peak value, e.g. max_value=0.1")
    _cycle_checks("onecycle", total, pct_start, anneal, three_phase)
    _positive(div_factor, "onecycle(div_factor)", "torch's default is 25")
    _positive(final_div_factor, "onecycle(final_div_factor)", "torch's default is 1e4")
    return _make(
        "onecycle",
        **dict(max_value=max_value, total=total, pct_start=pct_start, anneal=anneal),
        **dict(div_factor=div_factor, final_div_factor=final_div_factor, three_phase=three_phase),
    )


def onecycle_momentum(
    total: int,
    base: float = 0.85,
    max_value: float = 0.95,
    pct_start: float = 0.3,
    anneal: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The momentum of :func:`onecycle` (torch's ``OneCycleLR(cycle_momentum=True)``).

    From ``max_value`` down to ``base`` while the learning rate rises, back up to
    ``max_value`` while it falls (``three_phase``: held at ``max_value`` in the third phase).
    Use the learning rate's ``total``, ``pct_start``, ``anneal`` and ``three_phase``.

    >>> m = onecycle_momentum(total=100)
    >>> m(0), m(29), m(99)
    (0.95, 0.85, 0.95)
    """
    _finite(base, "onecycle_momentum(base)", "torch's base_momentum, e.g. 0.85")
    _finite(max_value, "onecycle_momentum(max_value)", "torch's max_momentum, e.g. 0.95")
    _cycle_checks("onecycle_momentum", total, pct_start, anneal, three_phase)
    return _make(
        "onecycle_momentum",
        **dict(total=total, base=base, max_value=max_value, pct_start=pct_start),
        **dict(anneal=anneal, three_phase=three_phase),
    )


def cosine_restarts(
    base: float,
    periods: Sequence[int | float],
    restart_weights: Sequence[float] | None = None,
    final: float | None = None,
    final_ratio: float | None = None,
) -> Schedule:
    """Cosine annealing with restarts, as MMEngine's ``CosineRestartLR`` (SGDR).

    Period ``i`` (``periods[i]`` steps) anneals from ``base * restart_weights[i]`` to
    ``final`` (absolute, default 0) or ``base * final_ratio`` (MMEngine's ``eta_min`` /
    ``eta_min_ratio``); after the last period the last value is held, as MMEngine does.

    >>> s = cosine_restarts(1.0, periods=[4, 4], restart_weights=[1.0, 0.5])
    >>> s(0), s(2), s(4), s(6), s(100) == s(7)
    (1.0, 0.5, 0.5, 0.25, True)
    """
    _finite(base, "cosine_restarts(base)", "pass the initial value, e.g. 0.1")
    fix = "the length of each cosine cycle in steps, e.g. periods=[1000, 2000]"
    ok = isinstance(periods, Iterable) and bool(periods := tuple(periods))
    _need(ok, "cosine_restarts(periods)", periods, "a non-empty list of steps", fix)
    for p in periods:
        _positive(p, "each cosine_restarts period", fix)
    weights = tuple(restart_weights) if restart_weights is not None else (1.0,) * len(periods)
    for w in weights:
        _finite(w, "each cosine_restarts restart weight", "e.g. restart_weights=[1, 0.5]")
    if len(weights) != len(periods):
        raise ValueError(
            f"cosine_restarts() needs one restart weight per period: {len(periods)} periods, "
            f"{len(weights)} restart_weights; pass restart_weights=[1.0] * {len(periods)} or "
            "leave it out"
        )
    final = _floor_of("cosine_restarts", final, final_ratio)
    return _make(
        "cosine_restarts",
        base=base,
        periods=periods,
        restart_weights=weights,
        final=final,
        final_ratio=final_ratio,
    )


def warmup(
    schedule: ScheduleFn,
    iters: int | float,
    ratio: float = 0.1,
    kind: str = "linear",
    inverse: bool = False,
) -> Schedule:
    """Warm a schedule up over its first ``iters`` steps, as MMCV's ``warmup=...``.

    Before ``iters``, ``schedule(step)`` is multiplied by ``1 - (1 - step / iters) * (1 -
    ratio)`` (``kind='linear'``), ``ratio ** (1 - step / iters)`` (``'exp'``) or ``ratio``
    (``'constant'``); ``inverse=True`` divides instead (MMCV's momentum warmup).
    ``ratio=0`` warms up from zero, ``schedule(step) * step / iters`` (as transformers'
    ``get_*_schedule_with_warmup`` and optax's ``linear_schedule(0, ...)``).

    >>> s = warmup(constant(0.1), iters=10, ratio=0.01)
    >>> round(s(0), 6), round(s(5), 6), s(10)
    (0.001, 0.0505, 0.1)
    >>> warmup(constant(0.1), iters=10, ratio=0)(5)
    0.05
    """
    _callable(schedule, "warmup(schedule)")
    fix = "it is the number of warmup iterations; drop the warmup() wrapper for none"
    _positive(iters, "warmup(iters)", fix)
    fix = "it is the fraction of the value used at step 0, e.g. ratio=0.001 (0: from zero)"
    _need(_is_real(ratio) and 0 <= ratio <= 1, "warmup(ratio)", ratio, "in [0, 1]", fix)
    _need(kind in WARMUP_KINDS, "warmup(kind)", kind, f"one of {WARMUP_KINDS}", "")
    flag("warmup: inverse", inverse)
    fix = "an inverse warmup divides by the ratio: use a ratio > 0, e.g. 0.5"
    _need(not inverse or ratio > 0, "warmup(ratio)", ratio, "> 0 with inverse=True", fix)
    fix = "an exponential warmup from 0 stays 0: use kind='linear' or a ratio > 0"
    _need(kind != "exp" or ratio > 0, "warmup(ratio)", ratio, "> 0 with kind='exp'", fix)
    return _make("warmup", schedule=schedule, iters=iters, ratio=ratio, kind=kind, inverse=inverse)


def join(schedules: Sequence[ScheduleFn], boundaries: Sequence[int | float]) -> Schedule:
    """Schedules one after another, each seeing the step from its start (``optax.join_schedules``).

    ``schedules[i]`` runs from ``boundaries[i - 1]`` to ``boundaries[i]``.

    >>> s = join([constant(0.0), exponential(1.0, 0.5)], boundaries=[10])
    >>> s(9), s(10), s(12)
    (0.0, 1.0, 0.25)
    """
    ok = isinstance(schedules, Iterable) and bool(schedules := tuple(schedules))
    _need(ok, "join(schedules)", schedules, "a non-empty list of schedules", "")
    for i, s in enumerate(schedules):
        _callable(s, f"join(schedules)[{i}]")
    fix = "boundaries are the steps > 0 where the next schedule starts"
    boundaries = _increasing(boundaries, "join(boundaries)", "each join boundary", fix)
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join() needs one boundary between each pair of schedules: {len(schedules)} "
            f"schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}; pass "
            "boundaries=[step where schedule 1 starts, ...]"
        )
    return _make("join", schedules=schedules, boundaries=boundaries)


def by_epoch(schedule: ScheduleFn, steps_per_epoch: int) -> Schedule:
    """A schedule of the epoch ``step // steps_per_epoch`` (MMCV ``by_epoch=True``).

    Its ``total``/``milestones`` count epochs; ``steps_per_epoch`` counts optimizer steps.
    Keep :func:`warmup` outside (MMCV warms up per iteration).

    >>> s = by_epoch(multistep(0.1, milestones=[2]), steps_per_epoch=100)
    >>> s(0), s(199), round(s(200), 6)
    (0.1, 0.1, 0.01)
    """
    _callable(schedule, "by_epoch(schedule)")
    fix = "pass the number of optimizer steps per epoch, e.g. len(loader) // accum_every"
    _positive(steps_per_epoch, "by_epoch(steps_per_epoch)", fix, integer=True)
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
        f"base >= 0, a ratio in [0, 1]) or its formula so that it stays >= 0 at every step."
    )


# --------------------------------------------------------------------------- optimizer
def _key(group: dict[str, Any], what: str, optimizer: Any) -> str:
    for key in ("momentum", "betas") if what == "momentum" else (what,):
        if key in group:
            return key
    keys = (
        "neither 'momentum' (SGD, RMSprop) nor 'betas' (Adam-type)"
        if key == "betas"
        else f"no {key!r}"
    )
    raise ValueError(
        f"{type(optimizer).__name__} has no {what}: its param groups have {keys}; pass {what}=None"
    )


def _read(group: dict[str, Any], key: str) -> float:
    return float(group["betas"][0] if key == "betas" else group[key])


def _write(group: dict[str, Any], key: str, value: float) -> None:
    current = group["betas"][0] if key == "betas" else group[key]
    if isinstance(current, torch.Tensor):  # tensor lr or beta (fused, capturable, compiled)
        current.fill_(value)
    elif key == "betas":
        group["betas"] = (value, *group["betas"][1:])
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
    """Set ``lr``, ``momentum``, ``weight_decay`` of every param group from schedules at ``step``.

    What :func:`~ftrain.transforms.schedule.with_schedule` calls before each forward; returns
    group 0's values. Momentum is ``momentum`` or ``betas[0]`` (Adam-type). A negative or NaN
    value raises ValueError before anything is written. Every other group gets the schedule
    scaled by its multiplier (:meth:`Schedule.scaled`: absolute floors such as
    ``cosine(final=)`` stay absolute, as torch's ``eta_min``), the multiplier being its own
    value over group 0's when first seen, stored as ``group['ftrain_lr_mult']``
    (``_momentum_``, ``_weight_decay_``); set it to choose it.

    >>> import torch
    >>> w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.01}], lr=0.1, momentum=0.9)
    >>> apply_schedules(opt, 500, lr=cosine(0.1, total=1000), momentum=constant(0.85))
    {'lr': 0.05, 'momentum': 0.85}
    >>> [round(g["lr"], 6) for g in opt.param_groups], [g["momentum"] for g in opt.param_groups]
    ([0.05, 0.005], [0.85, 0.85])
    """
    applied: dict[str, float] = {}
    written = []
    for what, schedule in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if schedule is None:
            continue
        _callable(schedule, f"apply_schedules({what})")
        keys, values = group_values(optimizer, what, schedule, step)
        written.append((keys, values))
        applied[what] = values[0]
    for keys, values in written:
        write_values(optimizer, keys, values)
    return applied


@functools.lru_cache(maxsize=1024)
def _for_group(schedule: Schedule, factor: float) -> Schedule:
    return schedule.scaled(factor)


@functools.lru_cache(maxsize=1024)
def _floored(schedule: Schedule) -> bool:
    return has_absolute_floor(schedule)


def group_values(
    optimizer: torch.optim.Optimizer, what: str, schedule: ScheduleFn, step: int | float
) -> tuple[list[str], list[float]]:
    """Each param group's key (``'lr'``, ``'betas'``...) and value of ``schedule`` at ``step``.

    Group 0 gets ``schedule(step)``; another group ``schedule.scaled(mult)(step)`` (its
    multiplier, see :func:`apply_schedules`). A negative or NaN value raises ValueError.

    >>> import torch
    >>> w, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 1.0}], lr=0.1)
    >>> group_values(opt, "lr", cosine(0.1, total=10, final=0.001), 10)
    (['lr', 'lr'], [0.001, 0.001])
    """
    groups = optimizer.param_groups
    value = float(schedule(step))
    check_value(value, what, schedule, step)
    floors = isinstance(schedule, Schedule) and _floored(schedule)
    keys, values, by_mult = [], [], {1.0: value}
    for group in groups:
        key = _key(group, what, optimizer)
        mult = group.get(f"ftrain_{what}_mult")
        if mult is None:
            mult = _mult(groups, group, what, key)
        v = by_mult.get(mult)
        if v is None:
            if floors:
                own = _for_group(schedule, mult)
                check_value(v := float(own(step)), what, own, step)
            else:
                v = value * mult
            by_mult[mult] = v
        keys.append(key)
        values.append(v)
    return keys, values


def write_values(optimizer: torch.optim.Optimizer, keys: list[str], values: list[float]) -> None:
    """Write ``values[i]`` into param group ``i`` under ``keys[i]`` (:func:`group_values`)."""
    for group, key, value in zip(optimizer.param_groups, keys, values, strict=True):
        _write(group, key, value)
