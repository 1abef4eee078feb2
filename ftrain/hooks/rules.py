"""Whether a metric is maximised or minimised, inferred from its name (MMEngine 0.10.7's rule).

MMEngine's ``CheckpointHook(save_best=...)`` and ``EarlyStoppingHook`` infer
``rule="greater"`` or ``"less"`` from the metric's name when none is given.
:func:`infer_mode` applies the same rule, returning ``"max"`` / ``"min"``:

1. the lower-cased name equals a lower-cased greater key: ``"max"``;
2. it equals a lower-cased less key: ``"min"``;
3. a lower-cased greater key is contained in it: ``"max"``;
4. a lower-cased less key is contained in it: ``"min"``;
5. otherwise an error asks for the mode.

Matching is case-insensitive like MMEngine's, so ``val/Accuracy`` and
``Top1`` are maximised. It follows that a name holding both kinds of key
is maximised, because greater keys are tried first: ``heatmap_loss``
contains ``map`` (``mAP`` lower-cased), so MMEngine, and ftrain, maximise
it. ftrain warns when that happens; pass ``mode="min"`` to minimise it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

__all__ = ["GREATER_KEYS", "LESS_KEYS", "infer_mode"]

#: MMEngine 0.10.7's ``_default_greater_keys`` (CheckpointHook and EarlyStoppingHook).
GREATER_KEYS: tuple[str, ...] = (
    "acc",
    "top",
    "AR@",
    "auc",
    "precision",
    "mAP",
    "mDice",
    "mIoU",
    "mAcc",
    "aAcc",
)
#: MMEngine 0.10.7's ``_default_less_keys``.
LESS_KEYS: tuple[str, ...] = ("loss",)


def infer_mode(
    metric: str,
    *,
    greater_keys: Sequence[str] | None = None,
    less_keys: Sequence[str] | None = None,
    warn: bool = True,
) -> str:
    """``"max"`` or ``"min"`` from a metric name, by MMEngine 0.10.7's rule (case-insensitive).

    ``greater_keys`` / ``less_keys`` replace the default key lists, like the
    arguments of the same name of MMEngine's ``CheckpointHook``.

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
    matched = sorted(k for k in greater if k in name)
    if matched:
        also = sorted(k for k in less if k in name)
        if also and warn:
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
