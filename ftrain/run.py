"""The run as hooks and the checkpointer see it: :class:`Run`, what ``ev.run`` (``ev.loop``) is.

A hook reads the run only through these names (:class:`ftrain.Loop` provides them); they
describe the run at the event being handled:

- ``state``: the newest consistent :class:`~ftrain.TrainState`;
  ``step``: the training :class:`~ftrain.step.Step` (its ``loss_fn``, ``pending(state)``)
- ``work_dir``: the run's directory (a path, or a URL on an object store), or ``None``;
  ``log_dir``: the local directory hooks write their files to (``work_dir``, or a local copy
  of a store's); ``run_id``: the run's id (kept across resume, recorded in manifests);
  ``resumed_from``: the checkpoint it continued from
- ``max_steps``, ``epochs``: where the run stops (``None``: not by that measure)
- ``totals``: :class:`~ftrain.events.RunTotals`, counts, times and metric sums
- ``in_epoch``, ``batch_in_epoch`` (micro-batches of the epoch that reached the step),
  ``batches_per_epoch`` (``len(data)``, or ``None``)
- ``checkpointer``: the run's :class:`~ftrain.persist.checkpointer.Checkpointer`;
  ``snapshot()``: a :class:`~ftrain.persist.snapshot.Snapshot` for its ``save``
- ``hooks``: the :class:`~ftrain.hooks.base.HookPlan` (``of_type`` finds hooks);
  ``request_stop(reason)``: stop after the current event
- ``replace_state(state)``: the one way a hook changes the run's state: ``state`` derived
  from ``run.state`` at this event (an evaluation fed a plateau rule) takes its place
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ftrain.events import RunTotals
    from ftrain.hooks.base import HookPlan
    from ftrain.persist.checkpointer import Checkpointer
    from ftrain.persist.location import Location
    from ftrain.persist.snapshot import Snapshot
    from ftrain.state import TrainState
    from ftrain.step import Step

__all__ = ["Run"]


@runtime_checkable
class Run(Protocol):
    """The typed view of a training run that hooks and the checkpointer read.

    Example:
        >>> import torch, ftrain
        >>> from ftrain.run import Run
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> lp = ftrain.Loop(ftrain.make_step(lambda m, b: m(b).sum()), state, [torch.ones(1, 2)])
        >>> isinstance(lp, Run), lp.snapshot().step
        (True, 0)
    """

    @property
    def state(self) -> TrainState:
        """The newest consistent state."""

    @property
    def step(self) -> Step:
        """The training step."""

    @property
    def work_dir(self) -> Location | None:
        """Where checkpoints and logs go (``None``: nowhere): a local path, or a
        :class:`~ftrain.persist.location.StoreURL` on an object store."""

    @property
    def log_dir(self) -> Path | None:
        """The local directory hooks write their own files to (logs, traces): ``work_dir``,
        or for a ``work_dir`` on a store a local copy uploaded into it
        (:mod:`ftrain.persist.mirror`); ``None`` without a ``work_dir``."""

    @property
    def run_id(self) -> str:
        """Identifies the run in checkpoint manifests (kept across resume)."""

    @property
    def max_steps(self) -> int | None:
        """The number of optimizer updates the run stops at."""

    @property
    def epochs(self) -> int | None:
        """The number of passes over the data the run stops at."""

    @property
    def totals(self) -> RunTotals:
        """Counts, times and metric sums of every micro-batch the run ran."""

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch is under way (its data opened, or a resumed epoch to continue)."""

    @property
    def batch_in_epoch(self) -> int:
        """Micro-batches of the current epoch that reached the step."""

    @property
    def batches_per_epoch(self) -> int | None:
        """``len(data)``, or ``None`` when the data has no usable length."""

    @property
    def resumed_from(self) -> Location | None:
        """The checkpoint the run continued from (``None``: a fresh start)."""

    @property
    def checkpointer(self) -> Checkpointer:
        """How this run writes and reads checkpoints (one per run and process)."""

    @property
    def hooks(self) -> HookPlan:
        """The run's hooks in the order they run."""

    def request_stop(self, reason: str = "requested") -> None:
        """Stop after the current event."""

    def replace_state(self, state: TrainState) -> None:
        """Put ``state`` in the run's place: one derived from :attr:`state` at this event
        (same update, micro-batch and epoch; e.g. :meth:`Step.observe
        <ftrain.step.Step.observe>` after an evaluation); the next step continues from it."""

    def snapshot(self) -> Snapshot:
        """The run now, for :meth:`Checkpointer.save
        <ftrain.persist.checkpointer.Checkpointer.save>` (valid until training goes on)."""
