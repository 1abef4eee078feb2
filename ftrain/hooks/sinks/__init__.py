"""Where :class:`~ftrain.hooks.logging.LoggerHook` writes: every built-in sink, one protocol.

:data:`SINKS` lists them: the console, JSONL and TensorBoard (on by default:
``LoggerHook(console=, jsonl=, tensorboard=)``), and CSV, MLflow and W&B (by name,
``LoggerHook(sinks=["csv", "mlflow", "wandb"])``, made in the run's ``work_dir``, or as
objects)::

    LoggerHook(every=50, sinks=[CsvSink("runs/a/metrics.csv"),
                                MLflowSink("runs/a/mlruns", experiment="a"),
                                WandbSink(project="a", dir="runs/a", mode="offline")])

Each is a :class:`~ftrain.hooks.sinks.base.SinkBase` (``write``, ``write_eval``, ``close``,
``start``, ``mark``...; the protocol is in :mod:`ftrain.hooks.sinks.base`): before a run's
first row the logger tells every sink, built-in or yours, where the run (re)starts, and no
resume leaves a row twice or a torn row behind. MLflow (``pip install 'ftrain[mlflow]'``)
and W&B (``'ftrain[wandb]'``) are imported when their sink is made.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from ftrain.hooks.sinks.base import (
    Row,
    Sink,
    SinkBase,
    Start,
    as_sink,
    close_all,
    flatten_config,
    run_config,
)
from ftrain.hooks.sinks.console import ConsoleSink
from ftrain.hooks.sinks.files import CsvSink, JsonlSink
from ftrain.hooks.sinks.tensorboard import TensorBoardSink
from ftrain.hooks.sinks.trackers import MLflowSink, WandbSink

__all__ = [
    "SINKS",
    "Builtin",
    "Sink",
    "SinkBase",
    "Start",
    "Row",
    "ConsoleSink",
    "JsonlSink",
    "TensorBoardSink",
    "CsvSink",
    "MLflowSink",
    "WandbSink",
    "make_sink",
    "check_sink_name",
    "as_sink",
    "close_all",
    "run_config",
    "flatten_config",
]


@attrs.frozen
class Builtin:
    """A built-in sink: its ``name`` (``LoggerHook(sinks=[name])``), class, where it writes in
    ``work_dir`` and whether a ``LoggerHook`` has it unless told otherwise."""

    name: str
    cls: type[SinkBase]
    where: str
    default: bool
    make: Callable[[Path], SinkBase] | None = None


#: Every built-in sink. ``console``, ``jsonl`` and ``tensorboard`` are on by default (the
#: files when the run has a ``work_dir``); the others by name in ``LoggerHook(sinks=[...])``.
SINKS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("console", ConsoleSink, "", True),
        Builtin("jsonl", JsonlSink, "metrics.jsonl", True, lambda d: JsonlSink(d / "metrics.jsonl")),
        Builtin("tensorboard", TensorBoardSink, "tb", True, lambda d: TensorBoardSink(d / "tb")),
        Builtin("csv", CsvSink, "metrics.csv", False, lambda d: CsvSink(d / "metrics.csv")),
        Builtin(
            "mlflow", MLflowSink, "mlruns", False,
            lambda d: MLflowSink(d / "mlruns", experiment=d.name or "ftrain"),
        ),
        Builtin(
            "wandb", WandbSink, "wandb", False,
            lambda d: WandbSink(project=d.name or "ftrain", dir=d),
        ),
    )
}  # fmt: skip


def check_sink_name(name: str) -> None:
    """Raise for a name that is not in :data:`SINKS`.

    Example:
        >>> check_sink_name("ftp")
        Traceback (most recent call last):
        ...
        ValueError: LoggerHook: unknown sink 'ftp'; the named sinks are 'console', 'jsonl', 'tensorboard', 'csv', 'mlflow', 'wandb' (or pass a sink object).
    """
    if name not in SINKS:
        names = ", ".join(repr(n) for n in SINKS)
        raise ValueError(
            f"LoggerHook: unknown sink {name!r}; the named sinks are {names} (or pass a sink "
            "object)."
        )


def make_sink(name: str, work_dir: Path | None) -> SinkBase:
    """The file sink ``name`` of :data:`SINKS`, made in ``work_dir``.

    Example:
        >>> make_sink("csv", None)
        Traceback (most recent call last):
        ...
        ValueError: LoggerHook(sinks=['csv']) needs a directory: pass work_dir= to ftrain.Loop, or a sink object such as CsvSink(path).
    """
    check_sink_name(name)
    builtin = SINKS[name]
    if work_dir is None or builtin.make is None:
        raise ValueError(
            f"LoggerHook(sinks=[{name!r}]) needs a directory: pass work_dir= to ftrain.Loop, "
            f"or a sink object such as {builtin.cls.__name__}(path)."
        )
    return builtin.make(Path(work_dir))
