"""Which checkpoints a run keeps: retention policies as plain values (Orbax-like).

A policy is a frozen value; ``policy.keeps(entries)`` names the manifest entries it keeps,
a pure function of the entries (name, step, micro-step, run, kind, metrics): the selection
is the same after a resume, as it reads only what the manifest records. Policies combine
with ``|`` (or :func:`keep_any`): a file is kept if any of them keeps it.

What a policy may delete (:func:`stale`) is narrow: the periodic checkpoints the manifest
lists under this run's id. Another run's files, best and interrupted (preemption) saves,
and any file the manifest does not list are never candidates; the run's newest periodic
checkpoint (where it resumes from) is always kept.

Example:
    >>> from ftrain.hooks.keep import keep_best, keep_every, keep_latest
    >>> policy = keep_latest(2) | keep_every(1000) | keep_best(1, "val_loss", mode="min")
    >>> runs = [{"name": f"iter_{n}.pth", "kind": "periodic", "run": "r", "step": n,
    ...          "metrics": {"val_loss": abs(n - 1500) / 1000}} for n in range(500, 3001, 500)]
    >>> stale(runs, "r", policy)     # 2000, 1000 (every), 2500 and 3000 (latest), 1500 (best)
    ['iter_500.pth']
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ftrain.hooks.rules import infer_mode
from ftrain.metric_names import find_metric
from ftrain.persist.manifest import newest_first

__all__ = ["Policy", "Latest", "EveryN", "Best", "KeepAny", "keep_latest", "keep_every", "keep_best",
           "keep_any", "stale", "with_metrics"]  # fmt: skip

Entry = Mapping[str, Any]
COUNTS = ("updates", "micro_batches")


def _positive(policy: str, what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{policy}: {what} must be a whole number >= 1, got {value!r}. "
            f"E.g. {policy.split('(')[0]}(3)."
        )
    return value


class Policy:
    """A retention policy: :meth:`keeps` names the entries it keeps (newest first given)."""

    #: Whether it reads evaluation metrics (the checkpoint hook then records them).
    needs_metrics: bool = False

    def keeps(self, entries: Sequence[Entry]) -> frozenset[str]:
        raise NotImplementedError

    def __or__(self, other: Policy) -> KeepAny:
        if not isinstance(other, Policy):
            return NotImplemented
        return keep_any(self, other)


@attrs.frozen
class Latest(Policy):
    """The newest ``k`` (by step, micro-step, then the manifest's generation)."""

    k: int

    def keeps(self, entries: Sequence[Entry]) -> frozenset[str]:
        return frozenset(e["name"] for e in entries[: self.k])


@attrs.frozen
class EveryN(Policy):
    """Every checkpoint whose update (``count="micro_batches"``: micro-batch) count is a
    multiple of ``n``, forever."""

    n: int
    count: str = "updates"

    def keeps(self, entries: Sequence[Entry]) -> frozenset[str]:
        key = "micro_step" if self.count == "micro_batches" else "step"
        return frozenset(e["name"] for e in entries if e.get(key, 0) > 0 and e[key] % self.n == 0)


@attrs.frozen
class Best(Policy):
    """The best ``k`` by the evaluation ``metric`` recorded with them (``mode`` ``"min"`` or
    ``"max"``); ties: the newer; an entry without the metric (or NaN) is not among them."""

    k: int
    metric: str
    mode: str
    needs_metrics = True

    def keeps(self, entries: Sequence[Entry]) -> frozenset[str]:
        scored = [(v, e["name"]) for e in entries if (v := _value(e, self.metric)) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted(range(len(scored)), key=lambda i: (sign * scored[i][0], i))
        return frozenset(scored[i][1] for i in ranked[: self.k])


@attrs.frozen
class KeepAny(Policy):
    """Keeps what any of ``policies`` keeps."""

    policies: tuple[Policy, ...]

    @property
    def needs_metrics(self) -> bool:  # type: ignore[override]
        return any(p.needs_metrics for p in self.policies)

    def keeps(self, entries: Sequence[Entry]) -> frozenset[str]:
        return frozenset().union(*(p.keeps(entries) for p in self.policies))


def _value(entry: Entry, metric: str) -> float | None:
    """``metric`` (either spelling: ``val/loss`` is ``val_loss``) recorded with ``entry``."""
    metrics = entry.get("metrics")
    key = find_metric(metrics, metric) if isinstance(metrics, Mapping) else None
    value = None if key is None else metrics[key]
    if not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def keep_latest(k: int) -> Latest:
    """Keep the newest ``k`` checkpoints (``CheckpointHook(max_keep=k)``).

    Example:
        >>> keep_latest(3)
        Latest(k=3)
    """
    return Latest(_positive("keep_latest(k)", "k", k))


def keep_every(n: int, *, count: str = "updates") -> EveryN:
    """Keep every checkpoint at a multiple of ``n`` updates forever (``count="micro_batches"``:
    of ``n`` micro-batches, the numbers in the names of ``CheckpointHook(count=...)``).

    Example:
        >>> keep_every(10_000)
        EveryN(n=10000, count='updates')
    """
    if count not in COUNTS:
        raise ValueError(f"keep_every(n): count must be one of {COUNTS}, got {count!r}.")
    return EveryN(_positive("keep_every(n)", "n", n), count)


def keep_best(k: int, metric: str, mode: str | None = None) -> Best:
    """Keep the ``k`` checkpoints with the best evaluation ``metric`` (``mode``: ``"min"`` or
    ``"max"``, inferred from the name by MMEngine's rule when omitted). The checkpoint hook
    records the metrics of an evaluation of the saved state (an ``EvalHook`` at the same
    update) in its manifest entry.

    Example:
        >>> keep_best(2, "val_loss"), keep_best(1, "acc").mode
        (Best(k=2, metric='val_loss', mode='min'), 'max')
    """
    _positive("keep_best(k, metric)", "k", k)
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"keep_best(k, metric): metric must be a metric's name, got {metric!r}.")
    mode = infer_mode(metric) if mode is None else mode
    if mode not in ("min", "max"):
        raise ValueError(
            f"keep_best(k, metric, mode): mode must be 'min' or 'max', got {mode!r} "
            "(e.g. keep_best(2, 'val_loss', mode='min'))."
        )
    return Best(k, metric, mode)


def keep_any(*policies: Policy) -> KeepAny:
    """Keep what any of ``policies`` keeps (the same as ``a | b | c``).

    Example:
        >>> keep_any(keep_latest(2), keep_every(100)) == keep_latest(2) | keep_every(100)
        True
    """
    if not policies or not all(isinstance(p, Policy) for p in policies):
        raise TypeError(
            f"keep_any(*policies) takes retention policies (keep_latest(k), keep_every(n), keep_best(k, "
            f"metric)...), got {policies!r}."
        )
    flat: list[Policy] = []
    for p in policies:
        flat.extend(p.policies if isinstance(p, KeepAny) else (p,))
    return KeepAny(tuple(flat))


def stale(
    entries: Sequence[Entry], run: str | None, policy: Policy, *, upto: int | None = None
) -> list[str]:
    """The names ``policy`` drops: this run's periodic checkpoints it does not keep, except the
    newest. Another run's entries, best and interrupted saves are never among them. ``upto``:
    only checkpoints at or before that update are considered (a run resumed from an older
    checkpoint: the one it resumed from is then the newest, and the branch it left is not
    touched before this run saves over it).

    Example:
        >>> es = [{"name": f"iter_{n}.pth", "kind": "periodic", "run": "r", "step": n}
        ...       for n in (1, 2, 3)] + [{"name": "x.pth", "kind": "periodic", "run": "other",
        ...       "step": 9}, {"name": "interrupted.pth", "kind": "interrupted", "run": "r"}]
        >>> stale(es, "r", keep_latest(1))
        ['iter_2.pth', 'iter_1.pth']
        >>> stale(es, "r", keep_latest(1), upto=2)  # resumed from iter_2: it stays
        ['iter_1.pth']
    """
    mine = newest_first(
        e
        for e in entries
        if e.get("kind") == "periodic"
        and e.get("run") == run
        and (upto is None or e.get("step", 0) <= upto)
    )
    if not mine:
        return []
    kept = policy.keeps(mine) | {mine[0]["name"]}
    return [e["name"] for e in mine if e["name"] not in kept]


def with_metrics(entry: Entry, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``entry`` with the numbers of ``metrics`` recorded (``metrics`` in the manifest).

    Example:
        >>> with_metrics({"name": "iter_2.pth"}, {"val_loss": 0.5, "note": "x"})
        {'name': 'iter_2.pth', 'metrics': {'val_loss': 0.5}}
    """
    numbers = {}
    for k, v in metrics.items():
        try:
            numbers[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return {**entry, "metrics": {**entry.get("metrics", {}), **numbers}}
