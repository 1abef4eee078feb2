"""Schedules in the step: ``lr``, ``momentum``, ``weight_decay`` as functions of the update."""

from __future__ import annotations

import contextlib
import numbers
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain._checks import flag
from ftrain.binding import optimizer_of
from ftrain.plateau import Plateau, PlateauState
from ftrain.schedules import (
    Schedule,
    ScheduleFn,
    check_value,
    group_values,
    probe_steps,
    write_values,
)
from ftrain.transforms.base import Transform

if TYPE_CHECKING:
    from ftrain.state import TrainState
    from ftrain.step import Step, StepContext

__all__ = ["with_schedule", "Scheduled", "ScheduleState", "COUNTS"]

#: What a schedule's step counts: optimizer updates, or micro-batches (MMEngine's iterations).
COUNTS = ("updates", "micro_batches")
_NO_CONTEXT = contextlib.nullcontext()


@attrs.frozen(repr=False)
class ScheduleState:
    """``values``: param group 0's values for the update in progress (or the last one), e.g.
    ``{'lr': 0.05}``; ``plateau``: the plateau rule's state (``with_schedule(plateau=...)``)."""

    values: Mapping[str, float] = attrs.field(factory=dict)
    plateau: PlateauState | None = None

    def __repr__(self) -> str:
        plateau = "" if self.plateau is None else f", plateau={self.plateau!r}"
        return f"ScheduleState(values={dict(self.values)!r}{plateau})"


@attrs.frozen
class Scheduled(Transform):
    """Set the optimizer's settings from schedules before each forward. See :func:`with_schedule`."""

    lr: ScheduleFn | None = None
    momentum: ScheduleFn | None = None
    weight_decay: ScheduleFn | None = None
    by_epoch: bool = False
    count: str = "updates"
    plateau: Plateau | None = None
    #: the optimizers of the step it was composed on (``Step.bound``; ``()``: the state's one)
    bound: tuple[str, ...] = attrs.field(default=(), repr=False)
    # (the ScheduleState this transform wrote last, at which step): an unchanged pair means
    # the optimizer still holds those values (a loaded or cloned state brings another object)
    _last: list = attrs.field(factory=lambda: [None, None], init=False, eq=False, repr=False)
    # the first position past the shortest declared end ([end, what]), until it warned
    _end: list = attrs.field(factory=lambda: [None, ""], init=False, eq=False, repr=False)
    name = "schedule"
    stage = 0

    def __attrs_post_init__(self) -> None:
        ends = [(e, k) for k, f in (("lr", self.lr), ("momentum", self.momentum),
                ("weight_decay", self.weight_decay)) if (e := declared_end(f)) is not None]  # fmt: skip
        if ends:
            self._end[:] = min(ends)

    def _past_end(self, n: int) -> None:
        """Warn once when a schedule is read past its declared end (it holds its last value
        from there: often a learning rate of 0)."""
        end, what = self._end
        if end is None or n <= end:
            return
        self._end[0] = None  # once
        unit = "epoch" if self.by_epoch else {"updates": "update"}.get(self.count, "micro-batch")
        schedule = getattr(self, what)
        warnings.warn(
            f"with_schedule: {unit} {n + 1} reads the {what} schedule {schedule!r} at {n}, "
            f"past its end at {end:g}: from here it holds its last value ({schedule(n):.6g}). "
            "To train longer, give the schedule the new length (its total=), or end the run "
            "before it.",
            stacklevel=_caller_level(),
        )

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ScheduleState:
        groups = len(optimizer.param_groups)
        return ScheduleState({}, None if self.plateau is None else self.plateau.init(groups))

    def position(self, state: TrainState) -> int:
        """The step the schedules are read at for the next update (or micro-batch)."""
        if self.by_epoch:
            return state.epoch
        return state.micro_step if self.count == "micro_batches" else state.step

    def outer_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        """Write the values before the forward: the loss function sees this update's."""
        n = self.position(ctx.state)
        st: ScheduleState = ctx.tstate["schedule"]
        last = self._last
        if last[0] is st and last[1] == n:  # the same update's next micro-batch: written
            return _NO_CONTEXT
        if self._end[0] is not None:
            self._past_end(n)
        written, applied = [], {}
        for what, schedule in (("lr", self.lr), ("momentum", self.momentum)):
            if what == "lr" and self.plateau is not None:
                keys, values = self._capped_lr(ctx.optimizer, n, st.plateau)
            elif schedule is not None:
                keys, values = group_values(ctx.optimizer, what, schedule, n)
            else:
                continue
            written.append((keys, values))
            applied[what] = values[0]
        if self.weight_decay is not None:
            written.append(group_values(ctx.optimizer, "weight_decay", self.weight_decay, n))
            applied["weight_decay"] = written[-1][1][0]
        for keys, values in written:  # nothing is written unless every value is valid
            write_values(ctx.optimizer, keys, values)
        ctx.tstate["schedule"] = last[0] = ScheduleState(applied, st.plateau)
        last[1] = n
        return _NO_CONTEXT

    def _capped_lr(
        self, optimizer: torch.optim.Optimizer, n: int, st: PlateauState | None
    ) -> tuple[list[str], list[float]]:
        """Each group's learning rate: its schedule's value (its initial lr without a
        schedule) under the plateau rule's ceiling."""
        if self.lr is not None:
            keys, values = group_values(optimizer, "lr", self.lr, n)
        else:
            groups = optimizer.param_groups
            keys = ["lr"] * len(groups)
            values = [float(g.setdefault("ftrain_initial_lr", float(g["lr"]))) for g in groups]
        ceilings = st.ceilings if st is not None else ()
        if len(ceilings) != len(values):
            raise ValueError(
                f"with_schedule: the plateau rule's state has {len(ceilings)} param groups, the "
                f"optimizer {len(values)}; resume with the optimizer the run was saved with."
            )
        return keys, [min(v, c) for v, c in zip(values, ceilings)]

    def observe(self, state: TrainState, tstate: Any, metrics: Mapping[str, Any]) -> Any:
        """Feed an evaluation's metrics to the plateau rule; its new state."""
        from ftrain.metric_names import find_metric

        rule = self.plateau
        if rule is None:
            return tstate
        key = find_metric(metrics, rule.metric)  # "val_loss" or "val/loss": the same metric
        if key is None:  # another evaluation (a test set's): not the plateau's, left alone
            warnings.warn(
                f"with_schedule: the plateau rule watches {rule.metric!r}, but an evaluation "
                f"returned {sorted(metrics)}: it is not counted. If no evaluation returns "
                f"{rule.metric!r}, the learning rate is never lowered: pass "
                "plateau=ftrain.schedules.plateau(name) with the evaluation's name.",
                stacklevel=3,
            )
            return tstate
        value = metrics[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(
                f"with_schedule: the plateau rule's metric {rule.metric!r} must be a number, "
                f"got {value!r}."
            )
        optimizer = optimizer_of(state, self.bound)
        _, current = self._capped_lr(optimizer, self.position(state), tstate.plateau)
        return attrs.evolve(tstate, plateau=rule.observe(tstate.plateau, float(value), current))


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside ftrain (the code that called the step)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ftrain."):
        frame, level = frame.f_back, level + 1
    return level


def declared_end(schedule: Any) -> float | None:
    """The step a schedule's arguments say it ends at (``total``, the sum of its
    ``periods``...), after which it holds its last value; ``None``: it does not end.

    Example:
        >>> from ftrain import schedules as S
        >>> declared_end(S.warmup(S.cosine(0.1, total=70), iters=5)), declared_end(S.constant(1))
        (70, None)
        >>> declared_end(S.join([S.constant(0.1), S.cosine(0.1, 90)], [10]))
        100
    """
    if not isinstance(schedule, Schedule):
        return None
    args = dict(schedule.args)
    if schedule.name in ("warmup", "times"):
        return declared_end(args["schedule"])
    if schedule.name == "by_epoch":
        inner = declared_end(args["schedule"])
        return None if inner is None else inner * args["steps_per_epoch"]
    if schedule.name == "join":
        last = declared_end(args["schedules"][-1])
        return None if last is None else args["boundaries"][-1] + last
    if "periods" in args:
        return sum(args["periods"])
    return args.get("total")


def _check_schedule(key: str, schedule: Any) -> None:
    if not callable(schedule):
        raise TypeError(
            f"with_schedule: {key} must be a schedule (a callable step -> value, such as "
            f"ftrain.schedules.cosine(0.1, total=1000)), got {schedule!r}."
        )
    for n in probe_steps(schedule):
        check_value(float(schedule(n)), key, schedule, n)


def _check_options(given: dict[str, Any], by_epoch: Any, count: Any, plateau: Any) -> None:
    if all(s is None for s in given.values()) and plateau is None:
        raise ValueError(
            "with_schedule needs a schedule: pass lr=, momentum=, weight_decay= and/or "
            "plateau=, e.g. ftrain.with_schedule(step, lr=ftrain.schedules.cosine(0.1, "
            "total=10_000))."
        )
    for key, schedule in given.items():
        if schedule is not None:
            _check_schedule(key, schedule)
    flag("with_schedule: by_epoch", by_epoch)
    if count not in COUNTS:
        raise ValueError(
            f"with_schedule: count must be one of {COUNTS}, got {count!r}: 'micro_batches' "
            "counts as MMEngine's iteration-based schedulers under accumulative_counts."
        )
    if plateau is not None and not isinstance(plateau, Plateau):
        raise TypeError(
            f"with_schedule: plateau must be ftrain.schedules.plateau(metric, ...), got {plateau!r}."
        )


def with_schedule(
    step: Step,
    lr: ScheduleFn | None = None,
    momentum: ScheduleFn | None = None,
    weight_decay: ScheduleFn | None = None,
    *,
    by_epoch: bool = False,
    count: str = "updates",
    plateau: Plateau | None = None,
) -> Step:
    """Set ``lr``, ``momentum`` and ``weight_decay`` of every param group from schedules.

    Before each forward the step writes ``schedule(state.step)`` (``by_epoch=True``:
    ``schedule(state.epoch)``; ``count="micro_batches"``: ``schedule(state.micro_step)``,
    MMEngine's iteration under ``accumulative_counts``: the update ending window ``u`` of ``N``
    micro-batches uses ``schedule(N * u + N - 1)``), so the loss function and the update see
    the same values, as with torch's schedulers. Other param groups get the schedule scaled
    by their ratio to group 0, absolute floors kept (:func:`ftrain.schedules.apply_schedules`).
    On a step bound to named optimizers it sets theirs alone; bound to several (one loss),
    their param groups in order count as one optimizer's (group 0 is the first one's).
    ``plateau=ftrain.schedules.plateau(metric, ...)`` caps the learning rate as torch's
    ``ReduceLROnPlateau`` lowers it, fed by each ``EvalHook`` evaluation (its state is in the
    ``TrainState``); without ``lr`` it caps the optimizer's own learning rates. Group 0's
    values are in ``state.transforms["schedule"].values``. A skipped update counts (as
    MMEngine's ``ParamSchedulerHook``). Under ``with_compile`` a new value does not recompile.
    A negative or NaN value raises ValueError naming the schedule and the step: here for step
    0 and the ends the schedule knows, else before the forward that would use it.

    Example:
        >>> import torch, ftrain
        >>> from ftrain import schedules as S
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> step = ftrain.with_schedule(step, lr=S.warmup(S.cosine(0.1, total=10), iters=2))
        >>> for _ in range(3):
        ...     state, _ = step(state, torch.ones(4, 2))
        >>> round(state.transforms["schedule"].values["lr"], 6)  # the 3rd update used lr(2)
        0.090451
    """
    given = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    _check_options(given, by_epoch, count, plateau)
    scheduled = Scheduled(lr, momentum, weight_decay, by_epoch, count, plateau, step.bound)
    return step.with_transform(scheduled)
