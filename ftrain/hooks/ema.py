"""Exponential moving average of the weights (MMEngine ``EMAHook``).

``EMAHook`` keeps an averaged copy of the model, updated after each optimizer
update with one ``torch._foreach_lerp_`` (no host synchronisation), and
saved with checkpoints so the average resumes exactly. Evaluate with the
averaged weights through :meth:`EMAHook.swap` or :meth:`EMAHook.wrap`::

    ema = EMAHook(momentum=0.0002)
    hooks = [ema, EvalHook(ema.wrap(evaluate)), BestCheckpointHook("acc")]
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ftrain.events import Event, StepEnd

__all__ = ["EMAHook", "unwrap_model"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP/FSDP/``DataParallel`` and ``torch.compile`` wrappers.

    The same as :func:`ftrain.dist.unwrap` (ftrain's one unwrap helper).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 1)
        >>> unwrap_model(m) is m
        True
    """
    from ftrain.dist import unwrap

    return unwrap(model)


def _model_of(target: Any) -> torch.nn.Module:
    model = target if isinstance(target, torch.nn.Module) else getattr(target, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Expected a TrainState or a torch.nn.Module, got {type(target).__name__}.")
    return unwrap_model(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the parameter), or the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "device_mesh") and hasattr(p, "to_local") for p in model.parameters())


class _Pairs:
    """Matching tensors of the EMA copy and the source model, grouped for foreach ops.

    ``ema`` and ``src`` are modules, or ``(parameters, buffers)`` dicts by
    name. DTensor (FSDP2) tensors are paired by their local shards: every
    operation is local, no communication.
    """

    def __init__(self, ema: Any, src: torch.nn.Module) -> None:
        if isinstance(ema, torch.nn.Module):
            ema_params = dict(ema.named_parameters())
            ema_buffers = dict(ema.named_buffers())
        else:
            ema_params, ema_buffers = ema
        src_params = dict(src.named_parameters())
        if ema_params.keys() != src_params.keys():
            missing = sorted(set(src_params) ^ set(ema_params))[:5]
            raise ValueError(
                f"EMAHook: the model's parameters do not match the EMA copy's (e.g. {missing}); "
                "the EMA was made from a different model."
            )
        self.avg: list[torch.Tensor] = []  # floating point: averaged
        self.src: list[torch.Tensor] = []
        self.copy_dst: list[torch.Tensor] = []  # the rest and all buffers: copied
        self.copy_src: list[torch.Tensor] = []
        for name, p in src_params.items():
            e = ema_params[name]
            if e.dtype.is_floating_point or e.dtype.is_complex:
                self.avg.append(_local(e.detach()))
                self.src.append(_local(p.detach()))
            else:
                self.copy_dst.append(_local(e.detach()))
                self.copy_src.append(_local(p.detach()))
        for name, b in src.named_buffers():
            if name in ema_buffers:
                self.copy_dst.append(_local(ema_buffers[name]))
                self.copy_src.append(_local(b))
        # swap() exchanges the parameters only (the buffers are equal already)
        self.params_ema = [_local(e.detach()) for e in ema_params.values()]
        self.params_src = [_local(src_params[n].detach()) for n in ema_params]


class EMAHook:
    """Keep an exponential moving average of the model's weights.

    MMEngine's ``EMAHook`` with ``ExponentialMovingAverage`` (and, with
    ``warmup``, ``ExpMomentumEMA``). After the ``n``-th counted optimizer
    update (``n`` from 0), with ``p`` the model's parameters and ``e`` the
    averaged ones:

    * ``n == 0``: ``e = p``;
    * ``n % interval == 0``: ``e = e + m_n * (p - e)`` (``torch.lerp``), with
      ``m_n = momentum`` or, with ``warmup``,
      ``m_n = (1 - momentum) * exp(-(1 + n) / warmup) + momentum`` (large at
      first, so the average forgets the random initial weights quickly);
    * buffers (BatchNorm statistics) and integer parameters are copied.

    Note MMEngine's convention: ``momentum`` is the weight of the *new*
    value (0.0002), i.e. ``1 - decay`` in timm/torch ``AveragedModel`` terms.

    Args:
        momentum: weight of the current weights at each EMA update, in (0, 1).
        interval: update the average every this many optimizer updates.
        warmup: ``None``, or the time constant (in EMA updates, MMEngine's
            ``gamma``, e.g. 2000) of the momentum warm-up described above.
        begin: start averaging after this many optimizer updates; before
            that the copy just follows the model (MMEngine's ``begin_iter``).

    Attributes:
        ema_model: the averaged copy (a ``deepcopy`` of the model made when
            the run starts, no gradients); use it for inference or saving.
            Under DDP the user's module is copied, not the wrapper. Under
            FSDP2 no module is copied: the average is kept as sharded
            tensors (:attr:`averaged`, DTensors sharded like the
            parameters, updated locally with no communication), and
            :meth:`swap` / :meth:`wrap` put it into the sharded model for
            evaluation.
        updates: EMA updates done so far (``n``).

    The per-update cost is one ``torch._foreach_lerp_`` over the parameters
    and one ``torch._foreach_copy_`` over the buffers, with a Python float
    weight: no host synchronisation. The averaged weights and ``updates``
    are saved with checkpoints (:meth:`state_dict`), so a resumed run
    continues the average bitwise.

    Runs at priority ``NORMAL``: after :class:`~ftrain.hooks.evaluation.EvalHook`
    passed the triggering event on and before it evaluates, so an evaluation
    at that update sees the average including it.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> ema = EMAHook(momentum=0.5)
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> state = ftrain.fit(step, state, [torch.ones(4, 2)] * 3, hooks=[ema])
        >>> ema.updates
        3
        >>> with ema.swap(state):       # the training model holds the EMA weights here
        ...     torch.equal(state.model.weight, ema.ema_model.weight)
        True
    """

    priority = "NORMAL"
    name = "ema"

    def __init__(
        self,
        momentum: float = 0.0002,
        interval: int = 1,
        *,
        warmup: float | None = None,
        begin: int = 0,
    ) -> None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise TypeError(f"EMAHook: momentum must be a number in (0, 1), got {momentum!r}.")
        if not 0.0 < momentum < 1.0:
            raise ValueError(
                f"EMAHook: momentum must be in (0, 1), got {momentum!r}. It is the weight of the "
                "new weights (MMEngine's convention, e.g. 0.0002); for a decay d (timm, "
                "AveragedModel) pass momentum=1 - d."
            )
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"EMAHook: interval must be a whole number >= 1, got {interval!r}.")
        if warmup is not None and (
            isinstance(warmup, bool)
            or not isinstance(warmup, (int, float))
            or not math.isfinite(warmup)
            or warmup <= 0
        ):
            raise ValueError(
                f"EMAHook: warmup must be None or a number of EMA updates > 0 (e.g. 2000), "
                f"got {warmup!r}."
            )
        if isinstance(begin, bool) or not isinstance(begin, int) or begin < 0:
            raise ValueError(f"EMAHook: begin must be a whole number >= 0, got {begin!r}.")
        self.momentum = float(momentum)
        self.interval = interval
        self.warmup = warmup
        self.begin = begin
        self.updates = 0
        self._ema: torch.nn.Module | None = None
        # FSDP2: (parameters, buffers) by name, sharded like the model's
        self._shadow: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._src: torch.nn.Module | None = None
        self._pairs: _Pairs | None = None
        self._saved: Mapping[str, Any] | None = None  # loaded before the run started

    def __repr__(self) -> str:
        extra = f", warmup={self.warmup}" if self.warmup is not None else ""
        extra += f", begin={self.begin}" if self.begin else ""
        return (
            f"EMAHook(momentum={self.momentum}, interval={self.interval}{extra}, "
            f"updates={self.updates})"
        )

    # ----------------------------------------------------------- the copy
    @property
    def ema_model(self) -> torch.nn.Module:
        """The averaged model (exists once the run started)."""
        if self._ema is None:
            if self._shadow is not None:
                raise RuntimeError(
                    "EMAHook.ema_model: the model is sharded (FSDP2), so the average is kept "
                    "sharded too, as tensors (ema.averaged, name -> DTensor), not as a module. "
                    "Evaluate with the average through ema.swap(state) or ema.wrap(fn); for a "
                    "full copy on every rank use {k: v.full_tensor() for k, v in "
                    "ema.averaged.items()} (a collective)."
                )
            raise RuntimeError(
                "EMAHook.ema_model does not exist yet: it is copied from the model when the run "
                "starts (or call ema.attach(state) first)."
            )
        return self._ema

    @property
    def averaged(self) -> dict[str, torch.Tensor]:
        """The averaged parameters and buffers by name (DTensor shards for an FSDP2 model).

        Example:
            >>> import torch
            >>> ema = EMAHook(0.5); _ = ema.attach(torch.nn.Linear(2, 1))
            >>> sorted(ema.averaged)
            ['bias', 'weight']
        """
        if self._shadow is not None:
            params, buffers = self._shadow
            return {**params, **buffers}
        return dict(self.ema_model.state_dict())

    def attach(self, target: Any) -> torch.nn.Module | None:
        """Make (or keep) the EMA copy of ``target``'s model (a TrainState or a module).

        The loop does this at ``RunBegin``; a copy made for the same model is
        kept (so an interrupted run continues its average). Loaded state is
        applied here. Returns the copy; ``None`` for an FSDP2 model, whose
        average is kept as sharded tensors (:attr:`averaged`).
        """
        src = _model_of(target)
        if (self._ema is None and self._shadow is None) or self._src is not src:
            if _is_sharded(src):
                # FSDP2 cannot be deep-copied, and a full copy would defeat sharding: keep
                # a sharded copy of each parameter (DTensor clones) and buffer instead
                params = {n: p.detach().clone() for n, p in src.named_parameters()}
                buffers = {n: b.detach().clone() for n, b in src.named_buffers()}
                self._ema, self._shadow = None, (params, buffers)
                self._pairs = _Pairs(self._shadow, src)
            else:
                ema = copy.deepcopy(src)
                for p in ema.parameters():
                    p.requires_grad_(False)
                    p.grad = None
                ema.eval()
                self._ema, self._shadow = ema, None
                self._pairs = _Pairs(ema, src)
            self._src = src
            if self._saved is None:
                self.updates = 0
        if self._saved is not None:
            saved, self._saved = self._saved, None
            self._load_now(saved)
        return self._ema

    def momentum_at(self, n: int) -> float:
        """The lerp weight of the ``n``-th EMA update.

        Example:
            >>> EMAHook(0.01).momentum_at(5), round(EMAHook(0.01, warmup=10).momentum_at(0), 4)
            (0.01, 0.9058)
        """
        if self.warmup is None:
            return self.momentum
        m = self.momentum
        return (1 - m) * math.exp(-(1 + n) / self.warmup) + m

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights into the average (one EMA update)."""
        pairs = self._pairs
        if pairs is None:
            raise RuntimeError("EMAHook.update: no model attached yet (call ema.attach(state)).")
        n = self.updates
        if n == 0:
            if pairs.avg:
                torch._foreach_copy_(pairs.avg, pairs.src)
        elif n % self.interval == 0 and pairs.avg:
            torch._foreach_lerp_(pairs.avg, pairs.src, self.momentum_at(n))
        if pairs.copy_dst:
            torch._foreach_copy_(pairs.copy_dst, pairs.copy_src)
        self.updates = n + 1

    @torch.no_grad()
    def _follow(self) -> None:
        """Before ``begin``: the copy equals the model."""
        pairs = self._pairs
        if pairs is not None and pairs.avg:
            torch._foreach_copy_(pairs.avg, pairs.src)
        if pairs is not None and pairs.copy_dst:
            torch._foreach_copy_(pairs.copy_dst, pairs.copy_src)

    # ----------------------------------------------------------- evaluate
    @contextlib.contextmanager
    def swap(self, target: Any) -> Iterator[torch.nn.Module]:
        """Put the EMA weights into the training model for the ``with`` block.

        ``target`` is a TrainState or the model. The model's own weights are
        copied aside and put back on exit (also on errors); the optimizer
        and the parameter objects are untouched.

        Example:
            >>> import torch
            >>> m = torch.nn.Linear(2, 1)
            >>> ema = EMAHook(0.1); _ = ema.attach(m)
            >>> with torch.no_grad():
            ...     _ = ema.ema_model.weight.fill_(3.0)
            >>> with ema.swap(m):
            ...     float(m.weight.detach()[0, 0])
            3.0
            >>> float(m.weight.detach()[0, 0]) != 3.0
            True
        """
        model = _model_of(target)
        if self._shadow is not None:
            pairs = self._pairs if model is self._src else _Pairs(self._shadow, model)
        else:
            self.ema_model  # noqa: B018 - raises a clear error when there is no copy yet
            pairs = self._pairs if model is self._src else _Pairs(self.ema_model, model)
        assert pairs is not None
        with torch.no_grad():
            backup = [p.clone() for p in pairs.params_src]
            torch._foreach_copy_(pairs.params_src, pairs.params_ema)
        try:
            yield model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(pairs.params_src, backup)

    def wrap(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn(state)`` evaluated with the EMA weights swapped in (for ``EvalHook``).

        Example:
            >>> ema = EMAHook()
            >>> f = ema.wrap(lambda state: {"acc": 1.0})
            >>> f.__name__
            'ema_<lambda>'
        """

        def evaluate_ema(state: Any) -> Any:
            with self.swap(state):
                return fn(state)

        evaluate_ema.__name__ = evaluate_ema.__qualname__ = (
            f"ema_{getattr(fn, '__name__', 'evaluate')}"
        )
        return evaluate_ema

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The averaged weights (copied) and the update count.

        For an FSDP2 model the weights are gathered whole (on the CPU, one
        tensor at a time): a collective, every rank must call it (the
        loop's checkpoints do).
        """
        if self._ema is None and self._shadow is None:
            if self._saved is not None:
                return dict(self._saved)
            return {"updates": self.updates, "module": None}
        if self._shadow is not None:
            # FSDP2: the whole average, gathered one tensor at a time onto the CPU (a
            # collective: the loop's checkpoint calls this on every rank), so rank 0's
            # checkpoint holds every rank's part and resumes on any number of processes
            module = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in self.averaged.items()
            }
            return {"updates": self.updates, "module": module}
        return {
            "updates": self.updates,
            "module": {k: v.detach().clone() for k, v in self.averaged.items()},
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; applied when the copy exists (at the run's start)."""
        if not isinstance(saved, Mapping) or "updates" not in saved:
            raise ValueError("EMAHook.load_state_dict: not an EMAHook state dict.")
        if self._ema is None and self._shadow is None:
            self._saved = saved
            self.updates = int(saved["updates"])
        else:
            self._load_now(saved)

    def _load_now(self, saved: Mapping[str, Any]) -> None:
        self.updates = int(saved["updates"])
        module = saved.get("module")
        if module is None:
            return
        if self._shadow is None:
            assert self._ema is not None
            self._ema.load_state_dict(module)
            return
        averaged = self.averaged
        if averaged.keys() != module.keys():
            raise ValueError("EMAHook.load_state_dict: the saved average is of another model.")
        with torch.no_grad():
            for name, dst in averaged.items():
                value = module[name]
                if hasattr(dst, "device_mesh") and not hasattr(value, "device_mesh"):
                    # a full tensor (saved by another world size): this rank's shard of it
                    from torch.distributed.tensor import distribute_tensor

                    full = value.to(_local(dst).device)
                    try:  # torch >= 2.7: each rank slices its own copy, no communication
                        value = distribute_tensor(
                            full, dst.device_mesh, dst.placements, src_data_rank=None
                        )
                    except TypeError:  # older torch: rank 0's copy is scattered
                        value = distribute_tensor(full, dst.device_mesh, dst.placements)
                _local(dst).copy_(_local(value))

    # -------------------------------------------------------------- hook
    def next_step(self, step: int) -> int:
        """Every optimizer update (not the micro-batches between)."""
        return step + 1

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        self.attach(first.state)
        yield first
        begin, update = self.begin, self.update
        for ev in events:
            if type(ev) is StepEnd and ev.is_update:
                if ev.state.step >= begin:
                    update()
                else:
                    self._follow()
            yield ev
