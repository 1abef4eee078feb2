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
    resolve_hooks,
)
from ftrain.hooks.checkpoint import AutoCheckpointHook, BestCheckpointHook, CheckpointHook
from ftrain.hooks.defaults import default_hooks
from ftrain.hooks.logging import ConsoleSink, JsonlSink, LoggerHook, TensorBoardSink
from ftrain.hooks.timer import TimerHook

__all__ = [
    "PRIORITIES",
    "Hook",
    "HookPlan",
    "Hooks",
    "hook",
    "every",
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
]
