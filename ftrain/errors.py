"""Exceptions raised by ftrain, each naming the problem and the fix."""

from __future__ import annotations

from typing import Any


class StaleStateError(RuntimeError):
    """A :class:`~ftrain.TrainState` was used after a step consumed it (donated its tensors).

    Use the returned state, or ``state.clone()`` *before* stepping to keep a copy.
    """


class NonFiniteLossError(FloatingPointError):
    """The loss of an optimizer update was NaN or infinite (raised before the update).

    ``err.state`` is a valid :class:`~ftrain.TrainState` of the last good
    update (the failed window discarded): continue from it.
    """

    def __init__(self, message: str, state: Any = None) -> None:
        super().__init__(message)
        self.state = state


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt, or does not match."""
