"""One name per evaluated metric: the rule every place that shows or looks up a metric shares.

An evaluation function returns a dict (``{"val_loss": ..., "acc": ...}``). Each key is
*shown* (console, JSONL, CSV, TensorBoard, MLflow, W&B) as :func:`shown_name` says:
``val/`` before it, a leading ``val_`` (``val-``, ``val.``) dropped, and a name that already
has a group (a ``/``) kept as it is::

    val_loss -> val/loss    acc -> val/acc    val/acc -> val/acc    test/top1 -> test/top1

Hooks and rules that watch an evaluated metric (``BestCheckpointHook``, ``EarlyStoppingHook``,
``ftrain.schedules.plateau``) accept either spelling, the key the evaluation returned or the
name the logs show: :func:`find_metric` finds it. Two keys of one evaluation that show as one
name (``loss`` and ``val_loss``) are refused (:func:`check_distinct`).

This module imports nothing of ftrain: the hooks and the schedule transform both use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["shown_name", "find_metric", "same_metric", "check_distinct"]

_VAL_PREFIX = re.compile(r"^val[-_.](?=.)", flags=re.DOTALL)


def shown_name(key: str) -> str:
    """The name an evaluated metric ``key`` is shown and logged under.

    Example:
        >>> [shown_name(k) for k in ("val_loss", "acc", "val/acc", "test/top1", "val-f1")]
        ['val/loss', 'val/acc', 'val/acc', 'test/top1', 'val/f1']
    """
    return key if "/" in key else "val/" + _VAL_PREFIX.sub("", key)


def same_metric(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` spell the same evaluated metric (equal, or shown alike).

    Example:
        >>> same_metric("val/loss", "val_loss"), same_metric("loss", "val/loss")
        (True, True)
        >>> same_metric("val/acc", "test/acc")
        False
    """
    return a == b or shown_name(a) == shown_name(b)


def find_metric(metrics: Mapping[str, Any], name: str) -> str | None:
    """The key of ``metrics`` that ``name`` spells (itself first), or ``None``.

    Example:
        >>> find_metric({"val_loss": 0.3, "acc": 0.9}, "val/loss")
        'val_loss'
        >>> find_metric({"val_loss": 0.3}, "val/acc") is None
        True
    """
    if name in metrics:
        return name
    shown = shown_name(name)
    return next((k for k in metrics if isinstance(k, str) and shown_name(k) == shown), None)


def check_distinct(names: Iterable[str], who: str) -> None:
    """Raise ``ValueError`` when two ``names`` are shown as one (their logs would overwrite
    each other and a hook could not tell which one it watches).

    Example:
        >>> check_distinct(["val_loss", "acc"], "EvalHook")
        >>> check_distinct(["loss", "val_loss"], "EvalHook")
        Traceback (most recent call last):
        ...
        ValueError: EvalHook: the evaluation returned 'loss' and 'val_loss', which are both shown as 'val/loss'; return one of them, or give one another name.
    """
    seen: dict[str, str] = {}
    for key in names:
        shown = shown_name(key)
        if shown in seen:
            raise ValueError(
                f"{who}: the evaluation returned {seen[shown]!r} and {key!r}, which are both "
                f"shown as {shown!r}; return one of them, or give one another name."
            )
        seen[shown] = key
