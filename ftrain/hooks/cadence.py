"""When a hook needs a step's ``StepEnd``: its cadence, as data (see :mod:`ftrain.hooks.base`).

Every other event reaches every hook; a ``StepEnd`` costs each hook a generator
switch, so a hook declares ``cadence = ftrain.Every(steps=100)``.
"""

from __future__ import annotations

import attrs

__all__ = ["Every", "EVERY_MICRO_BATCH"]


def _updates(value: object) -> frozenset[int]:
    out = frozenset(value)  # type: ignore[arg-type]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(f"Every: at= must hold update numbers >= 1, got {sorted(out, key=str)}.")
    return out


def _positive(_: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"Every: {attribute.name}= must be a whole number >= 1 or None, got {value!r}."
        )


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

    steps: int | None = attrs.field(default=None, validator=_positive)
    start: int = attrs.field(default=0, validator=attrs.validators.and_(
        attrs.validators.instance_of(int), attrs.validators.ge(0)))  # fmt: skip
    at: frozenset[int] = attrs.field(default=frozenset(), converter=_updates)
    epochs: int | None = attrs.field(default=None, validator=_positive)
    micro_batches: bool = False

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
