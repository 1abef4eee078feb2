"""``TrainState``: the immutable record a training step consumes and returns.

Donation: a step updates the tensors in place and returns a *new* record; the
one it was given is consumed (using it again raises
:class:`~ftrain.errors.StaleStateError` rather than training from weights that
changed under it).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from ftrain._checks import whole
from ftrain.errors import StaleStateError

__all__ = ["TrainState", "StaleStateError", "Unloaded", "advance", "consume"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_FIELDS = ("model", "optimizer", "step", "micro_step", "epoch", "transforms")
_COUNTERS = ("step", "micro_step", "epoch")


class Lineage:
    """The live model and optimizer, shared by every record over them.

    Only records of ``version`` are valid: consuming one bumps it. ``newest``
    holds the newest record's fields, not the record (a cycle through it would
    keep the model, and GPU memory, alive until the garbage collector runs).
    """

    __slots__ = ("model", "optimizer", "version", "consumer", "newest")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.version = 0
        self.consumer = ""  # what consumed version ``version - 1``
        self.newest: tuple[Any, ...] | None = None


class Unloaded:
    """Loaded state of a transform not run yet; the step owning it restores it on its first call."""

    __slots__ = ("saved",)

    def __init__(self, saved: Any) -> None:
        self.saved = saved

    def __repr__(self) -> str:
        return "<saved, restored at the next step>"


def _freeze(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not mapping:
        return _EMPTY
    return mapping if type(mapping) is MappingProxyType else MappingProxyType(dict(mapping))


def _check_owns(model: torch.nn.Module, optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse an optimizer holding none of ``model``'s parameters, a parameter-free model's
    included (a subset, or extra tensors of your own beside them, are fine)."""
    own = {id(p) for p in model.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or any(id(p) in own for p in params):
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:3])
    empty = ""
    if not own:  # a tensor of the user's own is trained as a parameter of a module
        empty = f" ({type(model).__name__} has none; a tensor that trains belongs in a module)"
    raise ValueError(
        f"{where}: the optimizer holds none of the model's parameters{empty}: its "
        f"{len(params)} tensor(s) (shapes {shapes}{', ...' if len(params) > 3 else ''}) belong "
        "to another module, or to this one before it was wrapped, sharded or replaced, so "
        "training would never change the model. Build the optimizer on this model's "
        "parameters after wrapping it: torch.optim.AdamW(model.parameters(), ...)."
    )


def _check_counters(where: str, **counters: object) -> None:
    """``step``, ``micro_step``, ``epoch``: whole numbers >= 0."""
    for name, value in counters.items():
        whole(f"{where}: {name}", value, 0)


@attrs.frozen(repr=False, eq=False)
class TrainState:
    """Everything a training run needs to continue, as one immutable record.

    Attributes:
        model, optimizer: the live objects (reading them from a consumed
            record raises :class:`StaleStateError`).
        step: optimizer updates attempted (an fp16 update skipped for
            overflow counts; the AMP state counts those separately).
        micro_step: micro-batches (step calls) processed.
        epoch: the epoch counter, advanced by the loop.
        transforms: per-transform state, keyed by transform name (read-only).

    Example:
        >>> import torch, ftrain
        >>> model = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> state.step, state.epoch
        (0, 0)
    """

    step: int
    micro_step: int
    epoch: int
    transforms: Mapping[str, Any]
    # model and optimizer live in the lineage, so a step builds a record of six fields
    _lineage: Lineage = attrs.field(alias="lineage")
    _version: int = attrs.field(alias="version")

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int = 0,
        epoch: int = 0,
    ) -> TrainState:
        """A fresh state owning ``model`` and ``optimizer`` (built on the model's parameters).

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(4, 2)
            >>> s = ftrain.TrainState.create(m, torch.optim.AdamW(m.parameters()))
            >>> s.model is m
            True
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"TrainState.create: model must be a torch.nn.Module, got {type(model).__name__}."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "TrainState.create: optimizer must be a torch.optim.Optimizer built on the "
                f"model's parameters, got {type(optimizer).__name__}."
            )
        _check_owns(model, optimizer, "TrainState.create")
        _check_counters("TrainState.create", step=step, epoch=epoch)
        return cls(step, 0, epoch, _EMPTY, Lineage(model, optimizer), 0)

    @property
    def is_consumed(self) -> bool:
        """True once a step (or a load) has consumed this record."""
        return self._version != self._lineage.version

    def check_fresh(self) -> None:
        """Raise :class:`StaleStateError` (naming who consumed it, and the fix) if consumed."""
        if self._version == self._lineage.version:
            return
        raise StaleStateError(
            f"This TrainState (step={self.step}, micro_step={self.micro_step}) was consumed by "
            f"{self._consumer()}: that call updated the model and optimizer tensors in place and "
            "returned a new state. Use the state it returned (`state, metrics = step(state, "
            "batch)`; `state.latest()` finds the newest one), or call `state.clone()` before "
            "stepping to keep an independent copy you can go back to."
        )

    def _consumer(self) -> str:
        lin = self._lineage
        last = self._version == lin.version - 1 and lin.consumer
        return lin.consumer if last else "a later step call"

    @property
    def model(self) -> torch.nn.Module:
        lin = self._lineage
        if self._version != lin.version:
            self.check_fresh()
        return lin.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        lin = self._lineage
        if self._version != lin.version:
            self.check_fresh()
        return lin.optimizer

    def latest(self) -> TrainState:
        """A valid record equal to the newest one over these tensors (after an interrupted loop).

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s0 = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> s1, _ = ftrain.make_step(lambda m, b: m(b).sum())(s0, torch.ones(1, 2))
            >>> s0.latest().step == s1.step, s0.latest().is_consumed
            (True, False)
        """
        if not self.is_consumed:
            return self
        newest = self._lineage.newest
        latest = self if newest is None else TrainState(*newest[:4], self._lineage, newest[4])
        latest.check_fresh()  # consumed without a successor (a failed update)
        return latest

    def replace(self, **changes: Any) -> TrainState:
        """A copy with some fields changed, sharing the tensors (both valid until a step).

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> s.replace(epoch=3).epoch
            3
        """
        self.check_fresh()
        if unknown := set(changes) - set(_FIELDS):
            raise TypeError(
                f"TrainState.replace: unknown field(s) {sorted(unknown)}; fields are "
                f"{', '.join(_FIELDS)}."
            )
        _check_counters("TrainState.replace", **{k: changes[k] for k in _COUNTERS if k in changes})
        f = {name: changes.get(name, getattr(self, name)) for name in _FIELDS}
        counters = (f["step"], f["micro_step"], f["epoch"], _freeze(f["transforms"]))
        lin = self._lineage
        if f["model"] is not lin.model or f["optimizer"] is not lin.optimizer:
            _check_owns(f["model"], f["optimizer"], "TrainState.replace")
            return TrainState(*counters, Lineage(f["model"], f["optimizer"]), 0)
        # same tensors, same lineage: the copy is now the newest record (``latest()``)
        return _record(self, *counters, self._version)

    def clone(self) -> TrainState:
        """An independent deep copy (model, optimizer, gradients, transform state): a rollback
        point. A DDP/FSDP2 model is copied and wrapped again: a collective, call it on every rank.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> s.clone().model is s.model
            False
        """
        self.check_fresh()
        model = self._lineage.model
        parts = (model, self._lineage.optimizer, dict(self.transforms))
        copied = None
        wrapped = ("torch.distributed", "torch.nn.parallel")
        if any(type(m).__module__.startswith(wrapped) for m in model.modules()):
            from ftrain.dist import copy_wrapped  # DDP/FSDP2 cannot be deep-copied

            copied = copy_wrapped(*parts)
        if copied is None:
            copied = copy.deepcopy(parts)
            for src, dst in zip(model.parameters(), copied[0].parameters(), strict=True):
                if src.grad is not None:  # deepcopy leaves .grad behind
                    dst.grad = src.grad.detach().clone()
        lineage = Lineage(copied[0], copied[1])
        return TrainState(self.step, self.micro_step, self.epoch, _freeze(copied[2]), lineage, 0)

    def __repr__(self) -> str:
        if self.is_consumed:
            return f"TrainState(step={self.step}, epoch={self.epoch}, <consumed by {self._consumer()}>)"
        model, opt = self._lineage.model, self._lineage.optimizer
        n = sum(p.numel() for p in model.parameters())
        units = (("G", 1e9), ("M", 1e6), ("K", 1e3))
        size = next((f"{n / s:.3g}{u}" for u, s in units if n >= s), str(n))
        lrs = sorted({g["lr"] for g in opt.param_groups if "lr" in g}, key=float)
        lr = f"lr={lrs[0]:g}" if len(lrs) == 1 else f"lr={lrs[0]:g}..{lrs[-1]:g}"
        groups = len(opt.param_groups)
        transforms = ", ".join(f"{k}: {v!r}" for k, v in self.transforms.items())
        return (
            f"TrainState(step={self.step}, micro_step={self.micro_step}, epoch={self.epoch}, "
            f"model={type(model).__name__} ({size} params), optimizer={type(opt).__name__}("
            f"{lr}, {groups} group{'s' if groups != 1 else ''}), transforms={{{transforms}}})"
        )


def _record(
    like: TrainState, step: int, micro_step: int, epoch: int, transforms: Mapping, version: int
) -> TrainState:
    """A record over ``like``'s lineage (plain attrs init); it becomes the lineage's newest."""
    lin = like._lineage
    lin.newest = (step, micro_step, epoch, transforms, version)
    return TrainState(step, micro_step, epoch, transforms, lin, version)


def consume(state: TrainState, by: str) -> None:
    """Mark ``state`` (and its ``replace`` copies) consumed; later errors name ``by``."""
    lin = state._lineage
    lin.consumer = by
    lin.version = state._version + 1


def advance(
    state: TrainState,
    by: str,
    step: int,
    micro_step: int,
    transforms: Mapping[str, Any],
    epoch: int | None = None,
) -> TrainState:
    """Consume ``state`` and return its successor over the same (updated in place) tensors."""
    lin = state._lineage
    lin.consumer = by
    version = lin.version = state._version + 1
    if type(transforms) is dict:
        transforms = MappingProxyType(transforms)
    return _record(
        state, step, micro_step, state.epoch if epoch is None else epoch, transforms, version
    )
