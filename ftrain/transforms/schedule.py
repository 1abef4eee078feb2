"""Schedules in the step: ``lr``, ``momentum``, ``weight_decay`` as functions of the update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs
import torch

from ftrain.schedules import ScheduleFn, apply_schedules, check_value, probe_steps
from ftrain.transforms.base import Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_schedule", "Scheduled", "ScheduleState"]


@attrs.frozen
class ScheduleState:
    """The values the last update used (param group 0's), e.g. ``{'lr': 0.05}``."""

    values: Mapping[str, float] = attrs.field(factory=dict)


@attrs.frozen
class Scheduled(Transform):
    """Set the optimizer's settings from schedules before each update. See :func:`with_schedule`."""

    lr: ScheduleFn | None = None
    momentum: ScheduleFn | None = None
    weight_decay: ScheduleFn | None = None
    by_epoch: bool = False
    name = "schedule"
    stage = 0  # before unscaling and clipping: with_compile keeps the update compiled

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ScheduleState:
        return ScheduleState()

    def before_update(self, ctx: StepContext) -> None:
        n = ctx.state.epoch if self.by_epoch else ctx.state.step
        values = apply_schedules(ctx.optimizer, n, self.lr, self.momentum, self.weight_decay)
        ctx.tstate["schedule"] = ScheduleState(values)


def with_schedule(
    step: Step,
    lr: ScheduleFn | None = None,
    momentum: ScheduleFn | None = None,
    weight_decay: ScheduleFn | None = None,
    *,
    by_epoch: bool = False,
) -> Step:
    """Set ``lr``, ``momentum`` and ``weight_decay`` of every param group from schedules.

    Each update uses ``schedule(state.step)`` (``by_epoch=True``: ``schedule(state.epoch)``),
    written by :func:`ftrain.schedules.apply_schedules` just before it, keeping the param
    groups' ratios; the values are also in ``state.transforms["schedule"].values``. A skipped
    update counts (as MMEngine's ``ParamSchedulerHook``). Under ``with_compile`` a new value
    does not recompile. A negative or NaN value raises ValueError naming the schedule and the
    step: here for step 0 and the ends the schedule knows, else before the update using it.

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
    given = {key: s for key, s in given.items() if s is not None}
    if not given:
        raise ValueError(
            "with_schedule needs a schedule: pass lr=, momentum= and/or weight_decay=, e.g. "
            "ftrain.with_schedule(step, lr=ftrain.schedules.cosine(0.1, total=10_000))."
        )
    if not isinstance(by_epoch, bool):
        raise TypeError(f"with_schedule: by_epoch must be True or False, got {by_epoch!r}.")
    for key, schedule in given.items():
        if not callable(schedule):
            raise TypeError(
                f"with_schedule: {key} must be a schedule (a callable step -> value, such as "
                f"ftrain.schedules.cosine(0.1, total=1000)), got {schedule!r}."
            )
        for n in probe_steps(schedule):
            check_value(float(schedule(n)), key, schedule, n)
    return step.with_transform(Scheduled(lr, momentum, weight_decay, by_epoch))
