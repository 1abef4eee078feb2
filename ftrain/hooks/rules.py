"""Rules the hooks share: a metric's mode from its name (MMEngine 0.10.7's), a missing
metric's message. (Argument checks are :mod:`ftrain._checks`'s.)"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Sequence

__all__ = ["GREATER_KEYS", "LESS_KEYS", "infer_mode", "missing_metric"]

#: MMEngine 0.10.7's ``_default_greater_keys`` (CheckpointHook and EarlyStoppingHook).
GREATER_KEYS: tuple[str, ...] = (
    "acc", "top", "AR@", "auc", "precision", "mAP", "mDice", "mIoU", "mAcc", "aAcc",
)  # fmt: skip
#: MMEngine 0.10.7's ``_default_less_keys``.
LESS_KEYS: tuple[str, ...] = ("loss",)


def infer_mode(
    metric: str,
    *,
    greater_keys: Sequence[str] | None = None,
    less_keys: Sequence[str] | None = None,
) -> str:
    """``"max"`` or ``"min"`` from a metric name, by MMEngine 0.10.7's rule (case-insensitive).

    An exact greater key, an exact less key, a contained greater key, a contained less
    key; else an error asks for the mode. A name holding both (``heatmap_loss`` contains
    ``map``) is maximised, as in MMEngine, with a warning. ``greater_keys`` / ``less_keys``
    replace the key lists (MMEngine ``CheckpointHook``'s arguments of the same names).

    Example:
        >>> infer_mode("val/acc_top1"), infer_mode("val_loss"), infer_mode("val/Accuracy")
        ('max', 'min', 'max')
    """
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"infer_mode: the metric must be a name, got {metric!r}.")
    greater = {k.lower() for k in (GREATER_KEYS if greater_keys is None else greater_keys)}
    less = {k.lower() for k in (LESS_KEYS if less_keys is None else less_keys)}
    name = metric.lower()
    if name in greater:
        return "max"
    if name in less:
        return "min"
    if matched := sorted(k for k in greater if k in name):
        if also := sorted(k for k in less if k in name):
            warnings.warn(
                f"{metric!r} contains {matched[0]!r} (maximised) and {also[0]!r} "
                f"(minimised); like MMEngine, the greater key wins and it is maximised. "
                "Pass mode='min' if it should be minimised.",
                stacklevel=3,
            )
        return "max"
    if any(k in name for k in less):
        return "min"
    raise ValueError(
        f"Cannot tell whether {metric!r} should be maximised or minimised (its name contains "
        f"none of {sorted(greater)} nor {sorted(less)}); pass mode='max' or mode='min'."
    )


def missing_metric(who: str, metric: str, names: Iterable[str]) -> str:
    """The message for a hook whose ``metric`` an evaluation did not return: the names it
    did return and the likeliest one meant.

    Example:
        >>> msg = missing_metric("BestCheckpointHook", "val/loss", ["val_loss", "val_acc"])
        >>> msg[msg.index("(") :]
        "(it returned ['val_acc', 'val_loss']); did you mean 'val_loss'? Pass the name exactly \
as the evaluation function returns it."
    """
    names = sorted(names)
    close = difflib.get_close_matches(metric, names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"{who}: the evaluation returned no {metric!r} (it returned {names}); {hint}Pass the "
        "name exactly as the evaluation function returns it."
    )
