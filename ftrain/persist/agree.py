"""Saving after an interruption under ``torch.distributed``: only if every rank agrees."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ftrain import dist as _dist
from ftrain._agreement import all_arrive

if TYPE_CHECKING:
    from ftrain.state import TrainState

__all__ = ["agree_to_save"]

_ARRIVALS = itertools.count()


def agree_to_save(state: TrainState | None, timeout: float = 10.0) -> bool:
    """Whether every rank reached the same micro-step (``state``'s) to save after an interruption.

    The ranks meet through the store (``timeout``), not a collective: one
    rank hit alone by an error or a signal must not hang the save.

    Example:
        >>> agree_to_save(None)  # one process: always
        True
    """
    if _dist.world_size() == 1:
        return True
    try:
        where = state.micro_step
    except Exception:
        where = "stale"
    return all_arrive(f"ftrain/interrupted/{next(_ARRIVALS)}/{where}", timeout)
