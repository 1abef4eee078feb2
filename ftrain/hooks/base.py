"""Hooks: ordered generators over the iteration stream.

A hook is a generator function that receives the stream of events and
yields it on::

    @ftrain.hook(priority="LOW")
    def announce(events):
        print("before run")                 # runs once, when the run starts
        try:
            for ev in events:
                if isinstance(ev, StepEnd) and ev.is_update and ev.state.step % 100 == 0:
                    print(ev.state.step)     # before `yield`: in priority order
                yield ev                     # pass it on (or yield more events, or fewer)
                # after `yield`: in reverse priority order, before the next event
        finally:
            print("interrupted or done")     # sees KeyboardInterrupt, errors, close()
        print("after run")                  # only when the run completed

Ordering: hooks are sorted by priority (MMEngine's names ``HIGHEST`` (0) ...
``LOWEST`` (100), or an int); equal priorities keep registration order. The
hooks are chained source → highest → ... → lowest → you, so:

* code before the ``for`` (before run) runs in priority order, highest first;
* for each event, code before ``yield ev`` runs in priority order;
* code after ``yield ev`` runs in reverse order (like nested ``with`` blocks);
* code after the loop (after run) and ``finally`` blocks run highest first;
* events a hook adds (``Evaluated``) are seen by the hooks after it only.

Stateful hooks (classes with ``__call__(self, events)``) add ``state_dict()``
and ``load_state_dict()``: their state is saved with checkpoints under the
hook's ``name``. State that differs between ``torch.distributed`` ranks
(a rank's own running sums...) is named by a class attribute
``local_state_keys = ("window",)``: those keys of ``state_dict()`` go to each
rank's own checkpoint file and each rank gets its own back on resume; the
other keys are rank 0's, written once (one process: one file, unchanged).

Sparse streams: most hooks act every N updates, yet a step's event passing
through every hook costs microseconds, more than a small model's step is
worth. A hook object may therefore say which ``StepEnd`` events it needs:

* ``next_step(step) -> int | None``: the first optimizer update after
  ``step`` whose ``StepEnd`` the hook must see (``None``: none, only the
  other events). Asked after every event the loop yields.
* ``collect(metrics)`` (optional): called by the loop, inline, with every
  micro-batch's metrics, right after its step (on every stream, sparse or
  not); a hook that averages metrics (the logger) collects them here
  instead of from events, so it counts every step that ran even when a
  hook before it failed on the step's event.

When *every* hook has ``next_step`` and the loop is driven by ``run()`` /
``fit()``, the stream is sparse: a ``StepEnd`` is yielded only at the
updates some hook asked for (and for a partial window's update, and when
a Ctrl-C is pending); all other events are always yielded. A hook still sees
every event that is yielded, so ``next_step`` only promises a minimum.
With any hook that does not declare it (a plain generator function, most
user hooks), or when you iterate the loop yourself (``for ev in lp``), every
``StepEnd`` flows through every hook, as described above.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from ftrain.events import EpochEnd, Event, StepEnd

__all__ = [
    "PRIORITIES",
    "Hook",
    "HookPlan",
    "Hooks",
    "hook",
    "every",
    "once",
    "on",
    "get_priority",
    "resolve_hooks",
    "next_multiple",
]

PRIORITIES: dict[str, int] = {
    "HIGHEST": 0,
    "VERY_HIGH": 10,
    "HIGH": 30,
    "ABOVE_NORMAL": 40,
    "NORMAL": 50,
    "BELOW_NORMAL": 60,
    "LOW": 70,
    "VERY_LOW": 90,
    "LOWEST": 100,
}
_NAMES = {v: k for k, v in PRIORITIES.items()}

HookFn = Callable[[Iterator[Event]], Iterator[Event]]


def get_priority(priority: int | str) -> int:
    """An int priority from a name (``"LOW"``) or a number in 0..100.

    Example:
        >>> get_priority("VERY_LOW"), get_priority(55)
        (90, 55)
    """
    if isinstance(priority, str):
        key = priority.strip().upper()
        if key not in PRIORITIES:
            raise ValueError(
                f"Unknown hook priority {priority!r}; use an int in 0..100 or one of "
                f"{', '.join(PRIORITIES)}."
            )
        return PRIORITIES[key]
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100:
        raise ValueError(
            f"Hook priority must be an int in 0..100 (0 runs first) or a name like 'NORMAL', "
            f"got {priority!r}."
        )
    return priority


def _snake(name: str) -> str:
    name = re.sub(r"Hook$", "", name) or name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@attrs.frozen(repr=False)
class Hook:
    """A hook function (or object) with its priority and name.

    Calling a ``Hook`` calls the wrapped generator function, so it stays a
    value you can pass anywhere a hook function goes.
    """

    fn: HookFn
    priority: int = attrs.field(default=50, converter=get_priority)
    name: str = ""

    def __attrs_post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"A hook must be a generator function over events, got {self.fn!r}.")
        _check_generator(self.fn)
        if not self.name:
            base = getattr(self.fn, "__name__", None) or _snake(type(self.fn).__name__)
            object.__setattr__(self, "name", base)

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        return self.fn(events)

    @property
    def next_step(self) -> Callable[[int], int | None] | None:
        """The hook's ``next_step(step)``, or ``None``: it sees every ``StepEnd``."""
        return getattr(self.fn, "next_step", None)

    @property
    def collect(self) -> Callable[[dict[str, Any]], None] | None:
        """The hook's ``collect(metrics)``, or ``None``."""
        return getattr(self.fn, "collect", None)

    @property
    def stateful(self) -> bool:
        return hasattr(self.fn, "state_dict") and hasattr(self.fn, "load_state_dict")

    def state_dict(self) -> Any:
        return self.fn.state_dict() if self.stateful else None

    def load_state_dict(self, saved: Any) -> None:
        if self.stateful:
            self.fn.load_state_dict(saved)

    @property
    def local_state_keys(self) -> tuple[str, ...]:
        """Keys of ``state_dict()`` that are this process's own (the hook's ``local_state_keys``).

        Under ``torch.distributed`` each rank writes these to its own file and
        gets its own back on resume; the rest of the hook's state is rank 0's.
        """
        if not self.stateful:
            return ()
        return tuple(getattr(self.fn, "local_state_keys", ()) or ())

    def __repr__(self) -> str:
        label = _NAMES.get(self.priority, str(self.priority))
        return f"Hook({self.name!r}, priority={label}, fn={self.fn!r})"


def _check_generator(fn: Any) -> None:
    """Reject a plain callback at construction: it would swallow the whole run.

    A hook is a generator function (``yield ev``) or a callable returning an
    iterator (``lambda events: (ev for ev in events)``). A function that
    returns nothing (``def f(events): for ev in events: print(ev)``) is not:
    it would consume every event itself.
    """
    import functools
    import inspect

    target = fn.func if isinstance(fn, functools.partial) else fn
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        call = type(target).__call__
        if not inspect.isfunction(call):
            return  # a builtin or C callable: checked when the run starts
        target = call
    if inspect.isgeneratorfunction(target) or _returns_value(target.__code__):
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    raise TypeError(
        f"Hook {name!r} is not a generator function: a hook receives the event stream and "
        "yields it on (`def my_hook(events): for ev in events: ...; yield ev`). For a plain "
        "callback use ftrain.every(n, fn), ftrain.once(fn) or ftrain.on(EventType, fn)."
    )


def _returns_value(code: Any) -> bool:
    """Whether a function's body can return something other than None."""
    import dis

    previous = None
    for ins in dis.get_instructions(code):
        if ins.opname == "RETURN_CONST" and ins.argval is not None:
            return True
        if ins.opname == "RETURN_VALUE" and not (
            previous is not None and previous.opname == "LOAD_CONST" and previous.argval is None
        ):
            return True
        previous = ins
    return False


def hook(
    fn: HookFn | None = None, *, priority: int | str = "NORMAL", name: str | None = None
) -> Any:
    """Give a hook function a priority and a name; usable as a decorator.

    Example:
        >>> import ftrain
        >>> @ftrain.hook(priority="LOW")
        ... def passthrough(events):
        ...     yield from events
        >>> passthrough.priority, passthrough.name
        (70, 'passthrough')
    """
    if fn is None:
        return lambda f: hook(f, priority=priority, name=name)
    return Hook(fn, priority, name or "")


def as_hook(obj: Any) -> Hook:
    """A :class:`Hook` from a Hook, a hook function, or a hook object."""
    if isinstance(obj, Hook):
        return obj
    if not callable(obj):
        raise TypeError(
            f"{obj!r} is not a hook: pass a generator function over events, a hook object, or "
            "ftrain.every(n, fn) for a plain function."
        )
    priority = getattr(obj, "priority", "NORMAL")
    name = getattr(obj, "name", None) or getattr(obj, "__name__", None)
    if not isinstance(name, str) or not name:
        name = _snake(type(obj).__name__)
    return Hook(obj, priority, name)


def next_multiple(step: int, n: int) -> int:
    """The first multiple of ``n`` after ``step``: a ``next_step`` for "every ``n`` updates".

    Example:
        >>> next_multiple(0, 50), next_multiple(49, 50), next_multiple(50, 50)
        (50, 50, 100)
    """
    return (step // n + 1) * n


def _never(step: int) -> None:
    """A ``next_step`` for hooks that need no ``StepEnd`` at all."""
    return None


class _Every:
    """Call ``fn(event)`` on matching events (the body of :func:`every`)."""

    def __init__(self, n: int, fn: Callable[[Event], Any], by: str, first: bool) -> None:
        self.n, self.fn, self.by, self.first = n, fn, by, first

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        n, fn, by, first = self.n, self.fn, self.by, self.first
        for ev in events:
            if by == "step":
                if type(ev) is StepEnd and ev.is_update:
                    k = ev.state.step
                    if k % n == 0 or (first and k == 1):
                        fn(ev)
            elif by == "epoch":
                if type(ev) is EpochEnd and ((ev.epoch + 1) % n == 0 or (first and ev.epoch == 0)):
                    fn(ev)
            elif isinstance(ev, StepEnd) and ev.state.micro_step % n == 0:
                fn(ev)
            yield ev

    @property
    def next_step(self) -> Callable[[int], int | None] | None:
        if self.by == "micro_step":
            return None  # every micro-batch: no schedule
        return self._next

    def _next(self, step: int) -> int | None:
        if self.by == "epoch":
            return None
        if self.first and step < 1:
            return 1
        return next_multiple(step, self.n)

    def __repr__(self) -> str:
        return f"every({self.n}, {getattr(self.fn, '__name__', self.fn)!r}, by={self.by!r})"


def every(
    n: int,
    fn: Callable[[Event], Any],
    *,
    by: str = "step",
    first: bool = False,
    priority: int | str = "NORMAL",
    name: str | None = None,
) -> Hook:
    """A hook calling ``fn(event)`` every ``n`` optimizer steps, epochs or micro-batches.

    ``by="step"`` calls it on the ``StepEnd`` of every ``n``-th optimizer update,
    ``by="epoch"`` on every ``n``-th ``EpochEnd``, ``by="micro_step"`` on every
    ``n``-th micro-batch. ``first=True`` also calls it at the first one.

    Example:
        >>> import ftrain
        >>> h = ftrain.every(100, lambda ev: print(ev.state.step, float(ev.metrics["loss"])))
        >>> h.priority
        50
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every: n must be a whole number >= 1, got {n!r}.")
    if by not in ("step", "epoch", "micro_step"):
        raise ValueError(f"every: by must be 'step', 'epoch' or 'micro_step', got {by!r}.")
    if not callable(fn):
        raise TypeError(f"every: fn must be callable(event), got {fn!r}.")
    label = name or f"every_{n}_{by}s_{getattr(fn, '__name__', 'fn')}".replace("<lambda>", "fn")
    return Hook(_Every(n, fn, by, first), priority, label)


class _Once:
    """Call ``fn(event)`` at one update or epoch (the body of :func:`once`)."""

    def __init__(self, at: int, fn: Callable[[Event], Any], by: str) -> None:
        self.at, self.fn, self.by = at, fn, by

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        at, fn = self.at, self.fn
        if self.by == "step":
            for ev in events:
                if type(ev) is StepEnd and ev.is_update and ev.state.step == at:
                    fn(ev)
                yield ev
        else:
            for ev in events:
                if type(ev) is EpochEnd and ev.epoch + 1 == at:
                    fn(ev)
                yield ev

    def next_step(self, step: int) -> int | None:
        return self.at if self.by == "step" and step < self.at else None

    def __repr__(self) -> str:
        return f"once({getattr(self.fn, '__name__', self.fn)!r}, at={self.at}, by={self.by!r})"


def once(
    fn: Callable[[Event], Any],
    *,
    at: int = 1,
    by: str = "step",
    priority: int | str = "NORMAL",
    name: str | None = None,
) -> Hook:
    """A hook calling ``fn(event)`` once: at optimizer update ``at`` or after epoch ``at``.

    ``by="step"``: on the ``StepEnd`` of update number ``at`` (counted from 1);
    ``by="epoch"``: on the ``EpochEnd`` of the ``at``-th epoch. A run resumed
    past that point does not call it again.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> h = ftrain.once(lambda ev: print("update", ev.state.step), at=2)
        >>> _ = ftrain.fit(step, state, [torch.ones(4, 2)] * 3, hooks=[h])
        update 2
    """
    if isinstance(at, bool) or not isinstance(at, int) or at < 1:
        raise ValueError(f"once: at must be a whole number >= 1, got {at!r}.")
    if by not in ("step", "epoch"):
        raise ValueError(f"once: by must be 'step' or 'epoch', got {by!r}.")
    if not callable(fn):
        raise TypeError(f"once: fn must be callable(event), got {fn!r}.")
    label = name or f"once_{by}_{at}_{getattr(fn, '__name__', 'fn')}".replace("<lambda>", "fn")
    return Hook(_Once(at, fn, by), priority, label)


class _On:
    def __init__(self, kind: type[Event], fn: Callable[[Event], Any]) -> None:
        self.kind, self.fn = kind, fn

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        kind, fn = self.kind, self.fn
        for ev in events:
            if isinstance(ev, kind):
                fn(ev)
            yield ev

    @property
    def next_step(self) -> Callable[[int], int | None] | None:
        if issubclass(StepEnd, self.kind):
            return None  # it wants every StepEnd
        return _never

    def __repr__(self) -> str:
        return f"on({self.kind.__name__}, {getattr(self.fn, '__name__', self.fn)!r})"


def on(
    kind: type[Event],
    fn: Callable[[Event], Any],
    *,
    priority: int | str = "NORMAL",
    name: str | None = None,
) -> Hook:
    """A hook calling ``fn(event)`` for every event of type ``kind``.

    Example:
        >>> import ftrain
        >>> from ftrain.events import EpochEnd
        >>> h = ftrain.on(EpochEnd, lambda ev: print("epoch", ev.epoch, "done"))
        >>> h.name
        'on_EpochEnd'
    """
    if not (isinstance(kind, type) and issubclass(kind, Event)):
        raise TypeError(f"on: kind must be an event class from ftrain.events, got {kind!r}.")
    return Hook(_On(kind, fn), priority, name or f"on_{kind.__name__}")


class Hooks(list):
    """A list of hooks with one-line ``replace`` and ``drop`` by name.

    Example:
        >>> import ftrain
        >>> hooks = ftrain.default_hooks().drop("logger")
        >>> "logger" in hooks.names()
        False
    """

    def names(self) -> list[str]:
        return [as_hook(h).name for h in self]

    def _index(self, name: str) -> int:
        names = self.names()
        if name not in names:
            raise KeyError(f"No hook named {name!r}; hooks are {names}.")
        return names.index(name)

    def replace(self, name: str, new: Any) -> Hooks:
        """A copy with the hook ``name`` replaced by ``new``."""
        out = Hooks(self)
        out[self._index(name)] = new
        return out

    def drop(self, *names: str) -> Hooks:
        """A copy without the hooks named ``names``."""
        for n in names:
            self._index(n)
        return Hooks(h for h in self if as_hook(h).name not in names)

    def add(self, *hooks: Any) -> Hooks:
        """A copy with ``hooks`` added."""
        return Hooks([*self, *hooks])


class HookPlan:
    """Hooks resolved into the order they run in; printable."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = hooks

    def __iter__(self):
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def __getitem__(self, name: str) -> Hook:
        for h in self.hooks:
            if h.name == name:
                return h
        raise KeyError(f"No hook named {name!r}; hooks are {[h.name for h in self.hooks]}.")

    def __repr__(self) -> str:
        if not self.hooks:
            return "HookPlan(no hooks)"
        rows = [("#", "priority", "name", "hook")]
        for i, h in enumerate(self.hooks):
            label = (
                f"{_NAMES[h.priority]} ({h.priority})" if h.priority in _NAMES else str(h.priority)
            )
            rows.append((str(i), label, h.name, repr(h.fn)))
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
        return "HookPlan: each event passes through the hooks top to bottom\n" + "\n".join(lines)


def resolve_hooks(hooks: Iterable[Any]) -> HookPlan:
    """Sort hooks by priority, keeping registration order among equals.

    Names are made unique (``name#2``) so state can be saved per hook.

    Example:
        >>> import ftrain
        >>> plan = ftrain.resolve_hooks([ftrain.every(5, print, priority="LOW"), ftrain.every(5, print, priority="HIGH")])
        >>> [h.priority for h in plan]
        [30, 70]
    """
    resolved = [as_hook(h) for h in hooks]
    seen: dict[str, int] = {}
    unique = []
    for h in resolved:
        count = seen.get(h.name, 0) + 1
        seen[h.name] = count
        unique.append(h if count == 1 else attrs.evolve(h, name=f"{h.name}#{count}"))
    return HookPlan(sorted(unique, key=lambda h: h.priority))  # sorted() is stable
