"""Hooks: ordered generators over the iteration stream (see :mod:`ftrain.hooks.base`).

The sinks a :class:`LoggerHook` writes to live in :mod:`ftrain.hooks.sinks`; how hooks are
ordered and planned (``PRIORITIES``, ``get_priority``, ``Hooks``, ``HookPlan``) in
:mod:`ftrain.hooks.base`.
"""

from ftrain._moved import moved
from ftrain.hooks.base import Hook, every, hook, on, once, resolve_hooks
from ftrain.hooks.cadence import Every
from ftrain.hooks.checkpoint import AutoCheckpointHook, BestCheckpointHook, CheckpointHook
from ftrain.hooks.defaults import default_hooks
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.timer import TimerHook

__all__ = [
    "Hook",
    "hook",
    "every",
    "Every",
    "once",
    "on",
    "resolve_hooks",
    "default_hooks",
    "CheckpointHook",
    "BestCheckpointHook",
    "AutoCheckpointHook",
    "LoggerHook",
    "TimerHook",
    "EvalHook",
    "EmptyCacheHook",
    "EarlyStoppingHook",
    "ProfilerHook",
]

LAZY = {  # names loaded on first use (they pull in more imports)
    "EvalHook": "ftrain.hooks.evaluation",
    "EmptyCacheHook": "ftrain.hooks.misc",
    "EarlyStoppingHook": "ftrain.hooks.misc",
    "ProfilerHook": "ftrain.hooks.profiler",
}

# Names ftrain.hooks exported before issue 21: internals and the sinks' own package.
_MOVED = {
    "EVERY_MICRO_BATCH": "ftrain.hooks.cadence",
    "PRIORITIES": "ftrain.hooks.base",
    "HookPlan": "ftrain.hooks.base",
    "get_priority": "ftrain.hooks.base",
    "Hooks": "ftrain.hooks.base",
    "ConsoleSink": "ftrain.hooks.sinks",
    "JsonlSink": "ftrain.hooks.sinks",
    "TensorBoardSink": "ftrain.hooks.sinks",
}


def __getattr__(name: str):
    """Hooks that pull in more imports load on first use (keeps ``import ftrain`` light)."""
    if name in LAZY:
        import importlib

        value = getattr(importlib.import_module(LAZY[name]), name)
        globals()[name] = value
        return value
    raise moved("ftrain.hooks", name, _MOVED)
