"""The sink protocol: where :class:`~ftrain.hooks.logging.LoggerHook`'s rows go, and how each
sink is told where a run (re)starts.

A sink needs ``write(step, scalars)`` and ``close()``. Before the first row of every run (a
fresh start, a resume from a checkpoint, a loop run again in the same process) the logger
calls its ``start(at)`` with a :class:`Start`: the update the run continues from and, for a
resume, what the sink had written when the checkpoint was saved (:meth:`SinkBase.mark`).
A sink then drops (or does not write again) every row written after that point, so a run
stopped anywhere and resumed leaves the same rows as one that never stopped.

Optional methods (:class:`SinkBase` has them all; a plain object may define any):
``start(at)``, ``write_eval(step, scalars)`` (an evaluation's row; default ``write``),
``log_config(config)`` (once per run), ``mark()`` (a small JSON value saved in each
checkpoint and handed back as ``at.mark``), ``flush()`` (before a checkpoint and at a
pause), ``close(status=...)`` (``"FINISHED"``, ``"FAILED"``, ``"KILLED"``) and the attribute
``takes_partial_rows`` (``False``: the row of an interrupted log interval is not written).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch

    from ftrain.run import Run

__all__ = [
    "Sink",
    "SinkBase",
    "Start",
    "Row",
    "as_sink",
    "close_all",
    "run_config",
    "flatten_config",
    "file_path",
    "write_failed",
]

PathLike = str | os.PathLike
Scalars = dict[str, float]


@attrs.frozen
class Row:
    """One logged row: the ``step`` (optimizer updates done), its ``scalars``, ``kind``
    (``"train"``: a log interval's means, ``"eval"``: an evaluation) and the Unix ``time``."""

    step: int
    scalars: Mapping[str, float]
    kind: str = "train"
    time: float = 0.0


@attrs.frozen
class Start:
    """Where a run (re)starts, as :meth:`SinkBase.start` hears it.

    Attributes:
        step, epoch: updates done and the epoch when the run (re)starts.
        resumed_from: the checkpoint file it resumed from (``None``: not resumed from one).
        continued: the same loop runs again in this process (after Ctrl-C, an error, a close).
        mark: this sink's :meth:`~SinkBase.mark` when that checkpoint was saved (``None``:
            unknown: a fresh start, or a checkpoint of an older ftrain).
        rows: the rows logged at ``step`` before the checkpoint was saved (a sink that can only
            cut whole steps, such as TensorBoard, writes them again).
        message: the line the run says as it starts ("resumed from iter_400.pth (update 400,
            epoch 3)", "starting fresh"); the console prints it.

    Example:
        >>> Start().fresh, Start(step=4, resumed_from="iter_4.pth").fresh
        (True, False)
    """

    step: int = 0
    epoch: int = 0
    resumed_from: str | None = None
    continued: bool = False
    mark: Any = None
    rows: tuple[Row, ...] = ()
    message: str = ""

    @property
    def fresh(self) -> bool:
        """Whether the run starts from step 0 (nothing written before counts)."""
        return self.resumed_from is None and not self.continued


@runtime_checkable
class Sink(Protocol):
    """What a sink must have: ``write(step, scalars)`` and ``close()``::

        class PrintSink:
            def write(self, step: int, scalars: dict[str, float]) -> None:
                print(step, scalars)
            def close(self) -> None:
                pass

        LoggerHook(sinks=[PrintSink()])

    More (``start``, ``write_eval``, ``mark``...): see :class:`SinkBase`.
    """

    def write(self, step: int, scalars: Scalars) -> None: ...

    def close(self) -> None: ...


class SinkBase:
    """The whole sink interface, each method a no-op (``write_eval``: ``write``); the built-in
    sinks subclass it, and a sink of yours may too.

    Example:
        >>> class Rows(SinkBase):
        ...     def __init__(self): self.rows = []
        ...     def start(self, at): self.rows = [r for r in self.rows if r[0] <= at.step]
        ...     def write(self, step, scalars): self.rows.append((step, dict(scalars)))
        >>> sink = Rows(); sink.write(2, {"loss": 1.0}); sink.write(4, {"loss": 0.5})
        >>> sink.start(Start(step=2, resumed_from="iter_2.pth")); sink.rows
        [(2, {'loss': 1.0})]
    """

    #: Whether the row of an interrupted log interval is written (a resumed run's ``start``
    #: removes it); ``False`` for stores that cannot take a row back (MLflow, W&B).
    takes_partial_rows: bool = True

    def start(self, at: Start) -> None:
        """The run (re)starts at ``at``: drop what was written after it."""

    def write(self, step: int, scalars: Scalars) -> None:
        """A log interval's row."""
        raise NotImplementedError

    def write_eval(self, step: int, scalars: Scalars, *, best: Sequence[str] = ()) -> None:
        """An evaluation's row (``best``: its tags that are a new best)."""
        self.write(step, scalars)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's configuration (:func:`run_config`), once per run."""

    def mark(self) -> Any:
        """What has been written, as a small JSON value kept in each checkpoint."""
        return None

    def flush(self) -> None:
        """Put what is held on disk (before a checkpoint is saved, and at a pause)."""

    def close(self, status: str = "FINISHED") -> None:
        """The run ended: ``"FINISHED"``, ``"FAILED"`` (an error) or ``"KILLED"``."""


@runtime_checkable
class _Starts(Protocol):
    def start(self, at: Start) -> None: ...


@runtime_checkable
class _WritesEvals(Protocol):
    def write_eval(self, step: int, scalars: Scalars) -> None: ...


@runtime_checkable
class _TakesConfig(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None: ...


@runtime_checkable
class _Marks(Protocol):
    def mark(self) -> Any: ...


@runtime_checkable
class _Flushes(Protocol):
    def flush(self) -> None: ...


@runtime_checkable
class _PartialRows(Protocol):
    takes_partial_rows: bool


def _takes_status(close: Any) -> bool:
    with contextlib.suppress(TypeError, ValueError):
        return "status" in inspect.signature(close).parameters
    return False


class _Adapted(SinkBase):
    """A sink object with only some of :class:`SinkBase`'s methods, given the rest."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.takes_partial_rows = bool(
            sink.takes_partial_rows if isinstance(sink, _PartialRows) else True
        )
        self._status = _takes_status(sink.close)

    def __repr__(self) -> str:
        return repr(self.sink)

    def start(self, at: Start) -> None:
        if isinstance(self.sink, _Starts):
            self.sink.start(at)

    def write(self, step: int, scalars: Scalars) -> None:
        self.sink.write(step, scalars)

    def write_eval(self, step: int, scalars: Scalars, *, best: Sequence[str] = ()) -> None:
        if isinstance(self.sink, _WritesEvals):
            self.sink.write_eval(step, scalars)
        else:
            self.sink.write(step, scalars)

    def log_config(self, config: Mapping[str, Any]) -> None:
        if isinstance(self.sink, _TakesConfig):
            self.sink.log_config(config)

    def mark(self) -> Any:
        return self.sink.mark() if isinstance(self.sink, _Marks) else None

    def flush(self) -> None:
        if isinstance(self.sink, _Flushes):
            self.sink.flush()

    def close(self, status: str = "FINISHED") -> None:
        if self._status:
            self.sink.close(status=status)
        else:
            self.sink.close()


def check_sink(sink: Any, who: str = "LoggerHook") -> None:
    """Raise ``TypeError`` unless ``sink`` has ``write(step, scalars)`` and ``close()``."""
    if not isinstance(sink, (SinkBase, Sink)):
        raise TypeError(
            f"{who}: a sink needs write(step, scalars) and close() methods (see "
            f"ftrain.hooks.sinks.SinkBase), got {sink!r}."
        )


def as_sink(sink: Any) -> SinkBase:
    """``sink`` with the whole :class:`SinkBase` interface (a plain object is wrapped).

    Example:
        >>> class Plain:
        ...     def write(self, step, scalars): print(step, scalars)
        ...     def close(self): pass
        >>> s = as_sink(Plain()); s.start(Start()); s.write_eval(3, {"val/acc": 0.5}); s.mark()
        3 {'val/acc': 0.5}
    """
    check_sink(sink)
    return sink if isinstance(sink, SinkBase) else _Adapted(sink)


def close_all(sinks: Iterable[SinkBase], outcome: str = "FINISHED") -> None:
    """Close every sink with ``outcome``; a failure to close is a warning, not an error."""
    if sys.is_finalizing():  # at interpreter shutdown writer threads are gone: a flush hangs
        return
    for sink in sinks:
        try:
            sink.close(outcome)
        except Exception as exc:
            warnings.warn(f"LoggerHook: closing {sink!r} failed: {exc!r}", stacklevel=2)


# ------------------------------------------------------------------ files
def file_path(path: Any, who: str, default_name: str) -> Path:
    """``path`` as a file a sink may write: an error naming ``who`` and the fix when it is a
    directory or not a path at all.

    Example:
        >>> import tempfile
        >>> file_path(tempfile.mkdtemp(), "CsvSink(path)", "metrics.csv")
        Traceback (most recent call last):
        ...
        ValueError: CsvSink(path): ... is a directory, not a file; pass a file in it, e.g. .../metrics.csv.
    """
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"{who} must be the path of a file, got {path!r}.")
    p = Path(path)
    if p.is_dir():
        raise ValueError(
            f"{who}: {p} is a directory, not a file; pass a file in it, e.g. {p / default_name}."
        )
    return p


def write_failed(exc: OSError, path: Path | str, fix: str) -> OSError:
    """The error for a failed write to ``path`` (a full disk...): the file, the cause, the fix.

    Example:
        >>> import errno
        >>> str(write_failed(OSError(errno.ENOSPC, "No space left on device"), "m.jsonl", "x"))
        '[Errno 28] writing m.jsonl failed: No space left on device. Free space on that disk, or x; resume="auto" then continues the run from its last checkpoint.'
    """
    cause = exc.strerror or str(exc)
    return OSError(
        exc.errno,
        f"writing {path} failed: {cause}. Free space on that disk, or {fix}; "
        'resume="auto" then continues the run from its last checkpoint.',
    )


# ----------------------------------------------------------------- config
def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level, keys joined with ``.``; non-simple values as ``repr``.

    Example:
        >>> flatten_config({"optim": {"lr": 0.1, "betas": (0.9, 0.99)}, "epochs": 3})
        {'optim.lr': 0.1, 'optim.betas': '(0.9, 0.99)', 'epochs': 3}
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_config(value, name + "."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = repr(value)
    return out


def _optimizer_config(optimizer: torch.optim.Optimizer, name: str = "") -> dict[str, Any]:
    """``optimizer`` (its class, defaults, group count) as ``optimizer.*`` keys; one of a
    state's several optimizers as ``optimizer.<name>.*``."""
    head = f"optimizer.{name}" if name else "optimizer"
    config: dict[str, Any] = {head: type(optimizer).__name__}
    for key, value in optimizer.defaults.items():
        if key not in ("params", "differentiable", "foreach", "fused", "capturable"):
            config[f"{head}.{key}"] = value
    config[f"{head}.param_groups"] = len(optimizer.param_groups)
    return config


def run_config(loop: Run, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run's flat configuration: its length, step, model, optimizer; then ``extra``.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> lp = ftrain.Loop(ftrain.make_step(lambda m, b: m(b).sum()), state, [], max_steps=3)
        >>> cfg = run_config(lp, {"seed": 0})
        >>> cfg["max_steps"], cfg["optimizer"], cfg["optimizer.lr"], cfg["seed"]
        (3, 'SGD', 0.1, 0)
    """
    from ftrain import dist

    config: dict[str, Any] = {
        "max_steps": loop.max_steps,
        "epochs": loop.epochs,
        "work_dir": None if loop.work_dir is None else str(loop.work_dir),
        "step": repr(loop.step),
    }
    model, several = loop.state.model, loop.state.optimizers
    if model is not None:
        params = list(model.parameters())
        config["model"] = type(model).__name__
        config["params"] = sum(p.numel() for p in params)
        config["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    if several:  # a state with several optimizers (a GAN's): each under its name
        for name, optimizer in several.items():
            config.update(_optimizer_config(optimizer, name))
    elif loop.state.optimizer is not None:
        config.update(_optimizer_config(loop.state.optimizer))
    config["world_size"] = dist.world_size()
    if extra:
        config.update(extra)
    return flatten_config(config)
