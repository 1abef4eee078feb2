"""The schedule hook: learning rate and momentum as pure functions of the step.

MMEngine's ``ParamSchedulerHook`` / MMCV's lr and momentum updater hooks, with
the schedules of :mod:`ftrain.schedules`. The value used by the optimizer
update that follows ``state.step`` updates is ``schedule(state.step)`` (or
``schedule(state.epoch)`` with ``by_epoch=True``), so there is nothing to
count, save or restore: a resumed run gets exactly the values of an
uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ftrain.events import EpochBegin, Event, StepEnd
from ftrain.schedules import apply_schedules

__all__ = ["ScheduleHook"]

ScheduleFn = Callable[[int | float], float]


class ScheduleHook:
    """Set ``lr`` (and ``momentum``) of every param group from schedules.

    Args:
        lr: a schedule ``step -> lr`` (see :mod:`ftrain.schedules`), or None.
        momentum: a schedule ``step -> momentum`` (``momentum`` for SGD and
            RMSprop, ``betas[0]`` for Adam-type optimizers), or None.
        by_epoch: call the schedules with the epoch index (``state.epoch``)
            instead of the optimizer step; the value then changes at each
            epoch start, like MMCV's ``by_epoch=True`` updaters. (A step
            schedule that is epoch-based only in part, e.g. a per-iteration
            warmup before epoch milestones, stays ``by_epoch=False`` and uses
            :func:`ftrain.schedules.by_epoch` inside.)

    When the values are written (:func:`ftrain.schedules.apply_schedules`,
    which keeps the ratios between param groups):

    * at ``RunBegin``, for the state the run starts (or resumes) from, so the
      first update of a resumed run already uses the right value;
    * by step: after each optimizer update (a ``StepEnd`` with
      ``is_update``), for the next update. Hooks of higher priority (the
      logger) still see the value the finished update used; hooks of lower
      priority (checkpoints) see the next one;
    * by epoch: at each ``EpochBegin``.

    The per-update cost is one schedule call per schedule and a float
    multiply per param group; no tensor is read. The last values written are
    in :attr:`values`.

    Runs at priority ``LOW``, like MMEngine's ``ParamSchedulerHook``.

    Example:
        >>> import torch, ftrain
        >>> from ftrain import schedules as S
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> sched = ScheduleHook(lr=S.warmup(S.cosine(0.1, total=10), iters=2, ratio=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> state = ftrain.fit(step, state, [torch.ones(4, 2)] * 10, hooks=[sched])
        >>> sched.values
        {'lr': 0.0}
    """

    priority = "LOW"
    name = "schedule"

    def __init__(
        self,
        lr: ScheduleFn | None = None,
        momentum: ScheduleFn | None = None,
        *,
        by_epoch: bool = False,
    ) -> None:
        if lr is None and momentum is None:
            raise ValueError(
                "ScheduleHook needs a schedule: pass lr= and/or momentum=, e.g. "
                "ScheduleHook(lr=ftrain.schedules.cosine(0.1, total=10_000))."
            )
        for what, fn in (("lr", lr), ("momentum", momentum)):
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"ScheduleHook: {what} must be a schedule (a callable step -> value, such as "
                    f"ftrain.schedules.cosine(0.1, total=1000)), got {fn!r}."
                )
        if not isinstance(by_epoch, bool):
            raise TypeError(f"ScheduleHook: by_epoch must be True or False, got {by_epoch!r}.")
        self.lr = lr
        self.momentum = momentum
        self.by_epoch = by_epoch
        self.values: dict[str, float] = {}

    def __repr__(self) -> str:
        parts = []
        if self.lr is not None:
            parts.append(f"lr={self.lr!r}")
        if self.momentum is not None:
            parts.append(f"momentum={self.momentum!r}")
        parts.append(f"by_epoch={self.by_epoch}")
        return f"ScheduleHook({', '.join(parts)})"

    def value_at(self, n: int | float) -> dict[str, float]:
        """The values the schedules give at step (or epoch) ``n``.

        Example:
            >>> from ftrain import schedules as S
            >>> ScheduleHook(lr=S.step_decay(1.0, 2, gamma=0.5)).value_at(5)
            {'lr': 0.25}
        """
        out = {}
        if self.lr is not None:
            out["lr"] = float(self.lr(n))
        if self.momentum is not None:
            out["momentum"] = float(self.momentum(n))
        return out

    def next_step(self, step: int) -> int | None:
        """Every update by step (by epoch, ``EpochBegin`` events only)."""
        return None if self.by_epoch else step + 1

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        state = first.state
        optimizer = state.optimizer
        lr, momentum = self.lr, self.momentum
        self.values = apply_schedules(
            optimizer, state.epoch if self.by_epoch else state.step, lr=lr, momentum=momentum
        )
        yield first
        if self.by_epoch:
            for ev in events:
                if type(ev) is EpochBegin:
                    self.values = apply_schedules(optimizer, ev.epoch, lr=lr, momentum=momentum)
                yield ev
        else:
            for ev in events:
                if type(ev) is StepEnd and ev.is_update:
                    self.values = apply_schedules(
                        optimizer, ev.state.step, lr=lr, momentum=momentum
                    )
                yield ev
