"""``TrainState``: the immutable record a training step consumes and returns.

The record holds the model, the optimizer, the step counters and the state of
every transform (loss scale, clip statistics, accumulation window, memory
plan). The logic lives in functions (:mod:`ftrain.step`,
:mod:`ftrain.transforms`); the state is data.

Donation: a step updates the tensors in place (no copies, as fast as a plain
loop) and returns a *new* record. The record it was given is consumed: using
it again raises :class:`~ftrain.errors.StaleStateError` rather than silently
training from weights that have changed under it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from ftrain.errors import StaleStateError

__all__ = ["TrainState", "StaleStateError", "capture_rng", "restore_rng"]

FORMAT = "ftrain.TrainState/1"
_EMPTY: Mapping[str, Any] = MappingProxyType({})


class _Lineage:
    """Shared by every record that refers to the same live tensors.

    ``version`` is the version of the only records still valid; a step bumps
    it, so every older record (and every ``replace`` copy of one) is stale.
    """

    __slots__ = ("version", "last_consumer", "_fields")

    def __init__(self) -> None:
        self.version = 0
        self.last_consumer = ""  # what consumed version ``version - 1``
        # The fields of the newest record, not the record: the record refers to
        # this lineage, so holding it would make a reference cycle that keeps the
        # model (and GPU memory) alive until the garbage collector runs (and a
        # weak reference to it costs a step ~1 µs). The fields refer to nothing
        # that leads back here, so a consumed record can still find the newest
        # state (``latest()``) after an interrupted loop.
        self._fields: tuple[Any, ...] | None = None

    @property
    def latest(self) -> TrainState | None:
        """A record equal to the newest one (the newest version's fields)."""
        if self._fields is None:
            return None
        model, optimizer, step, micro_step, epoch, transforms, version = self._fields
        return TrainState(
            model=model,
            optimizer=optimizer,
            step=step,
            micro_step=micro_step,
            epoch=epoch,
            transforms=transforms,
            lineage=self,
            version=version,
        )

    def consumer(self, version: int) -> str:
        if version == self.version - 1 and self.last_consumer:
            return self.last_consumer
        return "a later step call"


class Unloaded:
    """Saved state of a transform the state has not been stepped with yet.

    ``state.load_state_dict`` keeps it until the step that owns the transform
    first runs and turns it into the transform's live state.
    """

    __slots__ = ("saved",)

    def __init__(self, saved: Any) -> None:
        self.saved = saved

    def __repr__(self) -> str:
        return "<saved, restored at the next step>"


def _freeze(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not mapping:
        return _EMPTY
    if isinstance(mapping, MappingProxyType):
        return mapping
    return MappingProxyType(dict(mapping))


@attrs.frozen(repr=False, eq=False)
class TrainState:
    """Everything a training run needs to continue, as one immutable record.

    Create it with :meth:`create`; evolve it with :meth:`replace`; a step
    returns a new one and consumes the one it was given.

    Attributes:
        step: optimizer updates attempted so far (completed accumulation
            windows; an fp16 update skipped for overflow still counts, and is
            counted separately in the AMP state).
        micro_step: micro-batches (calls of the step) processed so far.
        epoch: the epoch counter, advanced by the loop.
        transforms: per-transform state, keyed by transform name.

    Example:
        >>> import torch, ftrain
        >>> model = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> state.step, state.epoch
        (0, 0)
    """

    _model: torch.nn.Module = attrs.field(alias="model")
    _optimizer: torch.optim.Optimizer = attrs.field(alias="optimizer")
    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    transforms: Mapping[str, Any] = attrs.field(default=_EMPTY, converter=_freeze)
    _lineage: _Lineage = attrs.field(factory=_Lineage, alias="lineage")
    _version: int = attrs.field(default=0, alias="version")

    # ------------------------------------------------------------------ create
    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int = 0,
        epoch: int = 0,
    ) -> TrainState:
        """A fresh state owning ``model`` and ``optimizer``.

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
        return cls(model=model, optimizer=optimizer, step=step, epoch=epoch)

    # ----------------------------------------------------------- freshness
    @property
    def is_consumed(self) -> bool:
        """True once a step (or a load) has consumed this record."""
        return self._version != self._lineage.version

    def check_fresh(self) -> None:
        """Raise :class:`StaleStateError` if this record has been consumed."""
        if self._version != self._lineage.version:
            raise StaleStateError(self._stale_message())

    def _stale_message(self) -> str:
        by = self._lineage.consumer(self._version)
        return (
            f"This TrainState (step={self.step}, micro_step={self.micro_step}) was consumed by "
            f"{by}: that call updated the model and optimizer tensors in place and returned a "
            "new state. Use the state it returned (`state, metrics = step(state, batch)`; "
            "`state.latest()` finds the newest one), or call `state.clone()` before stepping "
            "to keep an independent copy you can go back to."
        )

    def latest(self) -> TrainState:
        """A valid record of the newest state sharing this record's tensors.

        (Equal to the newest record the steps returned, not the same object.) Handy in a notebook after an interrupted loop: ``state = state.latest()``.

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
        latest = self._lineage.latest
        if latest is None or latest.is_consumed:
            raise StaleStateError(self._stale_message())
        return latest

    @property
    def model(self) -> torch.nn.Module:
        """The model (raises :class:`StaleStateError` on a consumed record)."""
        if self._version != self._lineage.version:
            raise StaleStateError(self._stale_message())
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (raises :class:`StaleStateError` on a consumed record)."""
        if self._version != self._lineage.version:
            raise StaleStateError(self._stale_message())
        return self._optimizer

    def _consume(self, by: str) -> None:
        """Mark this record (and its ``replace`` siblings) consumed."""
        lin = self._lineage
        lin.last_consumer = by
        lin.version = self._version + 1

    def _successor(self, **changes: Any) -> TrainState:
        """The record that follows this one after a step mutated the tensors.

        Internal: the caller has already consumed ``self``.
        """
        transforms = changes.get("transforms", self.transforms)
        if type(transforms) is dict:
            transforms = MappingProxyType(transforms)  # a fresh dict the step built
        return _record(
            self,
            changes.get("step", self.step),
            changes.get("micro_step", self.micro_step),
            changes.get("epoch", self.epoch),
            transforms,
            self._lineage.version,
        )

    # ---------------------------------------------------------------- evolve
    def replace(self, **changes: Any) -> TrainState:
        """A copy with some fields changed (flax-style), sharing the tensors.

        The copy and the original stay valid until a step consumes either.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> s.replace(epoch=3).epoch
            3
        """
        self.check_fresh()
        unknown = set(changes) - {"model", "optimizer", "step", "micro_step", "epoch", "transforms"}
        if unknown:
            raise TypeError(
                f"TrainState.replace: unknown field(s) {sorted(unknown)}; fields are model, "
                "optimizer, step, micro_step, epoch, transforms."
            )
        fields = {
            "model": self._model,
            "optimizer": self._optimizer,
            "step": self.step,
            "micro_step": self.micro_step,
            "epoch": self.epoch,
            "transforms": self.transforms,
        }
        fields.update(changes)
        if (
            changes.get("model", self._model) is not self._model
            or changes.get("optimizer", self._optimizer) is not self._optimizer
        ):
            return TrainState(**fields)  # new tensors: a new lineage
        # Same tensors, same lineage: the copy is now the newest record (``latest()``).
        return _record(
            self,
            fields["step"],
            fields["micro_step"],
            fields["epoch"],
            _freeze(fields["transforms"]),
            self._version,
        )

    def clone(self) -> TrainState:
        """An independent deep copy (model, optimizer, gradients, transform state).

        The copy includes the gradients of a partial accumulation window, so
        continuing from the copy trains exactly as continuing from the original.

        The copy stays valid whatever happens to the original, so it is the way
        to keep a rollback point in a notebook.

        A DDP or FSDP2 model is not deep-copied (neither supports it): the
        user's module is copied and wrapped again the same way (FSDP2: each
        rank copies its own shards, nothing is gathered). That is a
        collective under ``torch.distributed``: call ``clone()`` on every rank.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> c = s.clone()
            >>> c.model is s.model
            False
        """
        self.check_fresh()
        copied = None
        if _is_wrapped(self._model):
            # DDP and FSDP2 modules cannot be deep-copied: ftrain.dist copies the user's
            # module and wraps (shards) the copy the same way (a collective: every rank).
            from ftrain.dist import copy_wrapped

            copied = copy_wrapped(self._model, self._optimizer, dict(self.transforms))
        if copied is None:
            copied = copy.deepcopy((self._model, self._optimizer, dict(self.transforms)))
            # deepcopy leaves .grad behind: carry a partial accumulation window over
            for src, dst in zip(self._model.parameters(), copied[0].parameters(), strict=True):
                if src.grad is not None:
                    dst.grad = src.grad.detach().clone()
        model, optimizer, transforms = copied
        return TrainState(
            model=model,
            optimizer=optimizer,
            step=self.step,
            micro_step=self.micro_step,
            epoch=self.epoch,
            transforms=transforms,
        )

    # ----------------------------------------------------------- checkpoints
    def state_dict(self, *, rng: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly, as a ``torch.save``-able dict.

        Holds the model and optimizer state dicts, the counters, every
        transform's state (loss scale, clip statistics, the partial
        accumulation window *with its gradients*) and the RNG states.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> sorted(s.state_dict())[:3]
            ['epoch', 'format', 'grads']
        """
        self.check_fresh()
        from ftrain.persist.state import state_dict

        return state_dict(self, rng=rng)

    def load_state_dict(
        self, saved: Mapping[str, Any], *, rng: bool = True, strict: bool = True
    ) -> TrainState:
        """Load ``saved`` into this state's tensors in place; return the new record.

        This record is consumed (its tensors changed). Transform state saved
        for transforms this state has not run yet is kept and restored when
        the step that owns them first runs.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> s = s.load_state_dict(s.state_dict())
            >>> s.step
            0
        """
        self.check_fresh()
        from ftrain.persist.state import load_into

        new = load_into(self, saved, rng=rng, strict=strict)
        self._consume("load_state_dict")
        return self._successor(**new)

    # ------------------------------------------------------------------ repr
    def __repr__(self) -> str:
        if self.is_consumed:
            by = self._lineage.consumer(self._version)
            return f"TrainState(step={self.step}, epoch={self.epoch}, <consumed by {by}>)"
        n_params = sum(p.numel() for p in self._model.parameters())
        opt = self._optimizer
        lrs = sorted({g.get("lr") for g in opt.param_groups if "lr" in g}, key=float)
        lr = f"lr={lrs[0]:g}" if len(lrs) == 1 else f"lr={lrs[0]:g}..{lrs[-1]:g}"
        transforms = ", ".join(f"{k}: {v!r}" for k, v in self.transforms.items())
        return (
            f"TrainState(step={self.step}, micro_step={self.micro_step}, epoch={self.epoch}, "
            f"model={type(self._model).__name__} ({_count(n_params)} params), "
            f"optimizer={type(opt).__name__}({lr}, {len(opt.param_groups)} group"
            f"{'s' if len(opt.param_groups) != 1 else ''}), transforms={{{transforms}}})"
        )


# ------------------------------------------------------------- the hot path
# Once per step a record is consumed and its successor made. attrs' __init__
# (converters, one setattr call per field) costs ~1 µs there, so records are
# built directly through their slots' descriptors instead.
_new_record = object.__new__
(
    _set_model,
    _set_optimizer,
    _set_step,
    _set_micro_step,
    _set_epoch,
    _set_transforms,
    _set_lineage,
    _set_version,
) = (
    TrainState.__dict__[name].__set__
    for name in (
        "_model",
        "_optimizer",
        "step",
        "micro_step",
        "epoch",
        "transforms",
        "_lineage",
        "_version",
    )
)


def _record(
    like: TrainState,
    step: int,
    micro_step: int,
    epoch: int,
    transforms: Mapping[str, Any],
    version: int,
) -> TrainState:
    """A record sharing ``like``'s tensors and lineage; it becomes the lineage's newest."""
    new = _new_record(TrainState)
    model, optimizer, lin = like._model, like._optimizer, like._lineage
    _set_model(new, model)
    _set_optimizer(new, optimizer)
    _set_step(new, step)
    _set_micro_step(new, micro_step)
    _set_epoch(new, epoch)
    _set_transforms(new, transforms)
    _set_lineage(new, lin)
    _set_version(new, version)
    lin._fields = (model, optimizer, step, micro_step, epoch, transforms, version)
    return new


def advance(
    state: TrainState, by: str, step: int, micro_step: int, transforms: Mapping[str, Any]
) -> TrainState:
    """Consume ``state`` (naming ``by`` in later errors) and return its successor.

    Internal, for steps: ``transforms`` is the successor's transform state
    (a read-only mapping; a fresh ``dict`` is wrapped).
    """
    lin = state._lineage
    version = state._version + 1
    lin.last_consumer = by
    lin.version = version
    if type(transforms) is dict:
        transforms = MappingProxyType(transforms)
    return _record(state, step, micro_step, state.epoch, transforms, version)


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


# ------------------------------------------------------------- saved values
def to_saved(value: Any) -> Any:
    """A transform state as plain ``torch.save``-able data."""
    if isinstance(value, Unloaded):
        return value.saved
    if hasattr(value, "state_dict") and callable(value.state_dict):
        return value.state_dict()
    if attrs.has(type(value)):
        return {f.name: to_saved(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(to_saved(v) for v in value)
    if isinstance(value, dict):
        return {k: to_saved(v) for k, v in value.items()}
    return value


def load_saved(current: Any, saved: Any) -> Any:
    """Load saved data into a live transform state shaped like ``current``."""
    if hasattr(current, "load_state_dict") and callable(current.load_state_dict):
        current.load_state_dict(saved)
        return current
    if attrs.has(type(current)):
        values = {
            f.name: load_saved(getattr(current, f.name), saved[f.name])
            for f in attrs.fields(type(current))
            if f.init and f.name in saved
        }
        return attrs.evolve(current, **{k.lstrip("_"): v for k, v in values.items()})
    if isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(device=current.device, dtype=current.dtype).clone()
    if isinstance(current, dict) and isinstance(saved, dict):
        return {k: load_saved(current[k], v) if k in current else v for k, v in saved.items()}
    if isinstance(current, (list, tuple)) and isinstance(saved, (list, tuple)):
        if len(current) == len(saved):
            return type(current)(load_saved(c, s) for c, s in zip(current, saved))
    return saved


# ------------------------------------------------------------ wrapped models
def _is_wrapped(model: torch.nn.Module) -> bool:
    """A DDP wrapper or a module with FSDP2 (DTensor) parameters or submodules."""
    return any(
        type(m).__module__.startswith("torch.distributed")
        or type(m).__module__.startswith("torch.nn.parallel")
        for m in model.modules()
    )


# --------------------------------------------------------------------- RNG
# Kept importable from here; they live in ftrain.persist.rng.
from ftrain.persist.rng import capture_rng, restore_rng  # noqa: E402
