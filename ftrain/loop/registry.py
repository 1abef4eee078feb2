"""The loops of this process that are open: iterated, or paused by ``run(steps=...)``.

A notebook cell run twice builds a second loop on the same ``work_dir`` while the first
is paused: :func:`close_paused_in` closes the first (it saves a resumable checkpoint).
Each directory remembers the loop that opened it last (:func:`claim`): an older loop,
replaced there by a newer one, refuses to run again (:func:`replaced_in`). At exit every
open loop generator is closed while Python still works, so hooks clean up.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import warnings
import weakref
from collections.abc import Iterator
from typing import Protocol

from ftrain.events import Event
from ftrain.persist.location import Location, location_key
from ftrain.state import TrainState

__all__ = ["track", "mark_paused", "close_paused_in", "claim", "replaced_in"]


class Pausable(Protocol):
    """What the registry reads of a paused loop."""

    @property
    def work_dir(self) -> Location | None: ...

    @property
    def state(self) -> TrainState: ...

    def close(self) -> None: ...


_RUNS: weakref.WeakSet[Iterator[Event]] = weakref.WeakSet()  # every loop generator made
_PAUSED: weakref.WeakSet[Pausable] = weakref.WeakSet()  # loops paused by run(steps=...)
_OPENED = itertools.count(1)  # each opening of a run's directories
_NEWEST: dict[str, int] = {}  # per directory (real path, or URL): the opening that claimed it last
_CLAIMS: weakref.WeakKeyDictionary[object, dict[str, tuple[int, str]]] = weakref.WeakKeyDictionary()


def claim(loop: object, directories: list[Location]) -> None:
    """Record that ``loop`` opened ``directories`` (locked them): the newest run there.

    Example:
        >>> class L: pass
        >>> old, new = L(), L()
        >>> claim(old, ["/tmp/r"]); claim(new, ["/tmp/r"])
        >>> replaced_in(old), replaced_in(new)
        ('/tmp/r', None)
    """
    opening = next(_OPENED)
    mine = _CLAIMS.setdefault(loop, {})
    for d in directories:
        key = location_key(d)
        _NEWEST[key] = opening
        mine[key] = (opening, str(d))


def replaced_in(loop: object) -> str | None:
    """A directory ``loop`` opened that a newer loop of this process opened since, or ``None``."""
    for key, (opening, name) in _CLAIMS.get(loop, {}).items():
        if _NEWEST.get(key, opening) != opening:
            return name
    return None


def track(gen: Iterator[Event]) -> Iterator[Event]:
    """Remember a loop's event generator (closed at exit if still open); returns it."""
    _RUNS.add(gen)
    return gen


def mark_paused(loop: Pausable, paused: bool) -> None:
    """Record that ``loop`` is paused by ``run(steps=...)`` (or no longer is)."""
    if paused:
        _PAUSED.add(loop)
    else:
        _PAUSED.discard(loop)


def close_paused_in(work_dir: Location | None, starting: Pausable) -> None:
    """Close the other paused loops of ``work_dir`` before ``starting`` runs there.

    Example:
        >>> close_paused_in(None, None)  # a run without a directory: nothing to close
    """
    if work_dir is None:
        return
    here = location_key(work_dir)
    for other in list(_PAUSED):
        if other is not starting and other.work_dir and location_key(other.work_dir) == here:
            warnings.warn(
                f"Closing a paused run in {work_dir} (step {other.state.step}) "
                "before starting another there; it saves a resumable checkpoint.",
                stacklevel=5,
            )
            other.close()


@atexit.register
def _close_open_runs() -> None:
    """At exit, close open loop generators while Python still works (so hooks clean up:
    ``interrupted.pth`` is saved; at interpreter shutdown TensorBoard's flush would hang)."""
    for gen in list(_RUNS):
        with contextlib.suppress(Exception):
            gen.close()
