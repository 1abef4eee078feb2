"""The evaluation hook: run an evaluation function, put its metrics on the stream."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ftrain import dist as _dist
from ftrain._checks import flag, whole
from ftrain.events import EpochEnd, Evaluated, Event, RunEnd, StepEnd
from ftrain.hooks.cadence import Every

if TYPE_CHECKING:
    from ftrain.run import Run
    from ftrain.state import TrainState

__all__ = ["EvalHook", "evaluation_mode"]

EvalFn = Callable[[Any], Mapping[str, Any]]


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model.eval()`` and ``torch.no_grad()``, then each submodule's own ``training`` back.

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
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        for m, training in modes:
            m.training = training


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

    ``fn(state) -> dict[str, float]`` runs in :class:`evaluation_mode` every ``every`` epochs
    (``by_epoch``, default) or updates, and with ``at_end`` when the run completes unless the
    last state was evaluated. ``reduce`` combines the ranks' numbers
    (:func:`ftrain.dist.reduce_metrics`; ``None``: each keeps its own). The trigger passes on
    first, then ``Evaluated`` follows (last results in :attr:`metrics`); a checkpoint written
    in between records the evaluation as due, and a run resumed from it evaluates at once.

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

    priority = "ABOVE_NORMAL"  # before the timer, logger and checkpoint hooks
    emits = (Evaluated,)  # (ftrain.hooks.base.EmitsEvents)

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
        whole("EvalHook: every", every, 1)
        flag("EvalHook: by_epoch", by_epoch)
        flag("EvalHook: at_end", at_end)
        if not isinstance(name, str) or not name:
            raise ValueError(f"EvalHook: name must be a non-empty string, got {name!r}.")
        if reduce is not None and reduce not in ("mean", "sum", "max", "min"):
            raise ValueError(
                f"EvalHook: reduce must be 'mean', 'sum', 'max', 'min' or None, got {reduce!r}."
            )
        self.fn, self.reduce, self.every, self.by_epoch = fn, reduce, every, by_epoch
        self.at_end, self.name = at_end, name
        self.cadence = Every(epochs=every) if by_epoch else Every(steps=every)
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

    def state_dict(self) -> dict[str, Any]:
        return {"last": None if self._last is None else list(self._last), "pending": self._pending}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        last, self._pending = saved.get("last"), saved.get("pending")
        self._last = None if last is None else (int(last[0]), int(last[1]))

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

    def _evaluated(self, loop: Run, state: TrainState, by_epoch: bool) -> Evaluated:
        metrics = self.evaluate(state)
        self._pending = None
        observed = loop.step.observe(state, metrics)  # a plateau rule (Step.observe)
        if observed is not state:
            loop.state = state = observed
        return Evaluated(loop, state, metrics, by_epoch=by_epoch)

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        yield first
        if self._pending is not None:  # resumed from a checkpoint taken before it ran
            yield self._evaluated(loop, loop.state, bool(self._pending))
        by_epoch, cadence = self.by_epoch, self.cadence
        for ev in events:
            kind = type(ev)
            if (
                cadence.due_epoch(ev.epoch)
                if kind is EpochEnd
                else kind is StepEnd and ev.is_update and cadence.due(ev.state.step)
            ):
                self._pending = by_epoch
                yield ev
                yield self._evaluated(loop, ev.state, by_epoch)
                continue
            if (
                kind is RunEnd
                and self.at_end
                and self._last != (ev.state.step, ev.state.micro_step)
            ):
                yield self._evaluated(loop, ev.state, by_epoch)
            yield ev
