"""The learning-rate finder: an exponential sweep over your own step, on a copy of the state.

``ftrain.lr_find(step, state, data)`` trains a copy of ``state`` (``state.clone()``) with
``step`` (every transform applies: AMP, accumulation, clipping, ...) for up to
``num_training`` optimizer updates, raising the learning rate exponentially from ``min_lr``
to ``max_lr``, and stops when the smoothed loss diverges. It suggests the learning rate
where the smoothed loss falls fastest. The algorithm is Lightning's ``Tuner.lr_find``
(``mode="exponential"``), number for number; ``state`` is never touched, no file is written,
and the random generators are left as they were.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain import dist as _dist
from ftrain.errors import NonFiniteLossError
from ftrain.persist.rng import capture_rng, restore_rng
from ftrain.schedules import apply_schedules
from ftrain.sequence import StepSequence
from ftrain.state import TrainState
from ftrain.step import Step
from ftrain.transforms.base import Transform

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ftrain.step import StepContext

__all__ = ["lr_find", "LRFindResult", "LRSweep", "sweep_lr", "steepest_index"]


def sweep_lr(k: int, min_lr: float, max_lr: float, num_training: int) -> float:
    """The learning rate of update ``k`` of the sweep, as Lightning's ``_ExponentialLR`` sets it:
    ``min_lr`` first, then ``min_lr * (max_lr / min_lr) ** ((k + 1) / num_training)``, so the
    last update (``k = num_training - 1``) uses ``max_lr``.

    Example:
        >>> [round(sweep_lr(k, 1e-4, 1.0, 4), 6) for k in range(4)]
        [0.0001, 0.01, 0.1, 1.0]
    """
    if k == 0:
        return min_lr
    return min_lr * (max_lr / min_lr) ** ((k + 1) / num_training)


def steepest_index(
    lrs: Sequence[float], losses: Sequence[float], skip_begin: int = 10, skip_end: int = 1
) -> int | None:
    """The index of the steepest descent of ``losses`` over ``lrs`` (Lightning's suggestion):
    the smallest ``torch.gradient(losses, spacing=lrs)`` (``numpy.gradient``'s formula) over
    the finite points, leaving out the first ``skip_begin`` and last ``skip_end``. ``None``
    when fewer than 2 points remain.

    Example:
        >>> steepest_index([1, 2, 3, 4, 5], [5.0, 4.9, 3.0, 2.95, 2.9], skip_begin=0, skip_end=0)
        1
    """
    kept = [i for i in range(skip_begin, len(losses) - skip_end) if math.isfinite(losses[i])]
    if len(kept) < 2:
        return None
    y = torch.tensor([losses[i] for i in kept], dtype=torch.float64)
    x = torch.tensor([lrs[i] for i in kept], dtype=torch.float64)
    return kept[int(torch.argmin(torch.gradient(y, spacing=[x])[0]))]


@attrs.frozen(repr=False)
class LRFindResult:
    """What :func:`lr_find` measured.

    Attributes:
        lrs: the learning rate of each update (param group 0's).
        losses: the smoothed loss after each update, as Lightning's ``results["loss"]``:
            ``avg = beta * avg + (1 - beta) * loss``, divided by ``1 - beta ** (k + 2)`` at
            update ``k`` (Lightning's bias correction counts the update just made).
        raw_losses: each update's own loss (the mean over its accumulation window).
        suggestion: the suggested learning rate, or ``None`` (too few points).
        index: the point of the suggestion in ``lrs``.
        stop_reason: ``"completed"``, ``"diverged"`` (smoothed loss above
            ``early_stop_threshold`` times the best, or not finite) or ``"out_of_data"``.
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    raw_losses: tuple[float, ...]
    suggestion: float | None
    index: int | None
    stop_reason: str

    def suggest(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The suggestion with other skips (:func:`steepest_index`).

        Example:
            >>> curve = (3.0, 1.0, 0.5)
            >>> r = LRFindResult((1.0, 2.0, 3.0), curve, curve, None, None, "completed")
            >>> r.suggest(skip_begin=0, skip_end=0)
            1.0
        """
        i = steepest_index(self.lrs, self.losses, skip_begin, skip_end)
        return None if i is None else self.lrs[i]

    def plot(self, *, suggest: bool = True, ax: Axes | None = None, show: bool = False) -> Figure:
        """The smoothed loss over the learning rate (log scale), the suggestion in red.

        Needs matplotlib (``pip install matplotlib``). Returns the figure.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "LRFindResult.plot needs matplotlib: pip install matplotlib. The curve is in "
                "result.lrs and result.losses without it."
            ) from exc
        fig, ax = plt.subplots() if ax is None else (ax.figure, ax)
        ax.plot(self.lrs, self.losses)
        ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss (smoothed)")
        if suggest and self.index is not None:
            ax.plot(self.lrs[self.index], self.losses[self.index], "o", color="red", markersize=10)
        if show:
            plt.show()
        return fig

    def __repr__(self) -> str:
        at = "none" if self.index is None else f"{self.suggestion:.3g} (point {self.index})"
        return f"LRFindResult(suggestion={at}, {len(self.lrs)} points, {self.stop_reason})"


@attrs.frozen
class LRSweep(Transform):
    """Sets the sweep's learning rate before each update (after ``with_schedule``, whose
    other schedules still apply), keeping the param groups' ratios to group 0 (of a step
    bound to several optimizers: their groups in order, group 0 the first one's)."""

    min_lr: float
    max_lr: float
    num_training: int
    start: int  # the state's step when the sweep began
    name = "lr_find"
    stage = 1  # after with_schedule (0); before unscaling and clipping

    def lr(self, k: int) -> float:
        return sweep_lr(k, self.min_lr, self.max_lr, self.num_training)

    def before_update(self, ctx: StepContext) -> None:
        apply_schedules(ctx.optimizer, ctx.state.step - self.start, lr=self.lr)


def _check_number(name: str, value: Any, *, low: float, high: float = math.inf) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and low < value < high):
        bounds = f"> {low}" if high == math.inf else f"in ({low}, {high})"
        raise ValueError(f"lr_find: {name} must be a finite number {bounds}, got {value!r}.")
    return float(value)


def _check_run(step: Any, state: Any) -> None:
    if not isinstance(step, Step):
        raise TypeError(
            f"lr_find: step must be an ftrain Step (ftrain.make_step(loss_fn) with its "
            f"transforms), got {type(step).__name__}."
        )
    if isinstance(step, StepSequence):
        raise TypeError(
            "lr_find sweeps the learning rate of one step: pass one of the sequence's steps "
            f"({', '.join(repr(s.name) for s in step.steps)}: seq.steps[i]); it trains that "
            "step's optimizer(s) alone, on a copy of the state."
        )
    if not isinstance(state, TrainState):
        raise TypeError(f"lr_find: state must be a TrainState, got {type(state).__name__}.")
    state.check_fresh()
    if step.pending(state):
        raise ValueError(
            f"lr_find: the state is inside an accumulation window ({step.pending(state)} "
            "micro-batches pending); run it on a state at an optimizer update (before training, "
            "or after step.flush(state))."
        )


def _check_sweep(min_lr: Any, max_lr: Any, num_training: Any, thr: Any, beta: Any, *skips: Any):
    if _check_number("min_lr", min_lr, low=0.0) >= _check_number("max_lr", max_lr, low=0.0):
        raise ValueError(f"lr_find: min_lr ({min_lr}) must be below max_lr ({max_lr}).")
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 1:
        raise ValueError(
            f"lr_find: num_training must be a whole number >= 1, got {num_training!r}."
        )
    if thr is not None:
        _check_number("early_stop_threshold", thr, low=0.0)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
        raise ValueError(f"lr_find: beta must be a number in [0, 1), got {beta!r}.")
    for name, value in zip(("skip_begin", "skip_end"), skips):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"lr_find: {name} must be a whole number >= 0, got {value!r}.")


def _result(curve: _Curve, reason: str, skip_begin: int, skip_end: int) -> LRFindResult:
    index = steepest_index(curve.lrs, curve.smoothed, skip_begin, skip_end)
    suggestion = None if index is None else curve.lrs[index]
    return LRFindResult(
        tuple(curve.lrs), tuple(curve.smoothed), tuple(curve.raw), suggestion, index, reason
    )


def _batches(data: Iterable[Any]) -> Iterator[Any]:
    """The batches of ``data``, epoch after epoch (an iterator: one pass)."""
    if iter(data) is data:
        yield from data
        return
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise ValueError("lr_find: data yielded no batch.")


def _update_loss(window: list[dict[str, Any]]) -> float:
    """One update's loss: the mean over its micro-batches (a summed loss: sum over count),
    averaged over the ranks so every rank takes the same decisions."""
    if all("loss_sum" in m and "loss_count" in m for m in window):
        total = torch.stack([m["loss_sum"].float() for m in window]).sum()
        loss = total / torch.stack([m["loss_count"].float() for m in window]).sum()
    else:
        loss = torch.stack([m["loss"].detach().float() for m in window]).mean()
    if _dist.world_size() > 1:
        loss = loss.clone()
        torch.distributed.all_reduce(loss)
        loss /= _dist.world_size()
    return float(loss)


@attrs.define
class _Curve:
    """The sweep so far: each update's learning rate, own loss and smoothed loss."""

    beta: float
    threshold: float | None
    lrs: list[float] = attrs.Factory(list)
    raw: list[float] = attrs.Factory(list)
    smoothed: list[float] = attrs.Factory(list)
    avg: float = 0.0
    best: float = 0.0

    def add(self, lr: float, loss: float) -> bool:
        """Record one update; whether the loss diverged (Lightning's rule, or not finite)."""
        k = len(self.raw)
        self.avg = self.beta * self.avg + (1 - self.beta) * loss
        smooth = self.avg / (1 - self.beta ** (k + 2))
        diverged = not math.isfinite(loss) or (
            self.threshold is not None and k >= 1 and smooth > self.threshold * self.best
        )
        if smooth < self.best or k == 0:
            self.best = smooth
        self.lrs.append(lr)
        self.raw.append(loss)
        self.smoothed.append(smooth)
        return diverged


def _sweep(
    step: Step, state: TrainState, data: Iterable[Any], sweep: LRSweep, curve: _Curve
) -> str:
    """Train ``state`` (the copy) until ``num_training`` updates, divergence or the data's end."""
    window: list[dict[str, Any]] = []
    for batch in _batches(data):
        before = state.step
        try:
            state, metrics = step(state, batch)
        except NonFiniteLossError:
            curve.add(sweep.lr(before - sweep.start), math.nan)
            return "diverged"
        window.append(metrics)
        if state.step == before:  # inside an accumulation window
            continue
        diverged = curve.add(sweep.lr(before - sweep.start), _update_loss(window))
        window = []
        if diverged:
            return "diverged"
        if len(curve.raw) == sweep.num_training:
            return "completed"
    return "out_of_data"


def lr_find(
    step: Step,
    state: TrainState,
    data: Iterable[Any],
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    early_stop_threshold: float | None = 4.0,
    beta: float = 0.98,
    skip_begin: int = 10,
    skip_end: int = 1,
) -> LRFindResult:
    """Sweep the learning rate over ``step`` on a copy of ``state``; suggest one.

    Update ``k < num_training`` (under :func:`ftrain.with_grad_accum` a whole window) uses
    :func:`sweep_lr` on param group 0, the other groups keeping their ratio to it (as
    :func:`ftrain.with_schedule`, whose learning rate is overridden and other schedules still
    apply). Stops when the smoothed loss (:attr:`LRFindResult.losses`) exceeds
    ``early_stop_threshold`` times its best (``None``: never), at a non-finite loss, or when
    ``data`` runs out (an iterator; an iterable is read again). Suggests
    :func:`steepest_index`. ``state`` is cloned (``state.clone()``: under DDP/FSDP2 on every
    rank) and never touched; no file is written; the random generators are restored. Each
    update reads its loss on the host (averaged over the ranks).

    Example:
        >>> import torch, ftrain
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(4, 1)
        >>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
        >>> data = [(x, x.sum(1, keepdim=True)) for x in torch.randn(8, 8, 4)]
        >>> result = ftrain.lr_find(step, state, data, min_lr=1e-4, max_lr=10.0, num_training=40)
        >>> result.stop_reason, 1e-4 < result.suggestion < 10.0, state.step
        ('diverged', True, 0)
    """
    _check_run(step, state)
    _check_sweep(min_lr, max_lr, num_training, early_stop_threshold, beta, skip_begin, skip_end)
    rng = capture_rng()
    work = state.clone()
    sweep = LRSweep(float(min_lr), float(max_lr), num_training, work.step)
    curve = _Curve(float(beta), early_stop_threshold)
    try:
        reason = _sweep(step.with_transform(sweep), work, data, sweep, curve)
    finally:
        del work
        restore_rng(rng)
    return _result(curve, reason, skip_begin, skip_end)
