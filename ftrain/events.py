"""The events of the iteration stream that hooks see.

A run produces, in order::

    RunBegin
    EpochBegin(epoch=0)
        StepEnd ...            one per micro-batch (``is_update`` on optimizer updates)
        Evaluated ...          added to the stream by an evaluation hook
    EpochEnd(epoch=0)          after the partial accumulation window was applied
    EpochBegin(epoch=1)
        ...
    RunEnd                     only when the run completed (not on interruption)

``Paused`` appears where ``Loop.run(steps=...)`` pauses a run (after the
last step's events); the run's next event follows when it continues.

Every event carries ``loop`` (the :class:`~ftrain.loop.Loop`: its ``state`` is
the newest consistent state) and ``state`` (the state at that event).
Events are small slotted objects; hooks test them with ``isinstance``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrain.loop import Loop
    from ftrain.state import TrainState

__all__ = [
    "Event",
    "RunBegin",
    "EpochBegin",
    "StepEnd",
    "Evaluated",
    "EpochEnd",
    "Paused",
    "RunEnd",
]


class Event:
    """Base class of the stream's events."""

    __slots__ = ("loop", "state")

    def __init__(self, loop: Loop, state: TrainState) -> None:
        self.loop = loop
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.state.step}, epoch={self.state.epoch})"


class RunBegin(Event):
    """The run starts (or continues after an interruption: ``resumed``)."""

    __slots__ = ("resumed",)

    def __init__(self, loop: Loop, state: TrainState, resumed: bool = False) -> None:
        super().__init__(loop, state)
        self.resumed = resumed


class EpochBegin(Event):
    """An epoch starts; ``epoch`` counts from 0."""

    __slots__ = ("epoch",)

    def __init__(self, loop: Loop, state: TrainState, epoch: int) -> None:
        super().__init__(loop, state)
        self.epoch = epoch


class StepEnd(Event):
    """A micro-batch was processed by the step.

    Attributes:
        metrics: the step's metrics (device tensors; convert only when needed).
        is_update: whether an optimizer update ended with this call.
        data_time: seconds spent waiting for the batch.
        iter_time: seconds since the previous ``StepEnd`` (data, step and hooks).
        batch: the batch itself.
    """

    __slots__ = ("metrics", "is_update", "data_time", "iter_time", "batch")

    def __init__(
        self,
        loop: Loop,
        state: TrainState,
        metrics: dict[str, Any],
        is_update: bool,
        data_time: float,
        iter_time: float,
        batch: Any = None,
    ) -> None:
        super().__init__(loop, state)
        self.metrics = metrics
        self.is_update = is_update
        self.data_time = data_time
        self.iter_time = iter_time
        self.batch = batch

    def __repr__(self) -> str:
        return (
            f"StepEnd(step={self.state.step}, micro_step={self.state.micro_step}, "
            f"update={self.is_update}, metrics={sorted(self.metrics)})"
        )


class Evaluated(Event):
    """An evaluation finished; ``metrics`` holds its results (numbers)."""

    __slots__ = ("metrics", "by_epoch")

    def __init__(
        self, loop: Loop, state: TrainState, metrics: dict[str, Any], by_epoch: bool = False
    ) -> None:
        super().__init__(loop, state)
        self.metrics = metrics
        self.by_epoch = by_epoch

    def __repr__(self) -> str:
        return f"Evaluated(step={self.state.step}, metrics={self.metrics})"


class EpochEnd(Event):
    """An epoch ended (its partial accumulation window already applied)."""

    __slots__ = ("epoch",)

    def __init__(self, loop: Loop, state: TrainState, epoch: int) -> None:
        super().__init__(loop, state)
        self.epoch = epoch


class RunEnd(Event):
    """The run completed: the last event of a run that was not interrupted."""

    __slots__ = ()


class Paused(Event):
    """``Loop.run(steps=...)`` reached its steps: the run pauses, its hooks open.

    Every hook has finished the last step (evaluations included) when it
    sees this event; the next event comes when ``run()`` continues the run.
    Hooks flush what they hold (the logger its sinks) and stop clocks (the
    timer leaves the pause out of the elapsed time).
    """

    __slots__ = ()
