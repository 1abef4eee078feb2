"""The events of the iteration stream that hooks see (their order: :mod:`ftrain.loop`).

Every event carries ``loop`` (the run: a :class:`~ftrain.run.Run`, also as ``run``) and
``state`` (the state at that event); they are small slotted records compared by identity.
:class:`RunTotals` (``loop.totals``) sums every micro-batch, event or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from ftrain.run import Run
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
    "RunTotals",
]

_Tensor = torch.Tensor
_FOLD = 1023  # a float32 partial sum moves into its float64 total every 1024 adds


_event = attrs.define(eq=False, repr=False)  # slotted records, compared by identity


@_event
class Event:
    """Base class of the stream's events: ``loop`` (or ``run``) is the run, ``state`` its state."""

    loop: Run
    state: TrainState

    @property
    def run(self) -> Run:
        """The run this event belongs to (the same object as ``loop``)."""
        return self.loop

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.state.step}, epoch={self.state.epoch})"


@_event
class RunBegin(Event):
    """The run starts (or continues after an interruption: ``resumed``)."""

    resumed: bool = False


@_event
class EpochBegin(Event):
    """An epoch starts; ``epoch`` counts from 0."""

    epoch: int


@_event
class StepEnd(Event):
    """A micro-batch was processed by the step.

    Attributes:
        metrics: the step's metrics (device tensors; convert only when needed).
        is_update: whether an optimizer update ended with this call.
        data_time: seconds spent waiting for the batch.
        iter_time: seconds since the previous micro-batch's step ended (data, step and hooks).
    """

    metrics: dict[str, Any]
    is_update: bool
    data_time: float
    iter_time: float
    batch: Any = None

    def __repr__(self) -> str:
        return (
            f"StepEnd(step={self.state.step}, micro_step={self.state.micro_step}, "
            f"update={self.is_update}, metrics={sorted(self.metrics)})"
        )


@_event
class Evaluated(Event):
    """An evaluation finished; ``metrics`` holds its results (numbers)."""

    metrics: dict[str, Any]
    by_epoch: bool = False

    def __repr__(self) -> str:
        return f"Evaluated(step={self.state.step}, metrics={self.metrics})"


@_event
class EpochEnd(Event):
    """An epoch ended (its partial accumulation window already applied)."""

    epoch: int


@_event
class RunEnd(Event):
    """The run completed: the last event of a run that was not interrupted."""


@_event
class Paused(Event):
    """``Loop.run(steps=...)`` paused the run, its hooks open; the next event comes when
    ``run()`` continues. Hooks flush what they hold and stop clocks."""


@attrs.define(eq=False)
class RunTotals:
    """Running sums over the micro-batches a loop ran (``loop.totals``), added by the loop.

    One in-place add per scalar metric on its device (no host sync, no hook
    call); a hook wanting an interval's numbers keeps a mark and subtracts it.

    Attributes:
        micro_batches: step calls (plus applied partial windows).
        updates: optimizer updates among them.
        data_time, iter_time: the sums of :class:`StepEnd`'s.
        sums: per scalar metric, a 0-d tensor on its device (read: :meth:`metric_sums`).
        counts: per metric, how many values were summed.

    Example:
        >>> import torch
        >>> t = RunTotals()
        >>> t.add({"loss": torch.tensor(1.0), "n": 2}); t.add({"loss": torch.tensor(3.0), "n": 4})
        >>> t.metric_sums()
        {'loss': (4.0, 2), 'n': (6.0, 2)}
    """

    micro_batches: int = 0
    updates: int = 0
    data_time: float = 0.0
    iter_time: float = 0.0
    sums: dict[str, torch.Tensor] = attrs.Factory(dict)
    counts: dict[str, int] = attrs.Factory(dict)
    _folded: dict[str, float] = attrs.Factory(dict)  # float64 totals of float32 CPU sums
    _restored: dict[str, tuple[float, str]] = attrs.Factory(dict)  # sums to re-create on use

    def add(self, metrics: dict[str, Any]) -> None:
        """Add one micro-batch's metrics (the loop counts its time and updates itself)."""
        sums, counts = self.sums, self.counts
        for key, value in metrics.items():
            acc = sums.get(key)
            if acc is not None and value.__class__ is _Tensor and not value.requires_grad:
                try:
                    acc.add_(value)  # a 0-d sum: other shapes and complex values raise
                except RuntimeError:  # another device, shape or dtype
                    self._add_first(key, value)
                    continue
                count = counts[key] = counts[key] + 1
                if not count & _FOLD and acc.is_cpu:
                    self._fold(key, acc)
            else:
                self._add_first(key, value)

    def _fold(self, key: str, acc: torch.Tensor) -> None:
        # float32 adds fastest on the CPU; folding bounds the error to 1024 adds (~1e-5)
        self._folded[key] = self._folded.get(key, 0.0) + acc.item()  # a CPU tensor: no sync
        acc.zero_()

    def _add_first(self, key: str, value: Any) -> None:
        """A metric's first value, or a number, a graph-attached or other-device tensor."""
        if isinstance(value, _Tensor):
            if value.dim() != 0 or value.is_complex():
                return
            value = value.detach()
        elif isinstance(value, (int, float)):
            value = float(value)
        else:
            return
        acc = self.sums.get(key)
        if acc is None:
            device = None if isinstance(value, float) else value.device
            fast = device is not None and value.dtype is torch.float32 and value.is_cpu
            start, dtype = self._restored.pop(key, (0.0, "float32" if fast else "float64"))
            acc = torch.tensor(start, dtype=getattr(torch, dtype), device=device)
            self.sums[key] = acc
            self.counts.setdefault(key, 0)
        elif isinstance(value, _Tensor) and value.device != acc.device:
            value = value.to(acc.device)
        acc.add_(value)
        count = self.counts[key] = self.counts[key] + 1
        if not count & _FOLD and acc.is_cpu:
            self._fold(key, acc)

    def metric_sums(self) -> dict[str, tuple[float, int]]:
        """Each metric's ``(sum, count)`` as numbers: one host sync per device."""
        by_device: dict[torch.device, list[str]] = {}
        for key, acc in self.sums.items():
            by_device.setdefault(acc.device, []).append(key)
        values: dict[str, float] = {}
        with torch.no_grad():
            for keys in by_device.values():
                got = torch.stack([self.sums[k].double() for k in keys]).tolist()
                values.update(zip(keys, got))
        for key, (start, _) in self._restored.items():
            values[key] = start
        folded = self._folded
        return {
            k: (values[k] + folded.get(k, 0.0), c) for k, c in self.counts.items() if k in values
        }

    def state_dict(self) -> dict[str, Any]:
        """The sums exactly (a resumed run's logs then match an uninterrupted run's bit for bit)."""
        sums = {
            k: (acc.item(), str(acc.dtype).removeprefix("torch.")) for k, acc in self.sums.items()
        }
        fields = ("micro_batches", "updates", "data_time", "iter_time", "counts")
        return {
            **{f: getattr(self, f) for f in fields},
            "sums": {**self._restored, **sums},
            "folded": dict(self._folded),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue the sums of :meth:`state_dict` (each re-created on its metric's device)."""
        for f in ("micro_batches", "updates", "data_time", "iter_time"):
            setattr(self, f, saved[f])
        self.counts = dict(saved["counts"])
        self.sums = {}
        self._restored = {k: (float(v), str(d)) for k, (v, d) in saved["sums"].items()}
        self._folded = dict(saved["folded"])
