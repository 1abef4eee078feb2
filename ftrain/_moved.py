"""Names that left a namespace: the error that says where each one lives now.

Each namespace keeps a small ``{name: new home module}`` table of what it exported before
and calls :func:`moved` from its module ``__getattr__`` (PEP 562).

Example:
    >>> from ftrain._moved import moved
    >>> str(moved("ftrain", "CheckpointHook", {"CheckpointHook": "ftrain.hooks"}))
    'ftrain.CheckpointHook moved: use ftrain.hooks.CheckpointHook'
    >>> str(moved("ftrain.dist", "StopVote", {"StopVote": "ftrain._agreement"}))[:45]
    'ftrain.dist.StopVote is internal now (ftrain.'
    >>> str(moved("ftrain", "nothing", {}))
    "module 'ftrain' has no attribute 'nothing'"
"""

from __future__ import annotations

from collections.abc import Mapping


def moved(namespace: str, name: str, homes: Mapping[str, str]) -> AttributeError:
    """The ``AttributeError`` for ``namespace.name``: where it moved, or that it never was."""
    home = homes.get(name)
    if home is None:
        return AttributeError(f"module {namespace!r} has no attribute {name!r}")
    if home.startswith("ftrain._") or "._" in home:
        return AttributeError(
            f"{namespace}.{name} is internal now ({home}.{name}) and no longer part of the "
            f"public API; see {namespace}.__all__ for what {namespace} offers."
        )
    return AttributeError(f"{namespace}.{name} moved: use {home}.{name}")
