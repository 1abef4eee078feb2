"""Argument checks shared by ftrain's public constructors and functions.

Each check returns the value (converted where that is lossless) or raises an error naming
the argument, what it got and what it takes, before anything runs. ``what`` is the
argument as the message names it, ``"Caller: argument"``. This module imports nothing of
ftrain at import time (every layer may use it; ``directory_arg`` reads a URL with
:mod:`ftrain.persist.location` when it is called).
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrain.persist.location import Location

__all__ = ["flag", "whole", "number", "directory_arg", "nonempty", "known_keywords"]


def _argument(what: str) -> str:
    """``"CheckpointHook: max_keep (or None)"`` -> ``"max_keep"``."""
    return what.split(": ", 1)[-1].split(" ", 1)[0]


def _kind(value: object) -> str:
    """``"a str"``, ``"an int"``: what ``value`` is, for a message."""
    kind = type(value).__name__
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _is_numpy_bool(value: object) -> bool:
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def flag(what: str, value: object, *, none: bool = False) -> bool | None:
    """``value`` if it is ``True`` or ``False`` (a numpy bool too; ``None`` with ``none``);
    else a ``TypeError``. A string is refused: ``"no"`` and ``"False"`` are true in Python.

    Example:
        >>> flag("CheckpointHook: background", False)
        False
        >>> flag("CheckpointHook: background", "no")
        Traceback (most recent call last):
        ...
        TypeError: CheckpointHook: background must be True or False, got 'no' (a str): any \
non-empty string, 'no' and 'False' included, is true in Python. Pass background=False or \
background=True.
    """
    if value is True or value is False or (none and value is None):
        return value  # type: ignore[return-value]
    if _is_numpy_bool(value):
        return bool(value)  # type: ignore[arg-type]
    arg = _argument(what)
    need = "True, False or None" if none else "True or False"
    why = ""
    if isinstance(value, (str, bytes)):
        why = ": any non-empty string, 'no' and 'False' included, is true in Python"
    raise TypeError(
        f"{what} must be {need}, got {value!r} ({_kind(value)}){why}. Pass "
        f"{arg}=False or {arg}=True."
    )


def whole(what: str, value: object, minimum: int, *, none: bool = False) -> int | None:
    """``value`` if it is a whole number >= ``minimum`` (``None`` too with ``none``); else a
    ``ValueError`` naming ``what``.

    Example:
        >>> whole("EvalHook: every", 2, 1)
        2
        >>> whole("Loop: max_steps", None, 1, none=True) is None
        True
    """
    if none and value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum:
        return int(value)
    also = " or None" if none else ""
    raise ValueError(f"{what} must be a whole number >= {minimum}{also}, got {value!r}.")


def _describe(low: float, high: float, low_open: bool, high_open: bool) -> str:
    if low == -math.inf and high == math.inf:
        return "a finite number"
    if high == math.inf:
        return f"a number {'>' if low_open else '>='} {low:g}"
    if low == -math.inf:
        return f"a number {'<' if high_open else '<='} {high:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def number(
    what: str,
    value: object,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    none: bool = False,
    why: str = "",
) -> float | None:
    """``value`` as a float if it is a finite real number in the range (``low``/``high``,
    each excluded with ``low_open``/``high_open``); ``None`` too with ``none``. A bool or a
    string is a ``TypeError``; NaN, infinities and numbers out of range a ``ValueError``.
    ``why`` (what the argument means) follows its name in the message.

    Example:
        >>> number("AutoCheckpointHook: agree_timeout", 10, 0, low_open=True)
        10.0
        >>> number("with_clip: max_norm", float("inf"), 0, low_open=True)
        Traceback (most recent call last):
        ...
        ValueError: with_clip: max_norm must be a finite number > 0, got inf.
    """
    if none and value is None:
        return None
    need = _describe(low, high, low_open, high_open)
    need = need if need == "a finite number" else need.replace("a number", "a finite number")
    subject = f"{what} ({why})" if why else what
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = ""
        if isinstance(value, str):
            try:
                hint = f"; pass {_argument(what)}={float(value)!r}, a number, not a string"
            except ValueError:
                pass
        also = " or None" if none else ""
        raise TypeError(f"{subject} must be {need}{also}, got {value!r} ({_kind(value)}){hint}.")
    x = float(value)
    inside = (
        math.isfinite(x)
        and (x > low if low_open else x >= low)
        and (x < high if high_open else x <= high)
    )
    if not inside:
        raise ValueError(f"{subject} must be {need}, got {value!r}.")
    return x


def directory_arg(
    what: str,
    value: object,
    storage_options: Mapping[str, Any] | None = None,
    *,
    none: bool = True,
) -> Location | None:
    """``value`` as a ``Path`` if it names a directory (a non-empty ``str`` or
    ``os.PathLike``; ``None`` with ``none``), or as a
    :class:`~ftrain.persist.location.StoreURL` for a URL on an object store
    (``s3://bucket/run``, with ``storage_options``). An empty string would mean the current
    directory, so it is refused; a URL whose store package is missing is named now.

    Example:
        >>> directory_arg("CheckpointHook: out_dir", "runs/a").name
        'a'
        >>> str(directory_arg("Loop: work_dir", "memory://bucket/run"))
        'memory://bucket/run'
    """
    from ftrain.persist.location import StoreURL, as_location, is_url

    if none and value is None:
        return None
    if storage_options is not None and not is_url(value):
        raise ValueError(
            f"{what}={value!r} is a local path: storage_options= are for a URL on an object "
            "store (e.g. 's3://bucket/run'). Drop storage_options, or pass a URL."
        )
    if isinstance(value, StoreURL) or (isinstance(value, str) and is_url(value)):
        out = as_location(value, storage_options)
        if isinstance(out, StoreURL):
            from ftrain.persist.store import require

            require(out)  # a missing package is named now, before anything runs
        return out
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path.strip():
            return Path(path)
        if isinstance(path, str):
            raise ValueError(
                f"{what}={value!r} is empty: it would write into the current directory. Pass "
                f"a directory path (e.g. {_argument(what)}='runs/exp1'; '.' for the current "
                "directory)" + (", or None for no files." if none else ".")
            )
    also = ", or None" if none else ""
    raise TypeError(
        f"{what} must be a directory path (a str or pathlib.Path) or a URL (s3://bucket/run)"
        f"{also}, got {value!r} ({_kind(value)})."
    )


def nonempty(what: str, value: object) -> str:
    """``value`` if it is a non-empty string.

    Example:
        >>> nonempty("BestCheckpointHook: metric", "val_loss")
        'val_loss'
    """
    if isinstance(value, str) and value.strip():
        return value
    raise TypeError(f"{what} must be a non-empty string (a name), got {value!r}.")


def known_keywords(what: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """A ``TypeError`` naming the keyword arguments of ``given`` not in ``valid``, listing
    the valid ones (and the likeliest one meant).

    Example:
        >>> known_keywords("wrap('ddp')", ["bucket_cap_mb"], ["bucket_cap_mb", "static_graph"])
        >>> known_keywords("wrap('ddp')", ["static_grph"], ["bucket_cap_mb", "static_graph"])
        Traceback (most recent call last):
        ...
        TypeError: wrap('ddp') got an unexpected keyword argument 'static_grph' (did you mean \
'static_graph'?); it takes: bucket_cap_mb, static_graph.
    """
    valid = sorted(valid)
    unknown = [k for k in given if k not in valid]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    s = "s" if len(unknown) > 1 else ""
    names = ", ".join(map(repr, unknown))
    raise TypeError(
        f"{what} got an unexpected keyword argument{s} {names}{hint}; it takes: "
        f"{', '.join(valid) or 'none'}."
    )
