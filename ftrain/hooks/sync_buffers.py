"""``SyncBuffersHook``: keep the model's buffers (BatchNorm statistics) equal on every rank."""

from __future__ import annotations

from collections.abc import Iterator

from ftrain._checks import whole
from ftrain.dist import sync_buffers, world_size
from ftrain.events import EpochEnd, Event, RunEnd, StepEnd
from ftrain.hooks.cadence import Every

__all__ = ["SyncBuffersHook"]


class SyncBuffersHook:
    """Synchronise the model's buffers across ranks at the end of each epoch.

    FSDP2 (and DDP with ``broadcast_buffers=False``) lets BatchNorm statistics drift apart.
    Also every ``every`` updates if given, and at the end; it runs at priority ``HIGH``, so
    evaluation and checkpoints see the synchronised buffers. One process: it does nothing.

    Example:
        >>> import ftrain
        >>> ftrain.dist.SyncBuffersHook()
        SyncBuffersHook(mode='mean', every=None)
    """

    priority = "HIGH"
    name = "sync_buffers"

    def __init__(self, mode: str = "mean", *, every: int | None = None) -> None:
        if mode not in ("mean", "broadcast"):
            raise ValueError(f"SyncBuffersHook: mode must be 'mean' or 'broadcast', got {mode!r}.")
        whole("SyncBuffersHook: every", every, 1, none=True)
        self.mode = mode
        self.every = every
        self.cadence = Every(steps=every)  # every=None: no StepEnd, only the epoch and run ends

    def __repr__(self) -> str:
        return f"SyncBuffersHook(mode={self.mode!r}, every={self.every})"

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        if world_size() == 1:
            yield from events
            return
        synced_at = -1  # loop.totals.micro_batches when the buffers were last synchronised
        for ev in events:
            kind = type(ev)
            totals = ev.loop.totals
            due = kind is StepEnd and ev.is_update and self.cadence.due(ev.state.step)
            ended = (kind is EpochEnd or kind is RunEnd) and totals.micro_batches != synced_at
            if due or ended:
                sync_buffers(ev.loop.state.model, self.mode)
                synced_at = totals.micro_batches
            yield ev
