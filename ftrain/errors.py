"""Exceptions raised by ftrain, each naming the problem and the fix."""

from __future__ import annotations

from typing import Any


class StaleStateError(RuntimeError):
    """A :class:`~ftrain.TrainState` was used after a step consumed it.

    A step updates the model and optimizer tensors in place ("donation") and
    returns a new record; the record it was given is consumed. Keep using the
    returned state, or call ``state.clone()`` *before* stepping to keep an
    independent copy you can roll back to.
    """


class NonFiniteLossError(FloatingPointError):
    """The loss of an optimizer update was NaN or infinite.

    Raised before the optimizer update, so weights and optimizer state are
    those of the last good update. ``err.state`` is a valid
    :class:`~ftrain.TrainState` at that point (the failed accumulation window
    discarded): continue from it, or load a checkpoint.
    """

    def __init__(self, message: str, state: Any = None) -> None:
        super().__init__(message)
        self.state = state


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt, or does not match."""
