"""The logger hook (MMEngine's ``LoggerHook``, detectron2's ``PeriodicWriter``) and its sinks:
console (progress bar or lines), JSONL, TensorBoard; more in :mod:`ftrain.hooks.sinks`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import orjson
import torch

from ftrain import dist as _dist
from ftrain._checks import flag, whole
from ftrain.events import EpochEnd, Evaluated, Event, Paused, RunBegin, RunEnd, RunTotals, StepEnd
from ftrain.hooks.cadence import Every
from ftrain.hooks.monitor import Throughput, memory_stats, model_device
from ftrain.hooks.sinks import FileSink, PathLike, check_sink_name, make_sink, run_config
from ftrain.hooks.timer import TimerHook, format_seconds

if TYPE_CHECKING:
    from ftrain.run import Run
    from ftrain.state import TrainState

__all__ = ["LoggerHook", "Sink", "ConsoleSink", "JsonlSink", "TensorBoardSink", "learning_rates"]

Sums = dict[str, tuple[float, int]]  # per metric: (sum, count)


@runtime_checkable
class Sink(Protocol):
    """Where logged scalars go: ``write(step, scalars)`` then ``close()``::

        class PrintSink:
            def write(self, step: int, scalars: dict[str, float]) -> None:
                print(step, scalars)
            def close(self) -> None:
                pass

        hooks = ftrain.default_hooks().replace("logger", LoggerHook(sinks=[PrintSink()]))

    A sink may also define ``write_eval(step, scalars)`` for evaluation
    results (otherwise those go to ``write`` as well), ``log_config(config)``,
    and ``close(status=...)`` to hear how the run ended: ``"FINISHED"``,
    ``"FAILED"`` (an error) or ``"KILLED"`` (an interruption).
    """

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``lr`` of param group 0, plus ``lr_min``/``lr_max`` when the groups differ.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        >>> opt = torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.01}], lr=0.1)
        >>> learning_rates(opt)
        {'lr': 0.1, 'lr_min': 0.01, 'lr_max': 0.1}
    """
    lrs = [float(g["lr"]) for g in optimizer.param_groups if "lr" in g]
    if not lrs:
        return {}
    out = {"lr": lrs[0]}
    lo, hi = min(lrs), max(lrs)
    if lo != hi:
        out["lr_min"], out["lr_max"] = lo, hi
    return out


def _number(value: Any) -> float | None:
    """A float from a number or a one-element tensor; ``None`` otherwise."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) else None


def _format_value(key: str, value: float) -> str:
    if key in ("eta", "elapsed"):
        return format_seconds(value)
    if key.endswith("_mib") and value == value:
        return f"{value:.0f}MiB"
    if (key.endswith("_per_s") or key.endswith("/s")) and value == value and abs(value) >= 100:
        return f"{value:.0f}"
    if key in ("step", "epoch") and float(value).is_integer():
        return str(int(value))
    if value != value or value in (math.inf, -math.inf):
        return str(value)
    if value == 0:
        return "0"
    mag = abs(value)
    if key.startswith("lr") or mag < 1e-3 or mag >= 1e5:
        return f"{value:.3e}"
    return f"{value:.4f}" if mag < 100 else f"{value:.2f}"


def format_line(step: int, scalars: dict[str, float], total: int | None = None) -> str:
    """One human-readable log line.

    Example:
        >>> format_line(20, {"epoch": 0, "loss": 0.12345, "lr": 0.1, "eta": 75.0}, total=100)
        'step 20/100  epoch 0  loss 0.1235  lr 1.000e-01  eta 0:01:15'
    """
    head = f"step {step}" + (f"/{total}" if total else "")
    parts = [f"{k} {_format_value(k, v)}" for k, v in scalars.items()]
    return "  ".join([head, *parts])


# ------------------------------------------------------------------- sinks
_OFF = ("", "0", "false", "no", "off")  # TQDM_DISABLE values that leave the bar on


def _bar_can_show() -> bool:
    """A bar redraws in place: only in Jupyter or on a terminal, never into a pipe or CI log."""
    ip = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if type(ip).__name__ == "ZMQInteractiveShell":  # a Jupyter kernel
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class ConsoleSink:
    """Console output: a progress bar (``tqdm.auto``: a widget in Jupyter) or lines.

    The bar advances at log time only (updates out of ``max_steps``, else batches
    out of ``epochs x len(data)``). With ``progress=False`` or ``TQDM_DISABLE``
    set, each log is one printed line.

    Example:
        >>> sink = ConsoleSink(progress=False)
        >>> sink.write(10, {"loss": 0.5})
        step 10  loss 0.5000
        >>> sink.close()
    """

    #: Tags a line leaves out unless ``keys`` names them (the file sinks have them all).
    HIDDEN: tuple[str, ...] = ("data_time", "iter_time", "compute_time", "elapsed", "memory/")

    def __init__(
        self,
        loop: Run | None = None,
        *,
        progress: bool = True,
        desc: str | None = None,
        bar_format: str | None = None,
        postfix: Sequence[str] = ("loss", "lr"),
        keys: Sequence[str] | None = None,
        epoch_end: bool = False,
        bar_kwargs: dict[str, Any] | None = None,
    ) -> None:
        flag("ConsoleSink: progress", progress)
        flag("ConsoleSink: epoch_end", epoch_end)
        self.loop = loop
        self.total, self.unit = self._extent(loop)
        self.bar: Any = None
        self.postfix = tuple(postfix)
        self.keys = None if keys is None else tuple(keys)
        self.epoch_end = epoch_end
        env_off = os.environ.get("TQDM_DISABLE", "").strip().lower() not in _OFF
        if progress and not env_off and _bar_can_show():
            from tqdm.auto import tqdm  # lazily: only runs that show a bar pay for it

            self.bar = tqdm(
                total=self.total,
                initial=self._position(),
                unit=self.unit,
                desc=desc or "train",
                dynamic_ncols=True,
                disable=False,  # the environment was checked above, when the run started
                **({} if bar_format is None else {"bar_format": bar_format}),
                **(bar_kwargs or {}),
            )

    #: Shorter labels for a console line.
    LABELS: dict[str, str] = {
        "perf/samples_per_s": "samples/s",
        "perf/tokens_per_s": "tokens/s",
        "perf/tflops": "TFLOP/s",
        "perf/mfu": "mfu",
        "perf/ckpt_blocked_s": "ckpt blocked s",
        "perf/ckpt_waited_s": "ckpt waited s",
    }

    def _shown(self, scalars: dict[str, float]) -> dict[str, float]:
        """The tags a console line shows (``keys``, or all but :attr:`HIDDEN`), labelled."""
        if self.keys is not None:
            kept = {k: v for k, v in scalars.items() if k in self.keys or k == "epoch"}
        else:
            kept = {k: v for k, v in scalars.items() if not k.startswith(self.HIDDEN)}
        return {self.LABELS.get(k, k): v for k, v in kept.items()}

    @staticmethod
    def _extent(loop: Run | None) -> tuple[int | None, str]:
        if loop is None or loop.max_steps is not None:
            return (None if loop is None else loop.max_steps), "step"
        per_epoch = loop.batches_per_epoch
        return (loop.epochs * per_epoch if loop.epochs and per_epoch else None), "batch"

    def _position(self) -> int:
        loop = self.loop
        if loop is None:
            return 0
        state = loop.state
        if self.unit == "step":
            return state.step
        return state.epoch * (loop.batches_per_epoch or 0) + loop.batch_in_epoch

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self.bar is None:
            total = self.total if self.unit == "step" else None
            print(format_line(step, self._shown(scalars), total), flush=True)
            return
        postfix = [f"{k} {_format_value(k, scalars[k])}" for k in self.postfix if k in scalars]
        if postfix:
            self.bar.set_postfix_str("  ".join(postfix), refresh=False)
        if not self._advance():
            self.bar.refresh()

    def _advance(self) -> bool:
        """Move the bar to the run's position; whether it moved."""
        step = self._position() - self.bar.n
        if step > 0:
            self.bar.update(step)
        return step > 0

    def write_eval(self, step: int, scalars: dict[str, float], *, best: Sequence[str] = ()) -> None:
        """An evaluation's line; ``best``: tags that are a new best (marked ``*best``)."""
        line = format_line(step, scalars)
        if best:
            line += "  *best" if len(best) == 1 else f"  *best ({', '.join(best)})"
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self._advance()
            self.bar.close()
            self.bar = None


class JsonlSink(FileSink):
    """One JSON object per log line (orjson): ``{"step", "time", **scalars}``, flushed.

    Appends, so a resumed run continues the file: ``resume_at=size`` cuts it
    back to its size when the checkpoint was written (:attr:`end` then);
    failing that, ``purge_after=step`` drops lines with a larger step (like
    TensorBoard's ``purge_step``); a killed run's torn last line is cut.

    Example:
        >>> import tempfile, pathlib, orjson
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> sink = JsonlSink(path)
        >>> sink.write(5, {"epoch": 0, "loss": 0.25}); sink.close()
        >>> orjson.loads(path.read_bytes().splitlines()[0])["loss"]
        0.25
    """

    def __init__(
        self, path: PathLike, *, purge_after: int | None = None, resume_at: int | None = None
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            if resume_at is not None and self.path.stat().st_size >= resume_at:
                os.truncate(self.path, resume_at)
            elif purge_after is not None:
                self._purge(purge_after)
            else:
                self._drop_torn_tail()
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    @property
    def end(self) -> int:
        """The file's size after the last write: where a run resumed from now continues."""
        return self._file.tell()

    def _drop_torn_tail(self) -> None:
        """Cut a last line without its newline (a killed run's half write)."""
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # 0: a single torn line
        if end != len(data):
            os.truncate(self.path, end)

    def _purge(self, after: int) -> None:
        lines = self.path.read_bytes().splitlines()
        kept = []
        for line in lines:
            try:
                step = orjson.loads(line).get("step")
            except (orjson.JSONDecodeError, AttributeError):
                continue  # a torn last line from a killed run
            if not (isinstance(step, int) and step > after):
                kept.append(line)
        if len(kept) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in kept))
            os.replace(tmp, self.path)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **scalars}
        self._file.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        self._file.flush()


class TensorBoardSink:
    """Scalars into TensorBoard event files (imported when the sink is created).

    ``purge_step`` hides what an interrupted run wrote from that step on. Logs are
    written in one batch every ``flush_secs`` and on ``close()`` (the writer's
    checksums, fed one log at a time, held the GIL: a 110 us step cost 12 us more).

    Example:
        >>> import tempfile
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.write(1, {"loss": 0.5}); sink.close()
    """

    def __init__(
        self, log_dir: PathLike, *, purge_step: int | None = None, flush_secs: float = 10
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter  # slow import: only here

        self.log_dir = Path(log_dir)
        self.flush_secs = flush_secs
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=purge_step, flush_secs=flush_secs
        )
        try:  # one event per log (add_scalar makes one per scalar: ~50 us each)
            from tensorboard.compat.proto.summary_pb2 import Summary

            self._summary: Any = Summary
            self._file_writer: Any = self.writer._get_file_writer()
        except (ImportError, AttributeError):  # pragma: no cover - other tensorboard versions
            self._summary = self._file_writer = None
        self._pending: list[tuple[int, float, list[tuple[str, float]]]] = []
        self._written = time.monotonic()

    def write(self, step: int, scalars: dict[str, float]) -> None:
        items = [(k, float(v)) for k, v in scalars.items() if k != "epoch"]
        self._pending.append((step, time.time(), items))
        if time.monotonic() - self._written >= self.flush_secs:
            self.flush()

    def log_config(self, config: dict[str, Any]) -> None:
        """The run's config as a text summary ``config`` (a Markdown table)."""
        rows = "\n".join(f"| {k} | {v} |" for k, v in config.items())
        self.writer.add_text("config", "| name | value |\n|---|---|\n" + rows, 0)

    def flush(self) -> None:
        """Write the held logs and flush the file."""
        pending, self._pending = self._pending, []
        for step, wall_time, items in pending:
            if self._file_writer is not None:
                value = self._summary.Value
                summary = self._summary(value=[value(tag=k, simple_value=v) for k, v in items])
                self._file_writer.add_summary(summary, step, wall_time)
            else:  # pragma: no cover
                for k, v in items:
                    self.writer.add_scalar(k, v, step, wall_time)
        self.writer.flush()
        self._written = time.monotonic()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.writer.close()


# ------------------------------------------------------------------ the hook
#: How timing scalars combine over the ranks (the rest: the mean).
_RANK_OPS = {
    **dict.fromkeys(
        ("elapsed", "eta", "memory/max_allocated_mib", "memory/max_reserved_mib"), "max"
    ),
    "memory/rss_peak_mib": "max",
    # a save holds every rank up to the slowest one's
    **dict.fromkeys(("perf/ckpt_blocked_s", "perf/ckpt_waited_s"), "max"),
    # the whole job's throughput
    **dict.fromkeys(("perf/samples_per_s", "perf/tokens_per_s", "perf/tflops"), "sum"),
}


def _weighted_loss(scalars: dict[str, float]) -> None:
    """A summed loss (``SummedLoss``): log ``loss_sum / loss_count``, the item-weighted mean."""
    count = scalars.pop("loss_count", None)
    total = scalars.pop("loss_sum", None)
    if count is not None and total is not None and count > 0:
        scalars["loss"] = total / count


def _val_key(key: str) -> str:
    """``val/`` before an evaluation key, unless it has a group already (``val_loss``: ``val/loss``)."""
    return key if "/" in key else "val/" + re.sub(r"^val[-_.](?=.)", "", key, flags=re.DOTALL)


def _check_flags(
    progress: object, console: object, summary: object, console_epoch_end: object, epoch_end: object
) -> None:
    """``LoggerHook``'s switches: ``True`` or ``False``."""
    flags = {"progress": progress, "console": console, "summary": summary}
    flags.update(console_epoch_end=console_epoch_end, epoch_end=epoch_end)
    for arg, on in flags.items():
        flag(f"LoggerHook: {arg}", on)


class LoggerHook:
    """Log metrics, learning rate, timing and ETA every ``every`` optimizer updates.

    Also at each epoch's end (file sinks; the console with ``console_epoch_end``),
    at the run's end, and for every :class:`~ftrain.events.Evaluated` event (keys
    prefixed ``val/``; ``val_loss`` becomes ``val/loss``). A log holds each metric's
    mean over every micro-batch of the interval (from ``loop.totals``: nothing per
    step), ``lr``, times and ``eta`` (with a :class:`~ftrain.hooks.timer.TimerHook`),
    ``perf/*``, ``memory/*`` (:mod:`ftrain.hooks.monitor`) and ``epoch``. After a checkpoint
    save, ``perf/ckpt_blocked_s``: the seconds the saves since the last log held training
    (``perf/ckpt_waited_s``: of them, waiting for an earlier write; the slowest rank's).

    Args:
        progress: a progress bar where it can redraw (Jupyter, a terminal), else
            a line per log (pipes, CI); ``False``: always lines.
        jsonl: a JSONL file; ``None``: ``work_dir/metrics.jsonl`` if the run has
            a ``work_dir``; ``True``: the same, required; a path; ``False``: none.
        tensorboard: TensorBoard files, same rules (``work_dir/tb``).
        sinks: more sinks (``write(step, scalars)``/``close()``) or the names
            ``"csv"``, ``"mlflow"``, ``"wandb"`` (:mod:`ftrain.hooks.sinks`).
        config: hyperparameters logged once (with :func:`ftrain.hooks.sinks.run_config`)
            to sinks with ``log_config``.
        throughput: what ``perf/*``/``memory/*`` measure
            (:class:`ftrain.hooks.monitor.Throughput`); ``False``: none.
        bar_format: the bar's ``tqdm`` format. postfix: the tags shown after it.
        console_keys: the tags a console line shows (default: all but
            :attr:`ConsoleSink.HIDDEN`).
        console_epoch_end: also print the epoch-end logs.
        summary: print a :func:`ftrain.summary.model_summary` when a run starts
            (not on resume); its numbers go to the sinks with the config.
        epoch_end: log at epoch ends at all.

    Under ``torch.distributed`` each log is reduced over the ranks
    (:func:`ftrain.dist.reduce_metrics`) and rank 0 alone writes.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> logger = LoggerHook(every=2, progress=False)
        >>> _ = ftrain.Loop(step, state, [torch.zeros(4, 2)] * 4, hooks=[logger], max_steps=2).run()
        step 2/2  loss ...  lr 1.000e-01  epoch 0
    """

    priority = "BELOW_NORMAL"
    name = "logger"

    def __init__(
        self,
        every: int = 50,
        *,
        progress: bool = True,
        console: bool = True,
        jsonl: bool | PathLike | None = None,
        tensorboard: bool | PathLike | None = None,
        sinks: Iterable[Any] = (),
        desc: str | None = None,
        config: Mapping[str, Any] | None = None,
        throughput: Throughput | bool = True,
        bar_format: str | None = None,
        postfix: Sequence[str] = ("loss", "lr"),
        console_keys: Sequence[str] | None = None,
        console_epoch_end: bool = False,
        summary: bool = False,
        epoch_end: bool = True,
    ) -> None:
        whole("LoggerHook: every", every, 1)
        _check_flags(progress, console, summary, console_epoch_end, epoch_end)
        for arg, value in (("jsonl", jsonl), ("tensorboard", tensorboard)):
            if not (value is None or isinstance(value, (bool, str, os.PathLike))):
                raise TypeError(
                    f"LoggerHook: {arg} must be True, False, None (automatic) or a path, "
                    f"got {value!r}."
                )
        extra = list(sinks)
        for s in extra:
            if isinstance(s, str):
                check_sink_name(s)
            elif not (callable(getattr(s, "write", None)) and callable(getattr(s, "close", None))):
                raise TypeError(
                    f"LoggerHook: a sink needs write(step, scalars) and close() methods, got {s!r}."
                )
        self.every = every
        self.progress = progress
        self.console = console
        self.jsonl = jsonl
        self.tensorboard = tensorboard
        self.sinks = extra
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"LoggerHook: config must be a mapping (a dict), got {config!r}.")
        self.config = dict(config) if config is not None else None
        if throughput is True:
            throughput = Throughput()
        if not (throughput is False or isinstance(throughput, Throughput)):
            raise TypeError(
                "LoggerHook: throughput must be a ftrain.hooks.monitor.Throughput, True or "
                f"False, got {throughput!r}."
            )
        self.throughput: Throughput | None = throughput or None
        self._console_args: dict[str, Any] = {"desc": desc, "bar_format": bar_format}
        self._console_args.update(postfix=postfix, keys=console_keys, epoch_end=console_epoch_end)
        self.summary = summary
        self.epoch_end = epoch_end
        #: The ``StepEnd`` of every ``every``-th update (epoch ends and evaluations come anyway).
        self.cadence = Every(steps=every)
        self._timer_mark: tuple[Any, Any] = (None, None)  # (TimerStats, its mark at the last log)
        self._timer: TimerHook | None = None
        self._distributed = False
        # The interval: loop.totals less the sums at the last log (exact resume: a
        # checkpoint saves this mark, and the loop its totals).
        self._totals: RunTotals | None = None
        self._mark: tuple[int, Sums] = (0, {})
        self._jsonl: JsonlSink | None = None
        self._jsonl_end: int | None = None
        self._restored: dict[str, Any] | None = None
        self._batch: Any = None  # the newest batch a log saw (throughput counts)
        self._skipped: tuple[int, dict[str, float], list[Any]] | None = None
        self._best_hooks: list[Any] = []
        self._device: torch.device | None = None

    def __repr__(self) -> str:
        return (
            f"LoggerHook(every={self.every}, progress={self.progress}, jsonl={self.jsonl!r}, "
            f"tensorboard={self.tensorboard!r})"
        )

    #: Each rank's own sums: saved per rank under torch.distributed (reduced at log time).
    local_state_keys = ("window",)

    def state_dict(self) -> dict[str, Any]:
        """Where the interval began in ``loop.totals`` and the JSONL size after the last log,
        so a resumed run writes the same lines, bit for bit, as one that never stopped."""
        totals, (n0, mark) = self._totals, self._mark
        window = None if totals is None else {"at": totals.micro_batches, "n0": n0, "mark": mark}
        return {"window": window, "jsonl_end": self._jsonl_end}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._restored = dict(saved)

    def _begin(self, totals: RunTotals, window: dict[str, Any] | None) -> None:
        """Start the interval at ``totals`` now, or continue a saved ``window``."""
        self._totals = totals
        if window and window.get("at") == totals.micro_batches:  # the totals it was taken at
            self._mark = (window["n0"], {k: tuple(v) for k, v in window["mark"].items()})
            return
        n, sums = 0, {}
        if window and "keys" in window:  # saved by ftrain 0.1.0 (a MetricWindow), no totals
            folded, counts, n = window["totals"], window["counts"], int(window["n"])
            sums = {
                k: (float(v) + folded.get(k, 0.0), counts[k]) for k, v in window["sums"].items()
            }
        mark = dict(totals.metric_sums())
        for key, (s, c) in sums.items():
            s0, c0 = mark.get(key, (0.0, 0))
            mark[key] = (s0 - s, c0 - c)
        self._mark = (totals.micro_batches - n, mark)

    def _pending(self) -> bool:
        """Whether a micro-batch ran since the last log."""
        return self._totals is not None and self._totals.micro_batches > self._mark[0]

    def _mark_logged(self) -> None:
        """A complete log was written: a checkpoint taken now resumes after it."""
        if self._jsonl is not None:
            self._jsonl_end = self._jsonl.end

    @staticmethod
    def _file_target(value: Any, loop: Run, default: str, arg: str) -> Path | None:
        work_dir = loop.log_dir  # work_dir (a store's: its local copy, uploaded)
        if value is True and work_dir is None:
            raise ValueError(
                f"LoggerHook({arg}=True) needs a directory: pass work_dir= to "
                f"ftrain.Loop, or a path as {arg}=."
            )
        if value is False or (value is None and work_dir is None):
            return None
        if value is None or value is True:
            return Path(work_dir) / default
        # relative paths are inside the run's work_dir (joining keeps an absolute path as it is)
        return Path(value) if work_dir is None else Path(work_dir) / value

    def _open_sinks(self, loop: Run, restored: dict[str, Any] | None) -> list[Any]:
        resumed = restored is not None or loop.resumed_from is not None
        purge = loop.state.step if resumed else None
        resume_at = restored.get("jsonl_end") if restored else None
        sinks: list[Any] = []
        try:
            if self.console:
                sinks.append(ConsoleSink(loop, progress=self.progress, **self._console_args))
            path = self._file_target(self.jsonl, loop, "metrics.jsonl", "jsonl")
            if path is not None:
                self._jsonl = JsonlSink(path, purge_after=purge, resume_at=resume_at)
                self._jsonl_end = self._jsonl.end
                sinks.append(self._jsonl)
            tb_dir = self._file_target(self.tensorboard, loop, "tb", "tensorboard")
            if tb_dir is not None:
                try:  # TensorBoard purges steps >= purge_step; the resumed step stays
                    tb_purge = None if purge is None else purge + 1
                    sinks.append(TensorBoardSink(tb_dir, purge_step=tb_purge))
                except ImportError as exc:
                    if self.tensorboard is not None:
                        raise ImportError(
                            "LoggerHook(tensorboard=...) needs the tensorboard package: "
                            "pip install tensorboard"
                        ) from exc
                    warnings.warn(
                        f"LoggerHook: tensorboard is not installed, not writing to {tb_dir} "
                        f"({exc}).",
                        stacklevel=3,
                    )
            for named in self.sinks:
                if isinstance(named, str):
                    sinks.append(make_sink(named, loop, purge_after=purge))
        except BaseException:
            _close_all(sinks)
            raise
        return sinks + [s for s in self.sinks if not isinstance(s, str)]

    def _start(self, loop: Run, sinks: list[Any]) -> None:
        """Once per run (not on resume), on the writing rank: the config and the model summary."""
        takers = [s for s in sinks if callable(getattr(s, "log_config", None))]
        show = self.summary and self.console
        if not (show or takers):
            return
        summary = None
        from ftrain.summary import model_summary

        with contextlib.suppress(Exception):  # a stand-in state without a model
            summary = model_summary(loop.state)
        if takers:
            config = run_config(loop, self.config)
            if summary is not None:
                config.update(summary.config())
            for sink in takers:
                sink.log_config(config)
        if summary is not None and show:
            print(summary, flush=True)

    def _log(
        self,
        loop: Run,
        state: TrainState,
        epoch: int,
        sinks: list[Any],
        interrupted: bool = False,
        *,
        batch: Any = None,
        at_epoch_end: bool = False,
    ) -> None:
        """Write the interval's means; ``interrupted``: a partial interval, kept for a resume
        (this rank's numbers: no collective while a run fails)."""
        totals, mark = self._totals, self._mark[1]
        assert totals is not None
        now = totals.metric_sums()  # one host sync per device
        scalars = {}
        for key, (total, count) in now.items():  # the means since the last log
            s0, c0 = mark.get(key, (0.0, 0))
            if count > c0:
                scalars[key] = (total - s0) / (count - c0)
        means = dict(scalars)
        if not interrupted:
            self._mark = (totals.micro_batches, now)
        with contextlib.suppress(Exception):  # a consumed state (failed step): no lr
            scalars.update(learning_rates(state.optimizer))
        monitor = self.throughput
        if batch is not None and monitor is not None and monitor.needs_batch:
            self._batch = batch  # the newest batch seen, for the throughput's counts
        scalars.update(self._timing(loop, means))
        scalars.update(self._save_times(loop))
        if monitor is not None and monitor.memory:
            scalars.update(memory_stats(self._device))
        if self._distributed and not interrupted:
            scalars = _dist.reduce_metrics(scalars, ops=_RANK_OPS)
        _weighted_loss(scalars)
        scalars["epoch"] = epoch
        skipped = []
        for sink in sinks:
            if at_epoch_end and getattr(sink, "epoch_end", True) is False:
                skipped.append(sink)  # the console skips epoch-end logs unless asked
                continue
            sink.write(state.step, scalars)
        if not interrupted:
            self._mark_logged()
        # the run's last log may be an epoch's end: the console shows it at RunEnd
        self._skipped = (state.step, scalars, skipped) if skipped else None

    def _timing(self, loop: Run, means: dict[str, float]) -> dict[str, float]:
        """The interval's times (the timer's sums less those at the last log), elapsed, ETA
        and throughput; none without a :class:`~ftrain.hooks.timer.TimerHook`."""
        timer = self._timer.stats if self._timer is not None else None
        if timer is None:
            return {}
        scalars: dict[str, float] = {}
        last, mark = self._timer_mark
        now = timer.mark()
        n, _, data, it = (a - b for a, b in zip(now, mark if last is timer else (0, 0, 0, 0)))
        self._timer_mark = (timer, now)
        if n > 0:
            scalars.update(data_time=data / n, iter_time=it / n)
            scalars["compute_time"] = max(it / n - data / n, 0.0)
        scalars["elapsed"] = timer.elapsed
        if (eta := timer.eta) is not None:
            scalars["eta"] = eta
        monitor = self.throughput
        if monitor is not None and n > 0:
            with contextlib.suppress(Exception):  # a consumed state, a failing count
                monitor.prepare(loop, self._batch)
            scalars.update(
                monitor.rates(micro_batches=n, seconds=it, batch=self._batch, means=means)
            )
            if not monitor.needs_batch:
                self._batch = None  # hold no batch (device memory) between logs
        return scalars

    def _save_times(self, loop: Run) -> dict[str, float]:
        """The seconds checkpoint saves held the training thread since the last log, and of
        them, waiting for an earlier write (:class:`~ftrain.persist.savetime.SaveClock`);
        nothing when no save ran."""
        times = loop.checkpointer.times
        last, saves, blocked, waited = self._save_mark
        if last is not times:
            saves, blocked, waited = 0, 0.0, 0.0
        self._save_mark = (times, times.saves, times.blocked_s, times.waited_s)
        if times.saves == saves:
            return {}
        out = {"perf/ckpt_blocked_s": times.blocked_s - blocked}
        if times.waited_s > waited:
            out["perf/ckpt_waited_s"] = times.waited_s - waited
        return out

    def _log_eval(self, ev: Evaluated, sinks: list[Any]) -> None:
        scalars: dict[str, float] = {}
        best: list[str] = []
        for key, value in ev.metrics.items():
            number = _number(value)
            if number is not None:
                scalars[_val_key(key)] = number
                if any(_is_new_best(h, key, number) for h in self._best_hooks):
                    best.append(_val_key(key))
        # no reduction here: EvalHook(reduce=...) owns it (reduce=None keeps each rank's own)
        if not scalars:
            return
        epoch = ev.state.epoch
        if ev.by_epoch and epoch > 0:
            epoch -= 1  # evaluated at an epoch's end: the epoch that ended
        scalars["epoch"] = epoch
        for sink in sinks:
            if isinstance(sink, ConsoleSink):
                sink.write_eval(ev.state.step, scalars, best=best)
            else:
                getattr(sink, "write_eval", sink.write)(ev.state.step, scalars)
        self._mark_logged()

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        sinks = self._setup(first)
        outcome = "FINISHED"  # how the run ended, for sinks that record it (MLflow)
        try:
            yield first
            for ev in events:
                self._handle(ev, loop, sinks)
                yield ev
        except BaseException as exc:
            if isinstance(exc, GeneratorExit):  # closed by the loop: what stopped the run
                exc = exc.__context__  # a later hook's error, or None (a paused run closed)
            outcome = "FAILED" if isinstance(exc, Exception) else "KILLED"
            raise
        finally:
            self._finish(loop, sinks, outcome)

    def _setup(self, first: Event) -> list[Any]:
        """At ``RunBegin``: open the sinks (this rank's), find the timer and the best-keeping
        hooks, and start (or continue) the interval; returns the sinks."""
        loop = first.loop
        restored, self._restored = self._restored, None  # a checkpoint's, when resumed
        if loop.resumed_from is None:
            restored = None
        if isinstance(first, RunBegin) and first.resumed and restored is None:
            restored = self.state_dict()  # the loop iterated again after a stop
        self._jsonl = self._jsonl_end = None
        self._distributed = _dist.world_size() > 1  # a run's processes do not change
        if self._distributed and _dist.rank() != 0:  # it takes part in each log's reduction
            sinks: list[Any] = []
            self._file_target(self.jsonl, loop, "metrics.jsonl", "jsonl")  # same errors
            self._file_target(self.tensorboard, loop, "tb", "tensorboard")  # on every rank
        else:
            sinks = self._open_sinks(loop, restored)
            try:
                if loop.resumed_from is None and not (
                    isinstance(first, RunBegin) and first.resumed
                ):
                    self._start(loop, sinks)  # a run's first RunBegin
            except BaseException:
                _close_all(sinks)
                raise
        # hooks that keep a best value (BestCheckpointHook): evaluation lines mark a new best
        self._best_hooks = loop.hooks.of_type(_KeepsBest)
        self._device = model_device(loop.state)
        self._batch = None
        self._timer = next(iter(loop.hooks.of_type(TimerHook)), None)
        timer = self._timer.stats if self._timer is not None else None
        self._timer_mark = (timer, timer.mark() if timer is not None else None)
        self._save_mark: tuple[Any, int, float, float] = (None, 0, 0.0, 0.0)  # the saves' too
        # the interval the checkpoint (or the stopped iteration) was in
        self._begin(loop.totals, restored.get("window") if restored else None)
        return sinks

    def _handle(self, ev: Event, loop: Run, sinks: list[Any]) -> None:
        """One event: a log at the updates it is due at, an epoch's end, an evaluation..."""
        kind = type(ev)
        if kind is StepEnd:
            if ev.is_update and self.cadence.due(ev.state.step):
                self._log(loop, ev.state, ev.state.epoch, sinks, batch=ev.batch)
        elif kind is EpochEnd:
            if self.epoch_end and self._pending():
                self._log(loop, ev.state, ev.epoch, sinks, at_epoch_end=True)
        elif kind is Evaluated:
            self._log_eval(ev, sinks)
        elif kind is Paused:  # run(steps=...) paused: put everything held on disk
            for sink in sinks:
                if isinstance(sink, _Flushes):
                    sink.flush()
        elif kind is RunEnd:
            if self._pending():
                self._log(loop, ev.state, ev.state.epoch, sinks)
            elif self._skipped is not None:
                step, scalars, skipped = self._skipped
                for sink in skipped:
                    sink.write(step, scalars)
            self._skipped = None

    def _finish(self, loop: Run, sinks: list[Any], outcome: str) -> None:
        if sinks and self._pending():  # interrupted mid-interval: log what there is, if it
            with contextlib.suppress(Exception):  # can be read (no collective on this path)
                # kept in the interval: a checkpoint saved after this holds it, and a
                # resumed run cuts this line and logs the whole interval
                self._log(loop, loop.state, loop.state.epoch, sinks, True)
        self._timer = None
        self._batch = None
        self._best_hooks = []
        self._timer_mark = (None, None)  # hold no loop (nor model) after the run
        self._save_mark = (None, 0, 0.0, 0.0)
        _close_all(sinks, outcome)


@runtime_checkable
class _KeepsBest(Protocol):
    """A hook keeping a best value (:class:`~ftrain.hooks.checkpoint.BestCheckpointHook`)."""

    metric: str

    def is_better(self, value: float) -> bool: ...


@runtime_checkable
class _Flushes(Protocol):
    def flush(self) -> None: ...


def _is_new_best(hook: Any, key: str, value: float) -> bool:
    """Whether ``hook`` (a best-checkpoint hook of lower priority) will take ``value`` as a new best."""
    with contextlib.suppress(Exception):
        return hook.metric == key and bool(hook.is_better(value))
    return False


def _close_all(sinks: Iterable[Any], outcome: str | None = None) -> None:
    """Close every sink (``outcome`` to those whose ``close`` takes ``status``); report failures."""
    if sys.is_finalizing():  # at interpreter shutdown writer threads are gone: a flush hangs
        return
    for sink in sinks:
        try:
            if outcome is not None and _takes_status(sink.close):
                sink.close(status=outcome)
            else:
                sink.close()
        except Exception as exc:
            warnings.warn(f"LoggerHook: closing {sink!r} failed: {exc!r}", stacklevel=2)


def _takes_status(close: Any) -> bool:
    with contextlib.suppress(TypeError, ValueError):
        return "status" in inspect.signature(close).parameters
    return False
