"""Hooks: ordered generators over the iteration stream (see :mod:`ftrain.hooks.base`)."""

from ftrain.hooks.base import (
    PRIORITIES,
    Hook,
    HookPlan,
    Hooks,
    every,
    get_priority,
    hook,
    on,
    once,
    resolve_hooks,
)
from ftrain.hooks.cadence import EVERY_MICRO_BATCH, Every
from ftrain.hooks.checkpoint import AutoCheckpointHook, BestCheckpointHook, CheckpointHook
from ftrain.hooks.defaults import default_hooks
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.sinks import ConsoleSink, JsonlSink, TensorBoardSink
from ftrain.hooks.timer import TimerHook

__all__ = [
    "Every",
    "EVERY_MICRO_BATCH",
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
    "default_hooks",
    "CheckpointHook",
    "BestCheckpointHook",
    "AutoCheckpointHook",
    "LoggerHook",
    "TimerHook",
    "ConsoleSink",
    "JsonlSink",
    "TensorBoardSink",
    "EvalHook",
    "EmptyCacheHook",
    "EarlyStoppingHook",
    "ProfilerHook",
]

LAZY = {  # names loaded on first use (ftrain/__init__.py re-exports them lazily too)
    "EvalHook": "ftrain.hooks.evaluation",
    "EmptyCacheHook": "ftrain.hooks.misc",
    "EarlyStoppingHook": "ftrain.hooks.misc",
    "ProfilerHook": "ftrain.hooks.profiler",
}


def __getattr__(name: str):
    """Hooks that pull in more imports load on first use (keeps ``import ftrain`` light)."""
    if name in LAZY:
        import importlib

        value = getattr(importlib.import_module(LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ftrain.hooks' has no attribute {name!r}")
