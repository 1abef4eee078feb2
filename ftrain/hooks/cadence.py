"""When a hook needs a step's ``StepEnd``: its cadence, as data (see :mod:`ftrain.hooks.base`).

Every other event reaches every hook; a ``StepEnd`` costs each hook a generator
switch, so a hook declares ``cadence = ftrain.Every(steps=100)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from ftrain._checks import flag, whole

__all__ = ["Every", "EVERY_MICRO_BATCH"]


def _updates(value: Iterable[int]) -> frozenset[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"Every: at= must be a collection of update numbers, e.g. at=(1,) or at=[10, 20], "
            f"got {value!r}."
        )
    out = frozenset(value)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(
            f"Every: at= must hold whole update numbers >= 1 (updates count from 1), got "
            f"{sorted(out, key=str)}."
        )
    return out


def _whole(minimum: int, none: bool) -> Callable[[object, attrs.Attribute, object], None]:
    def check(_: object, attribute: attrs.Attribute, value: object) -> None:
        whole(f"Every: {attribute.name}", value, minimum, none=none)

    return check


def _flag(_: object, attribute: attrs.Attribute, value: object) -> None:
    flag(f"Every: {attribute.name}", value)


@attrs.frozen
class Every:
    """A hook's cadence: which optimizer updates' ``StepEnd`` it needs, and its epochs.

    Attributes:
        steps: the ``StepEnd`` of every ``steps``-th update (``steps``, ``2*steps``...);
            ``None``: none by count.
        start: count ``steps`` from this update instead (``start``, ``start + steps``...).
        at: the ``StepEnd`` of these update numbers too (``at=(1,)``: the first).
        epochs: every ``epochs``-th epoch (``EpochEnd`` reaches every hook; the
            hook asks :meth:`due_epoch`).
        micro_batches: every micro-batch's ``StepEnd`` (the full stream).

    Example:
        >>> import ftrain
        >>> c = ftrain.Every(steps=50, at=(1,))
        >>> c.next_due(0), c.next_due(1), c.next_due(50), c.due(100), c.due(99)
        (1, 50, 100, True, False)
        >>> ftrain.Every(steps=10, start=5).next_due(0), ftrain.Every(steps=10, start=5).due(25)
        (5, True)
        >>> ftrain.Every(epochs=2).due_epoch(1)       # the second epoch (counted from 0)
        True
    """

    steps: int | None = attrs.field(default=None, validator=_whole(1, none=True))
    start: int = attrs.field(default=0, validator=_whole(0, none=False))
    at: frozenset[int] = attrs.field(default=frozenset(), converter=_updates)
    epochs: int | None = attrs.field(default=None, validator=_whole(1, none=True))
    micro_batches: bool = attrs.field(default=False, validator=_flag)

    def next_due(self, step: int) -> int | None:
        """The first update after ``step`` whose ``StepEnd`` is needed (``None``: none)."""
        n, s = self.steps, self.start
        best = None if n is None else s if step < s else s + ((step - s) // n + 1) * n
        for k in self.at:
            if k > step and (best is None or k < best):
                best = k
        return best

    def due(self, step: int) -> bool:
        """Whether update ``step`` is one of this cadence's."""
        n, s = self.steps, self.start
        return (n is not None and step >= s and (step - s) % n == 0) or step in self.at

    def due_epoch(self, epoch: int) -> bool:
        """Whether the end of epoch ``epoch`` (counted from 0) is one of this cadence's."""
        return self.epochs is not None and (epoch + 1) % self.epochs == 0


#: The full stream: every micro-batch's ``StepEnd`` (a hook without a cadence).
EVERY_MICRO_BATCH = Every(micro_batches=True)
