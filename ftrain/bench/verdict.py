"""Verdicts from paired samples: OK or MISSED only when the whole interval is on one side.

Two variants timed alternately in one process give one *paired* value per round (a ratio
``a_i / b_i`` or a difference ``a_i - b_i``): drift and load hit both sides of a pair alike.
:func:`median_interval` bounds the median of those values with a distribution-free
order-statistic interval; :func:`judge` says ``OK`` or ``MISSED`` only when that whole
interval lies on one side of the target, else ``inconclusive`` with the spread. A quick run
never judges a target that is defined at full size (``not judged``).

Example:
    >>> t = Target("make_step on tiny: added time", 10.0, "us", better="lower")
    >>> judge(t, median_interval([2.0, 3.0, 4.0, 3.5, 2.5])).line()
    'make_step on tiny: added time <= 10.0 us: +3.0 us (94% interval +2.0 us to +4.0 us, n=5) OK'
    >>> judge(t, median_interval([2.0, 30.0, 4.0, 3.5, 2.5])).verdict
    'inconclusive'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Interval", "Target", "Verdict", "paired", "median_interval", "judge", "fmt_ratio",
    "fmt_value", "MIN_CONFIDENCE"
]  # fmt: skip

#: An interval must cover the median with at least this probability to decide a verdict.
MIN_CONFIDENCE = 0.9

Unit = Literal["x", "us", "ms", "s", "%"]
Better = Literal["lower", "higher"]


def fmt_ratio(ratio: float | None) -> str:
    """The one wording of a ratio everywhere in ``ftrain.bench``: two decimals and an ``x``.

    Example:
        >>> fmt_ratio(1.0234), fmt_ratio(0.5), fmt_ratio(float("nan"))
        ('1.02x', '0.50x', '-')
    """
    return "-" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}x"


def fmt_value(value: float, unit: Unit) -> str:
    """A figure in its unit: ratios as :func:`fmt_ratio`, differences signed.

    Example:
        >>> fmt_value(1.234, "x"), fmt_value(3.04, "us"), fmt_value(0.25, "%"), fmt_value(0.5, "s")
        ('1.23x', '+3.0 us', '25.0%', '+0.500 s')
    """
    if unit == "x":
        return fmt_ratio(value)
    if unit == "%":
        return f"{value * 100:.1f}%"
    digits = 3 if unit == "s" else 1
    return f"{value:+.{digits}f} {unit}"


def paired(
    a: Sequence[float], b: Sequence[float], kind: Literal["ratio", "difference"]
) -> list[float]:
    """Per-round ``a_i / b_i`` (``"ratio"``) or ``a_i - b_i`` (``"difference"``).

    Example:
        >>> paired([2.0, 3.0], [1.0, 2.0], "ratio"), paired([2.0, 3.0], [1.0, 2.0], "difference")
        ([2.0, 1.5], [1.0, 1.0])
    """
    if len(a) != len(b):
        raise ValueError(f"paired: {len(a)} samples against {len(b)}; pairs need equal counts")
    if kind == "ratio":
        return [x / y for x, y in zip(a, b) if y > 0]
    return [x - y for x, y in zip(a, b)]


@dataclass(frozen=True)
class Interval:
    """The median of paired values and an interval around it that covers the true median
    with probability ``confidence`` (``nan`` bounds when there is no sample).

    Example:
        >>> median_interval([1.0, 2.0, 3.0]).confidence
        0.75
    """

    median: float
    lo: float
    hi: float
    n: int
    confidence: float

    def as_dict(self) -> dict[str, float]:
        """For JSON.

        Example:
            >>> median_interval([1.0]).as_dict()["n"]
            1
        """
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "n": self.n,
                "confidence": self.confidence}  # fmt: skip


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n samples: 1 - 2 P(Binomial(n, 1/2) < k)."""
    tail = sum(math.comb(n, i) for i in range(k)) / 2**n
    return max(0.0, 1.0 - 2.0 * tail)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The median of ``values`` and the narrowest order-statistic interval with at least
    ``confidence`` coverage; with too few values for that, the full range and its coverage.

    Distribution-free: it assumes only that the paired values are independent draws (a
    few outliers from a loaded machine widen it, they do not move it).

    Example:
        >>> iv = median_interval([float(i) for i in range(1, 21)])
        >>> iv.median, iv.lo, iv.hi, round(iv.confidence, 3)
        (10.5, 6.0, 15.0, 0.959)
    """
    xs = sorted(float(v) for v in values if not math.isnan(v))
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, 0.0)
    k = 1
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= confidence:
        k += 1
    return Interval(statistics.median(xs), xs[k - 1], xs[n - k], n, _coverage(n, k))


@dataclass(frozen=True)
class Target:
    """A figure's goal: ``limit`` in ``unit``, ``better`` ``"lower"`` (at most) or
    ``"higher"`` (at least); ``full_size``: defined on the full-size run only.

    Example:
        >>> Target("tokens/s, ftrain / plain", 0.98, "x", better="higher").goal()
        '>= 0.98x'
    """

    name: str
    limit: float
    unit: Unit
    better: Better = "lower"
    full_size: bool = False

    def goal(self) -> str:
        """``"<= limit"`` or ``">= limit"`` in the target's unit."""
        sign = "<=" if self.better == "lower" else ">="
        return f"{sign} {fmt_value(self.limit, self.unit).lstrip('+')}"


@dataclass(frozen=True)
class Verdict:
    """A target, the interval measured for it, and ``OK`` / ``MISSED`` / ``inconclusive`` /
    ``not judged``, with ``why`` for the last two."""

    target: Target
    interval: Interval | None
    verdict: Literal["OK", "MISSED", "inconclusive", "not judged"]
    why: str = ""

    def line(self) -> str:
        """One line: the target, the median, its interval, the verdict (and why).

        Example:
            >>> t = Target("blocked time vs torch.save", 0.25, "x", full_size=True)
            >>> judge(t, median_interval([0.1] * 5), quick=True).line()  # doctest: +ELLIPSIS
            'blocked time vs torch.save <= 0.25x: 0.10x (...) not judged: a --quick run'
        """
        t, iv = self.target, self.interval
        head = f"{t.name} {t.goal()}"
        if iv is None or iv.n == 0:
            return f"{head}: no measurement: {self.verdict}" + (f": {self.why}" if self.why else "")
        spread = (
            f"{iv.confidence:.0%} interval {fmt_value(iv.lo, t.unit)} to "
            f"{fmt_value(iv.hi, t.unit)}, n={iv.n}"
        )
        tail = f": {self.why}" if self.why else ""
        return f"{head}: {fmt_value(iv.median, t.unit)} ({spread}) {self.verdict}{tail}"

    def as_dict(self) -> dict[str, object]:
        """For JSON: the target, the interval and the verdict."""
        t = self.target
        return {"name": t.name, "limit": t.limit, "unit": t.unit, "better": t.better,
                "full_size": t.full_size, "verdict": self.verdict, "why": self.why,
                "interval": None if self.interval is None else self.interval.as_dict(),
                "line": self.line()}  # fmt: skip


def judge(target: Target, interval: Interval | None, *, quick: bool = False) -> Verdict:
    """``OK`` / ``MISSED`` when the whole interval is on one side of the limit (and covers
    the median with at least :data:`MIN_CONFIDENCE`), else ``inconclusive``; a quick run
    does not judge a ``full_size`` target.

    Example:
        >>> t = Target("ratio", 1.02, "x")
        >>> [judge(t, median_interval(v)).verdict for v in
        ...  ([1.0, 1.01, 0.99, 1.0, 1.0], [1.1, 1.2, 1.05, 1.3, 1.1], [0.9, 1.1, 1.0, 1.0, 1.0])]
        ['OK', 'MISSED', 'inconclusive']
    """
    if quick and target.full_size:
        why = "a --quick run"
        return Verdict(target, interval, "not judged", why)
    if interval is None or interval.n == 0:
        return Verdict(target, interval, "inconclusive", "no samples")
    if interval.confidence < MIN_CONFIDENCE:
        why = (
            f"{interval.n} paired samples cover the median with only {interval.confidence:.0%} "
            f"(a verdict needs {MIN_CONFIDENCE:.0%}: at least 5 samples); more --repeats"
        )
        return Verdict(target, interval, "inconclusive", why)
    lo_side = interval.hi <= target.limit  # the whole interval at or below the limit
    hi_side = interval.lo >= target.limit
    good, bad = (lo_side, interval.lo > target.limit) if target.better == "lower" else (
        hi_side, interval.hi < target.limit)  # fmt: skip
    if good:
        return Verdict(target, interval, "OK")
    if bad:
        return Verdict(target, interval, "MISSED")
    limit = fmt_value(target.limit, target.unit).lstrip("+")
    why = f"the interval straddles {limit}; more --repeats or a quieter machine"
    return Verdict(target, interval, "inconclusive", why)
