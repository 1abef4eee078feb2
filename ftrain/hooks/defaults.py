"""The hooks a run gets when it lists none."""

from __future__ import annotations

from typing import Any

from ftrain._checks import flag
from ftrain.hooks.base import Hooks
from ftrain.hooks.checkpoint import AutoCheckpointHook, CheckpointHook

__all__ = ["default_hooks"]


def default_hooks(
    *,
    log_every: int = 50,
    checkpoint_every: int = 1000,
    max_keep: int | None = 3,
    progress: bool = True,
    summary: bool = True,
    **logger_kwargs: Any,
) -> Hooks:
    """Timer, logger (``logger_kwargs`` go to it; it prints a model summary at the start
    unless ``summary=False``), periodic checkpoint and save-on-interrupt (both active when
    the run has a ``work_dir``). Replace or drop one in one line:
    ``default_hooks().replace("checkpoint", CheckpointHook(500))``, ``.drop("logger")``.

    Example:
        >>> import ftrain
        >>> ftrain.default_hooks().names()
        ['timer', 'logger', 'checkpoint', 'auto_checkpoint']
    """
    from ftrain.hooks.logging import LoggerHook
    from ftrain.hooks.timer import TimerHook

    flag("default_hooks: progress", progress)
    flag("default_hooks: summary", summary)

    return Hooks(
        [
            TimerHook(),
            LoggerHook(every=log_every, progress=progress, summary=summary, **logger_kwargs),
            CheckpointHook(checkpoint_every, max_keep=max_keep, optional=True),
            AutoCheckpointHook(optional=True),
        ]
    )
