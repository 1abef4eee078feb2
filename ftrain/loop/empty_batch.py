"""Batches that hold no samples: found from the tensors' shapes (host metadata, no device
sync), reported once per run before the step trains on them (a mean loss over none is NaN).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["is_empty", "EmptyBatchWarning", "EmptyBatches", "warn_empty"]

_Tensor = torch.Tensor


class EmptyBatchWarning(UserWarning):
    """A batch reached the step with no samples in it (see :func:`is_empty`)."""


def _tensors(batch: Any) -> Any:
    """The batch's top-level values: itself, a tuple's or list's items, a mapping's values."""
    if isinstance(batch, (tuple, list)):
        return batch
    if isinstance(batch, Mapping):
        return batch.values()
    return (batch,)


def is_empty(batch: Any) -> bool:
    """Whether ``batch`` holds no samples: it is a tensor with no elements, or a tuple, list
    or mapping whose tensors (0-d ones aside) all have none (a zero-size batch dimension).

    Only shapes are read (no device sync), up to the first tensor with elements. A batch
    with some empty tensors beside others that are not (a detection batch's images beside
    no boxes) is not empty.

    Example:
        >>> import torch
        >>> is_empty((torch.ones(0, 3), torch.ones(0))), is_empty((torch.ones(2, 3), torch.ones(0, 4)))
        (True, False)
        >>> is_empty({"x": torch.ones(0, 3)}), is_empty([1, 2]), is_empty(torch.ones(0))
        (True, False, True)
    """
    kind = type(batch)
    if kind is tuple or kind is list:
        items = batch
    elif kind is _Tensor:
        return not batch.numel()
    else:
        items = batch.values() if kind is dict else _tensors(batch)
    found = False
    for x in items:
        if isinstance(x, _Tensor):
            if not x.numel():
                found = True
            elif x.dim():
                return False
    return found


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    values = _tensors(batch)
    return [tuple(x.shape) for x in values if isinstance(x, _Tensor)]


def warn_empty(batch: Any, index: int, epoch: int) -> None:
    """Warn that ``batch``, the ``index``-th of epoch ``epoch`` (from 0), holds no samples,
    naming its shapes and the fixes."""
    warnings.warn(
        f"Loop: batch {index} of epoch {epoch} (both counted from 0) holds no samples (its "
        f"tensors' shapes: {_shapes(batch)}). A mean loss over no "
        "samples is NaN, and the step trains on it. Keep empty batches from the step: filter "
        "empty samples out of the dataset (or in the collate_fn), and drop a short or empty "
        "last batch with DataLoader(..., drop_last=True); a loss summed over a varying number "
        "of items can be returned as ftrain.SummedLoss(total, count), where 0 items give no "
        "gradient. (Only a run's first empty batch is reported.)",
        EmptyBatchWarning,
        stacklevel=2,
    )


class EmptyBatches:
    """A run's check for empty batches: reports the first (:func:`warn_empty`), then stops
    looking. Called with each batch before the step: ``check(batch, index, epoch)``.

    Example:
        >>> import torch, warnings
        >>> check = EmptyBatches()
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     for i in range(3):
        ...         check((torch.ones(0, 2), torch.ones(0)), i, 0)
        >>> len(seen), check.armed
        (1, False)
    """

    __slots__ = ("armed",)

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, batch: Any, index: int, epoch: int) -> None:
        if self.armed and is_empty(batch):
            self.armed = False
            warn_empty(batch, index, epoch)
