"""What a checkpoint save is given: a :class:`Snapshot` of the run, made by the loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from ftrain.state import TrainState

__all__ = ["Snapshot"]


@attrs.frozen
class Snapshot:
    """The run at one moment, as :meth:`Checkpointer.save
    <ftrain.persist.checkpointer.Checkpointer.save>` writes it (``Run.snapshot()`` makes one).

    Valid until training goes on: ``payload`` shares the model's and optimizer's tensors (a
    background save copies them to host memory before it returns).

    Attributes:
        payload: the checkpoint itself (what :meth:`ftrain.loop.Loop.checkpoint` returns and
            :meth:`ftrain.loop.Loop.load` takes): ``format``, ``state``, ``loop``, ``data``,
            ``hooks``, ``time``, ``dist``.
        step, micro_step, epoch: the state's counters (recorded in the manifest entry).
        run_id: the run it belongs to (``max_keep`` prunes only its own files).
        state: the live state; a sharded (FSDP2) save reads its model and optimizer shards.
        pending: micro-batches of a partial accumulation window in ``state`` (an FSDP2 save
            refuses one: the partial gradients are out of its reach).
        local_hook_keys: per hook name, the keys of its state each rank saves its own of.

    Example:
        >>> snap = Snapshot({"format": "demo"}, step=4, micro_step=8, epoch=0, run_id="r1")
        >>> snap.step, snap.pending, dict(snap.local_hook_keys)
        (4, 0, {})
    """

    payload: dict[str, Any]
    step: int
    micro_step: int
    epoch: int
    run_id: str | None = None
    state: TrainState | None = None
    pending: int = 0
    local_hook_keys: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
