"""``TrainState``: the immutable record a training step consumes and returns.

Donation: a step updates the tensors in place and returns a *new* record; the
one it was given is consumed (using it again raises
:class:`~ftrain.errors.StaleStateError` rather than training from weights that
changed under it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeAlias

import attrs
import torch

from ftrain._checks import whole
from ftrain.errors import StaleStateError

__all__ = [
    "TrainState", "StaleStateError", "Unloaded", "advance", "consume", "add_reader", "wait_readers"
]  # fmt: skip

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_FIELDS = ("model", "optimizer", "optimizers", "step", "micro_step", "epoch", "transforms")
#: What ``TrainState.create`` takes as its optimizer: one, or several by name.
Optimizers: TypeAlias = torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]
_COUNTERS = ("step", "micro_step", "epoch")


class Lineage:
    """The live model and optimizer(s), shared by every record over them.

    ``optimizer`` is the one optimizer, or ``None`` when the state holds several, by name,
    in ``optimizers`` (empty for one). Only records of ``version`` are valid: consuming one
    bumps it. ``newest`` holds the newest record's fields, not the record (a cycle through it
    would keep the model, and GPU memory, alive until the garbage collector runs).
    ``readers``: background copies of the tensors still reading them (:func:`add_reader`).
    """

    __slots__ = ("model", "optimizer", "optimizers", "version", "consumer", "newest", "readers")

    def __init__(self, model: torch.nn.Module, optimizer: Optimizers) -> None:
        self.model = model
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer: torch.optim.Optimizer | None = optimizer
            self.optimizers: Mapping[str, torch.optim.Optimizer] = _EMPTY
        else:
            self.optimizer = None
            self.optimizers = MappingProxyType(dict(optimizer))
        self.version = 0
        self.consumer = ""  # what consumed version ``version - 1``
        self.newest: tuple[Any, ...] | None = None
        self.readers: list[Callable[[], None]] = []


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


def _check_optimizers(model: torch.nn.Module, optimizer: Any, where: str) -> None:
    """Refuse what is not an optimizer over the model, or named optimizers that share a
    parameter (each parameter is updated by one optimizer)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_owns(model, optimizer, where)
        return
    if not isinstance(optimizer, Mapping) or not optimizer:
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer built on the model's "
            "parameters, or a non-empty dict of them by name ({'gen': opt_g, 'disc': opt_d}); "
            f"got {optimizer!r}."
        )
    owner: dict[int, str] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, opt in optimizer.items():
        _check_name(name, opt, where)
        _check_owns(model, opt, f"{where} (optimizer {name!r})")
        for p in (p for g in opt.param_groups for p in g["params"]):
            other = owner.setdefault(id(p), name)
            if other != name:
                raise ValueError(
                    f"{where}: optimizers {other!r} and {name!r} both hold the parameter "
                    f"{names.get(id(p), tuple(p.shape))!r}: each parameter is updated by one "
                    "optimizer. Build them on disjoint parameters, e.g. "
                    "{'gen': Adam(model.gen.parameters()), 'disc': Adam(model.disc.parameters())}."
                )
    if any(type(m).__module__.startswith(_WRAPPED) for m in model.modules()):
        raise NotImplementedError(
            f"{where}: several optimizers over a DDP/FSDP2-wrapped model are not supported "
            "yet; use one optimizer (param groups for the parts), or train unwrapped."
        )


def _check_name(name: Any, opt: Any, where: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or "+" in name:
        raise ValueError(
            f"{where}: optimizer names must be non-empty strings without '/' or '+' (they "
            f"prefix metrics and transform state), got {name!r}."
        )
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer {name!r} must be a torch.optim.Optimizer, got "
            f"{type(opt).__name__}."
        )


_WRAPPED = ("torch.distributed", "torch.nn.parallel")


@attrs.frozen(repr=False, eq=False)
class TrainState:
    """Everything a training run needs to continue, as one immutable record.

    Attributes:
        model, optimizer: the live objects (reading them from a consumed
            record raises :class:`StaleStateError`).
        optimizers: a state created with several optimizers by name holds them here
            (read-only; ``optimizer`` then raises, naming them); empty for one optimizer.
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
        optimizer: Optimizers,
        *,
        step: int = 0,
        epoch: int = 0,
    ) -> TrainState:
        """A fresh state owning ``model`` and ``optimizer`` (built on the model's parameters).

        ``optimizer`` may be several optimizers by name, each over its own parameters
        (``{"gen": opt_g, "disc": opt_d}``): steps are then bound to the ones they update,
        ``make_step(loss_fn, optimizer="disc")`` (see ``docs/multi_optimizer.md``).

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(4, 2)
            >>> s = ftrain.TrainState.create(m, torch.optim.AdamW(m.parameters()))
            >>> s.model is m
            True
            >>> gan = torch.nn.ModuleDict({"gen": torch.nn.Linear(2, 2), "disc": torch.nn.Linear(2, 1)})
            >>> s = ftrain.TrainState.create(gan, {
            ...     "gen": torch.optim.Adam(gan.gen.parameters()),
            ...     "disc": torch.optim.Adam(gan.disc.parameters())})
            >>> list(s.optimizers)
            ['gen', 'disc']
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"TrainState.create: model must be a torch.nn.Module, got {type(model).__name__}."
            )
        _check_optimizers(model, optimizer, "TrainState.create")
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
        opt = lin.optimizer
        if opt is None:
            names = list(lin.optimizers)
            raise AttributeError(
                f"This TrainState holds several optimizers, {names}: read one with "
                f"state.optimizers[{names[0]!r}]. A step updates the ones it is bound to: "
                f"ftrain.make_step(loss_fn, optimizer={names[0]!r})."
            )
        return opt

    @property
    def optimizers(self) -> Mapping[str, torch.optim.Optimizer]:
        """The optimizers by name (read-only), for a state created with several; else empty.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> dict(ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1)).optimizers)
            {}
        """
        lin = self._lineage
        if self._version != lin.version:
            self.check_fresh()
        return lin.optimizers

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
        if "optimizer" in changes and "optimizers" in changes:
            raise TypeError("TrainState.replace: pass optimizer= (one) or optimizers= (by name).")
        _check_counters("TrainState.replace", **{k: changes[k] for k in _COUNTERS if k in changes})
        lin = self._lineage
        step, micro, epoch = (
            changes.get(n, getattr(self, n)) for n in ("step", "micro_step", "epoch")
        )
        counters = (step, micro, epoch, _freeze(changes.get("transforms", self.transforms)))
        model = changes.get("model", lin.model)
        current = lin.optimizer if lin.optimizer is not None else lin.optimizers
        optimizer = changes.get("optimizer", changes.get("optimizers", current))
        if model is not lin.model or not _same(optimizer, current):
            _check_optimizers(model, optimizer, "TrainState.replace")
            return TrainState(*counters, Lineage(model, optimizer), 0)
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
        lin = self._lineage
        optimizer = lin.optimizer if lin.optimizer is not None else dict(lin.optimizers)
        parts = (model, optimizer, dict(self.transforms))
        copied = None
        if any(type(m).__module__.startswith(_WRAPPED) for m in model.modules()):
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
        lin = self._lineage
        n = sum(p.numel() for p in lin.model.parameters())
        units = (("G", 1e9), ("M", 1e6), ("K", 1e3))
        size = next((f"{n / s:.3g}{u}" for u, s in units if n >= s), str(n))
        if lin.optimizer is not None:
            opts = f"optimizer={_describe(lin.optimizer)}"
        else:
            opts = (
                "optimizers={"
                + ", ".join(f"{name}: {_describe(o)}" for name, o in lin.optimizers.items())
                + "}"
            )
        transforms = ", ".join(f"{k}: {v!r}" for k, v in self.transforms.items())
        return (
            f"TrainState(step={self.step}, micro_step={self.micro_step}, epoch={self.epoch}, "
            f"model={type(lin.model).__name__} ({size} params), {opts}, "
            f"transforms={{{transforms}}})"
        )


def _describe(opt: torch.optim.Optimizer) -> str:
    """``AdamW(lr=0.001, 1 group)``: an optimizer as the state's repr shows it."""
    lrs = sorted({g["lr"] for g in opt.param_groups if "lr" in g}, key=float)
    lr = f"lr={lrs[0]:g}" if len(lrs) == 1 else f"lr={lrs[0]:g}..{lrs[-1]:g}"
    groups = len(opt.param_groups)
    return f"{type(opt).__name__}({lr}, {groups} group{'s' if groups != 1 else ''})"


def _same(new: Any, current: Optimizers) -> bool:
    """Whether ``new`` is the optimizer (or the named optimizers) ``current`` already is."""
    if isinstance(new, Mapping) and isinstance(current, Mapping):
        return new.keys() == current.keys() and all(new[k] is current[k] for k in current)
    return new is current


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


def add_reader(state: TrainState, wait: Callable[[], None]) -> None:
    """Register a background reader of ``state``'s model and optimizer tensors (a checkpoint's
    copy in flight): the next change of them in place (a step's optimizer update, a load,
    ``swap_ema``) calls ``wait()`` first, once (:func:`wait_readers`).

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> add_reader(s, lambda: print("copy done"))
        >>> s, _ = ftrain.make_step(lambda m, b: m(b).sum())(s, torch.ones(1, 2))
        copy done
    """
    state._lineage.readers.append(wait)


def wait_readers(state: TrainState) -> None:
    """Wait for (and forget) the readers :func:`add_reader` registered over ``state``'s
    tensors: call it before changing them in place."""
    readers = state._lineage.readers
    if readers:
        pending = readers[:]
        readers.clear()
        for wait in pending:
            wait()
