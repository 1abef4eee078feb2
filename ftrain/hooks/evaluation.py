"""The evaluation hook: run an evaluation function, put its metrics on the stream.

``EvalHook(fn)`` calls ``fn(state) -> {"name": number}`` every N epochs or
optimizer updates and adds an :class:`~ftrain.events.Evaluated` event right
after the event that triggered it, so the hooks of lower priority (the
logger, :class:`~ftrain.hooks.checkpoint.BestCheckpointHook`,
:class:`~ftrain.hooks.misc.EarlyStoppingHook`) see the results.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ftrain import dist as _dist
from ftrain.events import EpochEnd, Evaluated, Event, RunEnd, StepEnd

__all__ = ["EvalHook", "evaluation_mode"]

EvalFn = Callable[[Any], Mapping[str, Any]]


class evaluation_mode:
    """Context manager: ``model.eval()`` and ``torch.no_grad()``, then restore.

    Every submodule gets its own ``training`` flag back afterwards (so a
    backbone kept frozen in eval mode stays frozen).

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
        >>> m[1].eval()
        Dropout(p=0.5, inplace=False)
        >>> with evaluation_mode(m):
        ...     m.training, torch.is_grad_enabled()
        (False, False)
        >>> m.training, m[1].training
        (True, False)
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._modes: list[tuple[torch.nn.Module, bool]] = []
        self._grad = torch.no_grad()

    def __enter__(self) -> torch.nn.Module:
        self._modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        self._grad.__enter__()
        return self.model

    def __exit__(self, *exc: Any) -> None:
        self._grad.__exit__(*exc)
        for m, training in self._modes:
            m.training = training
        self._modes = []


def _as_metrics(out: Any, fn: Any) -> dict[str, Any]:
    if not isinstance(out, Mapping):
        raise TypeError(
            f"EvalHook: the evaluation function {getattr(fn, '__name__', fn)!r} must return a "
            f"dict of metrics, e.g. {{'acc': 0.91}}; got {type(out).__name__}."
        )
    metrics: dict[str, Any] = {}
    for key, value in out.items():
        if not isinstance(key, str):
            raise TypeError(f"EvalHook: metric names must be strings, got {key!r}.")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        metrics[key] = value  # other values (per-class lists...) are passed on as they are
    return metrics


class EvalHook:
    """Evaluate every ``every`` epochs (or optimizer updates); emit ``Evaluated``.

    Args:
        fn: ``fn(state) -> dict[str, float]``, called with the model in eval
            mode under ``torch.no_grad()`` (the previous train/eval mode of
            every submodule is restored afterwards). 0-d tensors in the
            result are turned into floats.
        every: evaluate every this many epochs (``by_epoch=True``, on
            ``EpochEnd``) or optimizer updates (on a ``StepEnd`` with
            ``is_update`` and ``state.step % every == 0``).
        by_epoch: count epochs (default) or optimizer updates.
        at_end: also evaluate when the run completes, if the last state was
            not evaluated yet; that ``Evaluated`` comes just before
            ``RunEnd``, which stays the last event.
        name: the hook's name (give each of several evaluators its own).
        reduce: how each rank's numbers combine under ``torch.distributed``
            (``"mean"``, ``"sum"``, ``"max"``, ``"min"``, see
            :func:`ftrain.dist.reduce_metrics`), or ``None`` to keep each
            rank's own. Reduced before the ``Evaluated`` event, so
            :class:`~ftrain.hooks.checkpoint.BestCheckpointHook` and
            :class:`~ftrain.hooks.misc.EarlyStoppingHook` take the same
            decision on every rank (a number every rank has the same, e.g.
            one you all-reduced yourself, is kept exactly).

    The stream: the triggering event passes on first (hooks of lower
    priority, e.g. the EMA, the logger and periodic checkpoints, handle it
    first); the evaluation runs next and ``Evaluated(loop, state, metrics,
    by_epoch)`` follows. The last results are in :attr:`metrics`.

    Exact resume: a checkpoint written while the triggering event passes
    (a periodic checkpoint at that step or epoch, an interrupt during the
    evaluation) records that the evaluation is still due, and the resumed
    run performs it right after ``RunBegin``, so best-checkpoint and
    early-stopping hooks see the same results as in an uninterrupted run.

    Runs at priority ``ABOVE_NORMAL``: before the EMA, timer, logger and
    checkpoint hooks.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> val = torch.ones(8, 2)
        >>> ev = EvalHook(lambda s: {"val_loss": s.model(val).pow(2).mean()}, every=2)
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> lp = ftrain.Loop(step, state, [val] * 3, hooks=[ev], epochs=4)
        >>> seen = [e.state.epoch for e in lp if type(e).__name__ == "Evaluated"]
        >>> seen, sorted(ev.metrics)
        ([2, 4], ['val_loss'])
    """

    priority = "ABOVE_NORMAL"

    def __init__(
        self,
        fn: EvalFn,
        every: int = 1,
        *,
        by_epoch: bool = True,
        at_end: bool = False,
        name: str = "eval",
        reduce: str | None = "mean",
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"EvalHook: fn must be a function state -> dict of metrics, got {fn!r}."
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"EvalHook: every must be a whole number >= 1, got {every!r}.")
        if not isinstance(by_epoch, bool) or not isinstance(at_end, bool):
            raise TypeError("EvalHook: by_epoch and at_end must be True or False.")
        if not isinstance(name, str) or not name:
            raise ValueError(f"EvalHook: name must be a non-empty string, got {name!r}.")
        if reduce is not None and reduce not in ("mean", "sum", "max", "min"):
            raise ValueError(
                f"EvalHook: reduce must be 'mean', 'sum', 'max', 'min' or None, got {reduce!r}."
            )
        self.fn = fn
        self.reduce = reduce
        self.every = every
        self.by_epoch = by_epoch
        self.at_end = at_end
        self.name = name
        self.metrics: dict[str, Any] | None = None
        self._last: tuple[int, int] | None = None  # (step, micro_step) last evaluated
        self._pending: bool | None = None  # by_epoch of an evaluation still due

    def __repr__(self) -> str:
        unit = "epoch" if self.by_epoch else "step"
        fn = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        return (
            f"EvalHook({fn}, every {self.every} {unit}{'s' if self.every != 1 else ''}, "
            f"at_end={self.at_end}, name={self.name!r})"
        )

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "last": list(self._last) if self._last is not None else None,
            "pending": self._pending,
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        last = saved.get("last")
        self._last = (int(last[0]), int(last[1])) if last is not None else None
        self._pending = saved.get("pending")

    # ---------------------------------------------------------- evaluate
    def evaluate(self, state: Any) -> dict[str, Any]:
        """Run the evaluation function on ``state`` (eval mode, no grad); return its metrics."""
        with evaluation_mode(state.model):
            out = self.fn(state)
        metrics = _as_metrics(out, self.fn)
        if self.reduce is not None and _dist.world_size() > 1:  # a collective, on every rank
            metrics.update(_dist.reduce_metrics(metrics, self.reduce))
        self.metrics = metrics
        self._last = (state.step, state.micro_step)
        return metrics

    def _triggered(self, ev: Event) -> bool:
        kind = type(ev)
        if self.by_epoch:
            return kind is EpochEnd and (ev.epoch + 1) % self.every == 0
        return kind is StepEnd and ev.is_update and ev.state.step % self.every == 0

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        yield first
        if self._pending is not None:  # resumed from a checkpoint taken before it ran
            by_epoch = bool(self._pending)
            metrics = self.evaluate(loop.state)
            self._pending = None
            yield Evaluated(loop, loop.state, metrics, by_epoch=by_epoch)
        by_epoch, triggered = self.by_epoch, self._triggered
        for ev in events:
            if triggered(ev):
                self._pending = by_epoch
                yield ev
                metrics = self.evaluate(ev.state)
                self._pending = None
                yield Evaluated(loop, ev.state, metrics, by_epoch=by_epoch)
                continue
            if type(ev) is RunEnd and self.at_end:
                s = ev.state
                if self._last != (s.step, s.micro_step):
                    metrics = self.evaluate(s)
                    yield Evaluated(loop, s, metrics, by_epoch=by_epoch)
            yield ev
