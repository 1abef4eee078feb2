"""Hooks: ordered generators over the iteration stream.

A hook is a generator function that receives the stream of events and
yields it on::

    @ftrain.hook(priority="LOW", cadence=ftrain.Every(steps=100))
    def announce(events):
        print("before run")                 # once, when the run starts
        try:
            for ev in events:
                if isinstance(ev, StepEnd) and ev.is_update and announce.cadence.due(ev.state.step):
                    print(ev.state.step)     # before `yield`: in priority order
                yield ev                     # pass every event on (or add events)
                # after `yield`: in reverse priority order, before the next event
        finally:
            print("interrupted or done")     # sees KeyboardInterrupt, errors, close()
        print("after run")                  # only when the run completed

The events and when each comes: :mod:`ftrain.loop` ("What runs when").

Priorities are MMEngine's names (``HIGHEST`` 0 ... ``LOWEST`` 100) or ints;
equal priorities keep registration order. The chain is source -> highest
-> ... -> lowest -> you, so code after ``yield ev`` runs in reverse order.

Cadence (:class:`~ftrain.hooks.cadence.Every`): a hook's ``cadence``
attribute (or ``ftrain.hook(..., cadence=)``), read once after ``RunBegin``.
Under :meth:`Loop.run <ftrain.loop.Loop.run>` a ``StepEnd`` comes only at an
update some hook is due at, so a hook checks ``cadence.due(step)``. A hook
without a cadence sees every micro-batch's ``StepEnd``, and so do all when you
iterate the loop. ``loop.totals`` counts every micro-batch whatever the cadence.

Stateful hooks (objects with ``__call__(self, events)``) add ``state_dict()``
and ``load_state_dict()``, saved with checkpoints under the hook's ``name``;
``local_state_keys = ("window",)`` names the keys each rank saves its own of.

Hooks that write files declare where (:class:`WritesFiles`: ``output_dirs(work_dir)``
returning :class:`OutputDir` records); the run's checkpoint directories (where
``resume="auto"`` looks) are those marked ``checkpoints=True`` and ``work_dir``.
"""

from __future__ import annotations

import dis
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from ftrain._checks import flag, whole
from ftrain.events import EpochEnd, Event, StepEnd
from ftrain.hooks.cadence import EVERY_MICRO_BATCH, Every
from ftrain.persist.location import Location, as_location, location_key

__all__ = [
    "PRIORITIES",
    "Hook",
    "OutputDir",
    "WritesFiles",
    "EmitsEvents",
    "HookPlan",
    "Hooks",
    "hook",
    "every",
    "once",
    "on",
    "get_priority",
    "resolve_hooks",
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
_NO_STEPS = Every()  # no StepEnd at all, only the other events

HookFn = Callable[[Iterator[Event]], Iterator[Event]]
T = TypeVar("T")


@attrs.frozen
class OutputDir:
    """A directory a hook writes to; ``checkpoints``: resumable checkpoints (``resume="auto"``
    looks there).

    Example:
        >>> OutputDir("runs/a/ckpt", checkpoints=True).path.name
        'ckpt'
    """

    path: Location = attrs.field(converter=as_location)  # a local path, or a store's URL
    checkpoints: bool = False


@runtime_checkable
class WritesFiles(Protocol):
    """A hook that writes files says where: the directories for a run in ``work_dir``."""

    def output_dirs(self, work_dir: Location | None) -> Sequence[OutputDir]:
        """The directories this hook writes to in a run whose work_dir is ``work_dir``."""


@runtime_checkable
class EmitsEvents(Protocol):
    """A hook that puts events of its own on the stream says which: ``emits``, their types
    (:class:`~ftrain.hooks.evaluation.EvalHook`: ``(Evaluated,)``). Hooks acting on them
    (``EarlyStoppingHook``) check at the start that a hook of the run emits them.

    Example:
        >>> from ftrain.events import Evaluated
        >>> class MyEval:
        ...     emits = (Evaluated,)
        ...     def __call__(self, events):
        ...         yield from events
        >>> isinstance(MyEval(), EmitsEvents)
        True
    """

    emits: tuple[type[Event], ...]


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


def _check_cadence(_: Any, __: Any, value: Any) -> None:
    if value is not None and not isinstance(value, Every):
        raise TypeError(f"A hook's cadence must be an ftrain.Every(...) or None, got {value!r}.")


@attrs.frozen(repr=False)
class Hook:
    """A hook function (or object) with its priority, name and cadence; calling it calls ``fn``.

    ``cadence``: the one given, else ``fn.cadence`` (read when the run starts),
    else :data:`~ftrain.hooks.cadence.EVERY_MICRO_BATCH`.
    """

    fn: HookFn
    priority: int = attrs.field(default=50, converter=get_priority)
    name: str = ""
    _cadence: Every | None = attrs.field(default=None, validator=_check_cadence)

    def __attrs_post_init__(self) -> None:
        _check_hook(self.fn)
        if not self.name:
            base = getattr(self.fn, "__name__", None)
            if not isinstance(base, str) or not base:
                base = _snake(type(self.fn).__name__)
            object.__setattr__(self, "name", base)

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        return self.fn(events)

    @property
    def cadence(self) -> Every:
        """Which updates' ``StepEnd`` this hook needs (see :mod:`ftrain.hooks.base`)."""
        if self._cadence is not None:
            return self._cadence
        cadence = getattr(self.fn, "cadence", None)
        if cadence is None:
            return EVERY_MICRO_BATCH
        if not isinstance(cadence, Every):
            raise TypeError(
                f"Hook {self.name!r}: its cadence must be an ftrain.Every(...), got {cadence!r}."
            )
        return cadence

    @property
    def stateful(self) -> bool:
        return hasattr(self.fn, "state_dict") and hasattr(self.fn, "load_state_dict")

    def state_dict(self) -> Any:
        return self.fn.state_dict() if self.stateful else None

    def load_state_dict(self, saved: Any) -> None:
        if self.stateful:
            self.fn.load_state_dict(saved)

    def output_dirs(self, work_dir: Location | None) -> list[OutputDir]:
        """Where the hook writes (:class:`WritesFiles`), in a run whose work_dir is ``work_dir``."""
        return list(self.fn.output_dirs(work_dir)) if isinstance(self.fn, WritesFiles) else []

    @property
    def local_state_keys(self) -> tuple[str, ...]:
        """Keys of ``state_dict()`` that are this process's own (each rank saves its own)."""
        keys = getattr(self.fn, "local_state_keys", ()) if self.stateful else ()
        return tuple(keys or ())

    def __repr__(self) -> str:
        label = _NAMES.get(self.priority, self.priority)
        return f"Hook({self.name!r}, priority={label}, fn={self.fn!r})"


def _check_hook(fn: Any) -> None:
    """Reject at construction what would fail (or swallow the run) when it starts."""
    if isinstance(fn, type):
        raise TypeError(
            f"{fn.__name__} is a class, not a hook: pass an instance, {fn.__name__}() "
            "(with its arguments), in hooks=[...]."
        )
    if not callable(fn):
        raise TypeError(
            f"{fn!r} is not a hook: pass a generator function over events, a hook object, or "
            "ftrain.every(n, fn) for a plain function."
        )
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
        "callback use ftrain.every(n, fn), ftrain.hooks.once(fn) or ftrain.hooks.on(EventType, fn)."
    )


def _returns_value(code: Any) -> bool:
    """Whether a function's body can return something other than None."""
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
    fn: HookFn | None = None,
    *,
    priority: int | str | None = None,
    name: str | None = None,
    cadence: Every | None = None,
) -> Any:
    """Give a hook function (or object) a priority, a name and a cadence; usable as a decorator.

    ``None`` keeps the object's own attribute, else ``NORMAL``, its name, every ``StepEnd``.

    Example:
        >>> import ftrain
        >>> @ftrain.hook(priority="LOW", cadence=ftrain.Every(steps=10))
        ... def passthrough(events):
        ...     yield from events
        >>> passthrough.priority, passthrough.name, passthrough.cadence.next_due(0)
        (70, 'passthrough', 10)
    """
    if fn is None:
        return lambda f: hook(f, priority=priority, name=name, cadence=cadence)
    base = as_hook(fn)
    return Hook(
        base.fn,
        base.priority if priority is None else priority,
        name or base.name,
        cadence or base._cadence,
    )


def as_hook(obj: Any) -> Hook:
    """A :class:`Hook` from a Hook, a hook function, or a hook object."""
    if isinstance(obj, Hook):
        return obj
    name = getattr(obj, "name", None)  # else Hook names it
    return Hook(obj, getattr(obj, "priority", "NORMAL"), name if isinstance(name, str) else "")


def _check_args(caller: str, arg: str, n: Any, fn: Any) -> None:
    whole(f"{caller}: {arg}", n, 1)
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable(event), got {fn!r}.")


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", "fn").replace("<lambda>", "fn")


class _Call:
    """Call ``fn(event)`` on the events ``when`` accepts (the body of every/once/on)."""

    def __init__(
        self, fn: Callable[[Event], Any], when: Callable[[Event], bool], cadence: Every, label: str
    ) -> None:
        self.fn, self.when, self.cadence, self.label = fn, when, cadence, label

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        fn, when = self.fn, self.when
        for ev in events:
            if when(ev):
                fn(ev)
            yield ev

    def __repr__(self) -> str:
        return self.label


def every(
    n: int,
    fn: Callable[[Event], Any],
    *,
    by: str = "step",
    first: bool = False,
    priority: int | str = "NORMAL",
    name: str | None = None,
) -> Hook:
    """A hook calling ``fn(event)`` every ``n`` optimizer updates, epochs or micro-batches.

    ``by="step"``: the ``StepEnd`` of every ``n``-th optimizer update;
    ``by="epoch"``: every ``n``-th ``EpochEnd``; ``by="micro_step"``: every
    ``n``-th micro-batch's ``StepEnd``. ``first=True`` also calls it at the first one.

    Example:
        >>> import ftrain
        >>> h = ftrain.every(100, lambda ev: print(ev.state.step, float(ev.metrics["loss"])))
        >>> h.priority, h.cadence.next_due(0)
        (50, 100)
    """
    _check_args("every", "n", n, fn)
    flag("every: first", first)
    if by == "step":
        cadence = Every(steps=n, at=(1,) if first else ())

        def when(ev: Event) -> bool:
            return type(ev) is StepEnd and ev.is_update and cadence.due(ev.state.step)

    elif by == "epoch":
        cadence = Every(epochs=n)

        def when(ev: Event) -> bool:
            return type(ev) is EpochEnd and (
                cadence.due_epoch(ev.epoch) or (first and ev.epoch == 0)
            )

    elif by == "micro_step":
        cadence = EVERY_MICRO_BATCH

        def when(ev: Event) -> bool:
            return isinstance(ev, StepEnd) and ev.state.micro_step % n == 0

    else:
        raise ValueError(f"every: by must be 'step', 'epoch' or 'micro_step', got {by!r}.")
    label = f"every({n}, {_fn_name(fn)!r}, by={by!r})"
    name = name or f"every_{n}_{by}s_{_fn_name(fn)}"
    return Hook(_Call(fn, when, cadence, label), priority, name)


def once(
    fn: Callable[[Event], Any],
    *,
    at: int = 1,
    by: str = "step",
    priority: int | str = "NORMAL",
    name: str | None = None,
) -> Hook:
    """A hook calling ``fn(event)`` once: at optimizer update ``at`` or after epoch ``at``.

    ``by="step"``: the ``StepEnd`` of update number ``at`` (counted from 1);
    ``by="epoch"``: the ``EpochEnd`` of the ``at``-th epoch. A run resumed
    past that point does not call it again.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> h = ftrain.hooks.once(lambda ev: print("update", ev.state.step), at=2)
        >>> _ = ftrain.Loop(step, state, [torch.ones(4, 2)] * 3, hooks=[h]).run()
        update 2
    """
    _check_args("once", "at", at, fn)
    if by == "step":
        cadence = Every(at=(at,))

        def when(ev: Event) -> bool:
            return type(ev) is StepEnd and ev.is_update and ev.state.step == at

    elif by == "epoch":
        cadence = _NO_STEPS

        def when(ev: Event) -> bool:
            return type(ev) is EpochEnd and ev.epoch + 1 == at

    else:
        raise ValueError(f"once: by must be 'step' or 'epoch', got {by!r}.")
    label = f"once({_fn_name(fn)!r}, at={at}, by={by!r})"
    name = name or f"once_{by}_{at}_{_fn_name(fn)}"
    return Hook(_Call(fn, when, cadence, label), priority, name)


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
        >>> def report(ev):
        ...     print("epoch", ev.epoch, "done")
        >>> ftrain.hooks.on(EpochEnd, report).name
        'on_EpochEnd_report'
    """
    if not (isinstance(kind, type) and issubclass(kind, Event)):
        raise TypeError(f"on: kind must be an event class from ftrain.events, got {kind!r}.")
    if not callable(fn):
        raise TypeError(f"on: fn must be callable(event), got {fn!r}.")
    cadence = EVERY_MICRO_BATCH if issubclass(StepEnd, kind) else _NO_STEPS
    label = f"on({kind.__name__}, {_fn_name(fn)!r})"
    name = name or f"on_{kind.__name__}_{_fn_name(fn)}"
    return Hook(_Call(fn, lambda ev: isinstance(ev, kind), cadence, label), priority, name)


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

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def __getitem__(self, name: str) -> Hook:
        for h in self.hooks:
            if h.name == name:
                return h
        raise KeyError(f"No hook named {name!r}; hooks are {[h.name for h in self.hooks]}.")

    def of_type(self, kind: type[T]) -> list[T]:
        """The hook functions or objects that are ``kind`` instances (a class or a
        ``runtime_checkable`` protocol), in run order.

        Example:
            >>> import ftrain
            >>> plan = ftrain.hooks.resolve_hooks([ftrain.TimerHook(), ftrain.CheckpointHook()])
            >>> [type(h).__name__ for h in plan.of_type(ftrain.TimerHook)]
            ['TimerHook']
        """
        return [h.fn for h in self.hooks if isinstance(h.fn, kind)]

    def checkpoint_dirs(self, work_dir: str | os.PathLike | Location | None) -> list[Location]:
        """``work_dir`` and the directories the hooks write checkpoints to (no duplicates).

        Example:
            >>> import ftrain
            >>> plan = ftrain.hooks.resolve_hooks([ftrain.CheckpointHook(out_dir="/tmp/c")])
            >>> [str(p) for p in plan.checkpoint_dirs("/tmp/run")]
            ['/tmp/run', '/tmp/c']
        """
        base = None if work_dir is None else as_location(work_dir)
        dirs = [] if base is None else [base]
        for h in self.hooks:
            dirs += [d.path for d in h.output_dirs(base) if d.checkpoints]
        unique: dict[str, Location] = {}
        for d in dirs:
            unique.setdefault(location_key(d), d)
        return list(unique.values())

    def local_state_keys(self) -> dict[str, tuple[str, ...]]:
        """Per stateful hook with any, the keys of its state each rank saves its own of."""
        return {h.name: keys for h in self.hooks if (keys := h.local_state_keys)}

    def __repr__(self) -> str:
        if not self.hooks:
            return "HookPlan(no hooks)"
        rows = [("#", "priority", "name", "hook")]
        for i, h in enumerate(self.hooks):
            name = _NAMES.get(h.priority)
            label = f"{name} ({h.priority})" if name else str(h.priority)
            rows.append((str(i), label, h.name, repr(h.fn)))
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
        return "HookPlan: each event passes through the hooks top to bottom\n" + "\n".join(lines)


def resolve_hooks(hooks: Iterable[Any]) -> HookPlan:
    """Sort hooks by priority, keeping registration order among equals.

    Each stateful hook's state is saved under its name, so two stateful
    hooks with one name are an error; stateless ones are renamed ``name#2``...

    Example:
        >>> import ftrain
        >>> plan = ftrain.hooks.resolve_hooks([ftrain.every(5, print, priority="LOW"), ftrain.TimerHook()])
        >>> [(h.name, h.priority) for h in plan]
        [('timer', 50), ('every_5_steps_print', 70)]
    """
    if not isinstance(hooks, Iterable) or isinstance(hooks, (str, bytes)):
        raise TypeError(
            f"hooks must be a list of hooks (ftrain.default_hooks(), [ftrain.TimerHook(), ...]) "
            f"or None for the defaults, got {hooks!r}."
        )
    seen: dict[str, Hook] = {}
    unique = []
    for h in map(as_hook, hooks):
        other = seen.get(h.name)
        if other is not None and (h.stateful or other.stateful):
            raise ValueError(
                f"Two hooks are named {h.name!r}: {other.fn!r} and {h.fn!r}. Each hook's state is "
                "saved under its name, so the names must differ: name one of them, e.g. "
                f"ftrain.hook({type(h.fn).__name__}(...), name='{h.name}_2')."
            )
        count = 2
        while h.name in seen:
            h, count = attrs.evolve(h, name=f"{h.name.split('#')[0]}#{count}"), count + 1
        seen[h.name] = h
        unique.append(h)
    return HookPlan(sorted(unique, key=lambda h: h.priority))  # sorted() is stable
