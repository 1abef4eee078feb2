"""The logger hook (MMEngine's ``LoggerHook``, detectron2's ``PeriodicWriter``): when to log
and what; where the rows go is :mod:`ftrain.hooks.sinks` (console, JSONL, TensorBoard, CSV,
MLflow, W&B).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import torch

from ftrain import dist as _dist
from ftrain._checks import flag, whole
from ftrain.events import EpochEnd, Evaluated, Event, Paused, RunBegin, RunEnd, RunTotals, StepEnd
from ftrain.hooks.cadence import Every
from ftrain.hooks.monitor import Throughput, memory_stats, model_device
from ftrain.hooks.sinks import (
    SINKS,
    ConsoleSink,
    JsonlSink,
    Row,
    SinkBase,
    Start,
    TensorBoardSink,
    as_sink,
    check_sink_name,
    close_all,
    make_sink,
    run_config,
)
from ftrain.hooks.sinks.base import PathLike, check_sink
from ftrain.hooks.timer import TimerHook

if TYPE_CHECKING:
    from ftrain.run import Run
    from ftrain.state import TrainState

__all__ = ["LoggerHook", "learning_rates"]

Sums = dict[str, tuple[float, int]]  # per metric: (sum, count)
Named = list[tuple[str, SinkBase]]  # the open sinks, each under the key its mark is saved by


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


def state_learning_rates(state: TrainState) -> dict[str, float]:
    """:func:`learning_rates` of the state's optimizer; of each of several optimizers, under
    its name (``lr/gen``, ``lr/disc``).

    Example:
        >>> import torch, ftrain
        >>> g, d = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        >>> model = torch.nn.ModuleDict({"g": g, "d": d})
        >>> opts = {"gen": torch.optim.SGD(g.parameters(), lr=0.1),
        ...         "disc": torch.optim.SGD(d.parameters(), lr=0.2)}
        >>> state_learning_rates(ftrain.TrainState.create(model, opts))
        {'lr/gen': 0.1, 'lr/disc': 0.2}
    """
    several = state.optimizers
    if not several:
        return learning_rates(state.optimizer)
    out: dict[str, float] = {}
    for name, optimizer in several.items():
        out.update((f"{key}/{name}", v) for key, v in learning_rates(optimizer).items())
    return out


def _number(value: Any) -> float | None:
    """A float from a number or a one-element tensor; ``None`` otherwise."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) else None


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


# ------------------------------------------------------------ the arguments
def _file_arg(arg: str, value: Any) -> bool | PathLike | None:
    if not (value is None or isinstance(value, (bool, str, os.PathLike))):
        raise TypeError(
            f"LoggerHook: {arg} must be True, False, None (automatic) or a path, got {value!r}."
        )
    return value


def _tags_arg(arg: str, value: Any, optional: bool) -> tuple[str, ...] | None:
    if value is None and optional:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(
            f"LoggerHook: {arg} must be a list of tag names, e.g. ('loss', 'lr'), got {value!r}."
        )
    tags = tuple(value)
    if not all(isinstance(t, str) for t in tags):
        raise TypeError(f"LoggerHook: {arg} must hold tag names (strings), got {tags!r}.")
    return tags


def _flag_args(**flags: Any) -> None:
    for arg, value in flags.items():
        flag(f"LoggerHook: {arg}", value)


def _text_args(**texts: Any) -> None:
    for arg, value in texts.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"LoggerHook: {arg} must be a string or None, got {value!r}.")


def _sink_args(sinks: Any) -> tuple[list[Any], set[str]]:
    """The sink objects and the names (checked); names of the default sinks turn them on."""
    if isinstance(sinks, str) or not isinstance(sinks, Iterable):
        raise TypeError(
            f"LoggerHook: sinks must be a list of sink names or objects, e.g. ['csv'], "
            f"got {sinks!r}."
        )
    objects, names = [], set()
    for s in sinks:
        if isinstance(s, str):
            check_sink_name(s)
            names.add(s)
        else:
            check_sink(s)
            objects.append(s)
    return objects, names


def _throughput_arg(throughput: Any) -> Throughput | None:
    if throughput is True:
        return Throughput()
    if not (throughput is False or isinstance(throughput, Throughput)):
        raise TypeError(
            "LoggerHook: throughput must be a ftrain.hooks.monitor.Throughput, True or "
            f"False, got {throughput!r}."
        )
    return throughput or None


def _config_arg(config: Any) -> dict[str, Any] | None:
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"LoggerHook: config must be a mapping (a dict), got {config!r}.")
    return None if config is None else dict(config)


def _file_target(value: Any, loop: Run, default: str, arg: str) -> Path | None:
    """Where the ``arg`` file sink writes in this run (``None``: it is off)."""
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


@attrs.define
class _Interval:
    """What the logger keeps between logs; reset at each run's start."""

    totals: RunTotals | None = None
    mark: tuple[int, Sums] = (0, {})  # loop.totals (micro-batches, sums) at the last log
    timer: TimerHook | None = None
    timer_mark: tuple[Any, Any] = (None, None)  # (TimerStats, its mark at the last log)
    save_mark: tuple[Any, int, float, float] = (None, 0, 0.0, 0.0)  # the saves' clock, too
    batch: Any = None  # the newest batch a log saw (throughput counts)
    device: torch.device | None = None
    best_hooks: list[Any] = attrs.Factory(list)
    skipped: tuple[int, dict[str, float], Named] | None = None  # an epoch-end row not shown


class LoggerHook:
    """Log metrics, learning rate, timing and ETA every ``every`` optimizer updates.

    Also at each epoch's end (file sinks; the console with ``console_epoch_end``),
    at the run's end, and for every :class:`~ftrain.events.Evaluated` event (each name
    shown as :func:`ftrain.metric_names.shown_name` says: ``val_loss`` is ``val/loss``).
    A log holds each metric's mean over every micro-batch of the interval (from
    ``loop.totals``: nothing per step), ``lr``, times and ``eta`` (with a
    :class:`~ftrain.hooks.timer.TimerHook`), ``perf/*``, ``memory/*``
    (:mod:`ftrain.hooks.monitor`) and ``epoch``. After a checkpoint save,
    ``perf/ckpt_blocked_s``: the seconds the saves since the last log held training
    (``perf/ckpt_waited_s``: of them, waiting for an earlier write; the slowest rank's).
    When a run starts the console says
    "starting fresh" or "resumed from iter_400.pth (update 400, epoch 3)".

    Args:
        progress: a progress bar where it can redraw (Jupyter, a terminal), else
            a line per log (pipes, CI); ``False``: always lines.
        jsonl: a JSONL file; ``None``: ``work_dir/metrics.jsonl`` if the run has
            a ``work_dir``; ``True``: the same, required; a path; ``False``: none.
        tensorboard: TensorBoard files, same rules (``work_dir/tb``).
        sinks: more sinks (objects with ``write(step, scalars)``/``close()``) or names of
            :data:`ftrain.hooks.sinks.SINKS` (``"csv"``, ``"mlflow"``, ``"wandb"``...).
        config: hyperparameters logged once (with :func:`ftrain.hooks.sinks.base.run_config`)
            to sinks with ``log_config``.
        throughput: what ``perf/*``/``memory/*`` measure
            (:class:`ftrain.hooks.monitor.Throughput`); ``False``: none.
        bar_format: the bar's ``tqdm`` format. postfix: the tags shown after it.
        console_keys: the tags a console line shows (default: all but
            :attr:`ConsoleSink.HIDDEN <ftrain.hooks.sinks.console.ConsoleSink.HIDDEN>`).
        console_epoch_end: also print the epoch-end logs.
        summary: print a :func:`ftrain.summary.model_summary` when a run starts
            (not on resume); its numbers go to the sinks with the config.
        epoch_end: log at epoch ends at all.

    Every sink is told where a run (re)starts (:class:`ftrain.hooks.sinks.base.Start`), so a
    resumed run leaves no row twice. Under ``torch.distributed`` each log is reduced over
    the ranks (:func:`ftrain.dist.reduce_metrics`) and rank 0 alone writes.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> logger = LoggerHook(every=2, progress=False)
        >>> _ = ftrain.Loop(step, state, [torch.zeros(4, 2)] * 4, hooks=[logger], max_steps=2).run()
        starting fresh
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
        self.every = whole("LoggerHook: every", every, 1)
        _flag_args(progress=progress, console=console, console_epoch_end=console_epoch_end,
                   summary=summary, epoch_end=epoch_end)  # fmt: skip
        _text_args(desc=desc, bar_format=bar_format)
        self.sinks, names = _sink_args(sinks)
        self.jsonl = True if "jsonl" in names and jsonl is None else _file_arg("jsonl", jsonl)
        tb = True if "tensorboard" in names and tensorboard is None else tensorboard
        self.tensorboard = _file_arg("tensorboard", tb)
        self.named = [
            n for n in SINKS if n in names and n not in ("console", "jsonl", "tensorboard")
        ]
        self.progress, self.console = progress, console or "console" in names
        self.summary, self.epoch_end = summary, epoch_end
        self.config = _config_arg(config)
        self.throughput: Throughput | None = _throughput_arg(throughput)
        self._console_args: dict[str, Any] = {
            "desc": desc, "bar_format": bar_format, "epoch_end": console_epoch_end,
            "postfix": _tags_arg("postfix", postfix, optional=False),
            "keys": _tags_arg("console_keys", console_keys, optional=True),
        }  # fmt: skip
        #: The ``StepEnd`` of every ``every``-th update (epoch ends and evaluations come anyway).
        self.cadence = Every(steps=every)
        self._iv = _Interval()
        self._distributed = False
        self._open: Named = []  # this run's sinks, while it runs
        self._marks: dict[str, Any] = {}  # each sink's mark after the last complete row
        self._rows: list[Row] = []  # the complete rows logged at the newest logged step
        self._restored: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (
            f"LoggerHook(every={self.every}, progress={self.progress}, jsonl={self.jsonl!r}, "
            f"tensorboard={self.tensorboard!r})"
        )

    # --------------------------------------------------------- checkpoints
    #: Each rank's own sums: saved per rank under torch.distributed (reduced at log time).
    local_state_keys = ("window",)

    def state_dict(self) -> dict[str, Any]:
        """Where the interval began in ``loop.totals``, what each sink had written after the
        last complete row (its ``mark``) and the rows logged at that row's step: a run resumed
        from this checkpoint writes the same rows, bit for bit, as one that never stopped.
        The open sinks are flushed first, so what the marks count is on disk."""
        for _, sink in self._open:
            sink.flush()
        totals, (n0, mark) = self._iv.totals, self._iv.mark
        window = None if totals is None else {"at": totals.micro_batches, "n0": n0, "mark": mark}
        marks = {k: v for k, v in self._marks.items() if v is not None and k != "jsonl"}
        rows = [{"step": r.step, "kind": r.kind, "time": r.time, "scalars": dict(r.scalars)}
                for r in self._rows]  # fmt: skip
        return {"window": window, "jsonl_end": self._marks.get("jsonl"), "marks": marks,
                "rows": rows}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._restored = dict(saved)

    @staticmethod
    def _saved_marks(saved: Mapping[str, Any]) -> dict[str, Any]:
        marks = dict(saved.get("marks") or {})
        if saved.get("jsonl_end") is not None:
            marks["jsonl"] = saved["jsonl_end"]
        return marks

    @staticmethod
    def _saved_rows(saved: Mapping[str, Any]) -> tuple[Row, ...]:
        return tuple(
            Row(int(r["step"]), dict(r["scalars"]), str(r["kind"]), float(r["time"]))
            for r in saved.get("rows") or ()
        )

    # ------------------------------------------------------------ the interval
    def _begin(self, totals: RunTotals, window: dict[str, Any] | None) -> None:
        """Start the interval at ``totals`` now, or continue a saved ``window``."""
        self._iv.totals = totals
        if window and window.get("at") == totals.micro_batches:  # the totals it was taken at
            self._iv.mark = (window["n0"], {k: tuple(v) for k, v in window["mark"].items()})
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
        self._iv.mark = (totals.micro_batches - n, mark)

    def _pending(self) -> bool:
        """Whether a micro-batch ran since the last log."""
        totals = self._iv.totals
        return totals is not None and totals.micro_batches > self._iv.mark[0]

    # --------------------------------------------------------------- the sinks
    def _make_sinks(self, loop: Run, out: Named) -> None:
        """Make this run's sinks (not started) into ``out``, each under the key of its mark
        (into a list the caller holds: a sink made before another fails is closed)."""
        if self.console:
            out.append(("console", ConsoleSink(loop, progress=self.progress, **self._console_args)))
        path = _file_target(self.jsonl, loop, "metrics.jsonl", "jsonl")
        if path is not None:
            out.append(("jsonl", JsonlSink(path, arg="LoggerHook(jsonl=...)")))
        tb_dir = _file_target(self.tensorboard, loop, "tb", "tensorboard")
        if tb_dir is not None and self._tensorboard_installed(tb_dir):
            out.append(("tensorboard", TensorBoardSink(tb_dir)))
        out.extend((name, make_sink(name, loop.log_dir)) for name in self.named)
        keys = {k for k, _ in out}
        for i, s in enumerate(self.sinks):
            key = type(s).__name__
            out.append((f"{key}#{i}" if key in keys else key, as_sink(s)))
            keys.add(out[-1][0])

    def _tensorboard_installed(self, tb_dir: Path) -> bool:
        if importlib.util.find_spec("tensorboard") is not None:
            return True
        if self.tensorboard is not None:
            raise ImportError(
                "LoggerHook(tensorboard=...) needs the tensorboard package: pip install tensorboard"
            )
        warnings.warn(
            f"LoggerHook: tensorboard is not installed, not writing to {tb_dir}.", stacklevel=4
        )
        return False

    def _start_sinks(self, first: Event, restored: Mapping[str, Any] | None) -> Named:
        """Make and start this run's sinks: where the run (re)starts, each sink's mark."""
        loop = first.loop
        sinks: Named = []
        try:
            self._make_sinks(loop, sinks)
            continued = isinstance(first, RunBegin) and first.resumed
            saved = restored or {}
            resumed = loop.resumed_from
            at = Start(
                loop.state.step, loop.state.epoch, None if resumed is None else resumed.name,
                continued, rows=self._saved_rows(saved),
                message=first.message if isinstance(first, RunBegin) else "",
            )  # fmt: skip
            marks = self._saved_marks(saved)
            for key, sink in sinks:
                sink.start(attrs.evolve(at, mark=marks.get(key)))
            if isinstance(first, RunBegin) and any(k == "console" for k, _ in sinks):
                first.reported = True  # the console said the run's line
            self._marks = {key: sink.mark() for key, sink in sinks}
            self._rows = list(at.rows)
            if at.fresh:
                self._announce(loop, sinks)
        except BaseException:
            close_all([s for _, s in sinks])
            raise
        return sinks

    def _announce(self, loop: Run, sinks: Named) -> None:
        """Once per run (not on resume), on the writing rank: the config and the model summary."""
        if not sinks:
            return
        console = next((s for k, s in sinks if k == "console"), None)
        summary = None
        from ftrain.summary import model_summary

        with contextlib.suppress(Exception):  # a stand-in state without a model
            summary = model_summary(loop.state)
        config = run_config(loop, self.config)
        if summary is not None:
            config.update(summary.config())
        for _, sink in sinks:
            sink.log_config(config)
        if summary is not None and self.summary and isinstance(console, ConsoleSink):
            console.say(str(summary))

    def _write(
        self, sinks: Named, row: Row, *, partial: bool = False, best: Sequence[str] = ()
    ) -> None:
        """One row to every sink (``partial``: an interrupted interval's, to those taking one)."""
        for _, sink in sinks:
            if partial and not sink.takes_partial_rows:
                continue
            if row.kind == "eval":
                sink.write_eval(row.step, dict(row.scalars), best=best)
            else:
                sink.write(row.step, dict(row.scalars))
        if not partial:  # a complete row: a checkpoint taken now resumes after it
            self._marks.update((key, sink.mark()) for key, sink in sinks)
            if self._rows and self._rows[0].step != row.step:
                self._rows = []
            self._rows.append(row)

    # -------------------------------------------------------------- the logs
    def _scalars(self, loop: Run, state: TrainState, partial: bool, batch: Any) -> dict:
        """The interval's means, ``lr``, times, throughput and memory; ``partial``: the
        interval stays open (kept for a resume)."""
        iv = self._iv
        assert iv.totals is not None
        now = iv.totals.metric_sums()  # one host sync per device
        scalars = {}
        for key, (total, count) in now.items():  # the means since the last log
            s0, c0 = iv.mark[1].get(key, (0.0, 0))
            if count > c0:
                scalars[key] = (total - s0) / (count - c0)
        means = dict(scalars)
        if not partial:
            iv.mark = (iv.totals.micro_batches, now)
        with contextlib.suppress(Exception):  # a consumed state (failed step): no lr
            scalars.update(state_learning_rates(state))
        monitor = self.throughput
        if batch is not None and monitor is not None and monitor.needs_batch:
            iv.batch = batch  # the newest batch seen, for the throughput's counts
        scalars.update(self._timing(loop, means))
        scalars.update(self._save_times(loop))
        if monitor is not None and monitor.memory:
            scalars.update(memory_stats(iv.device))
        if self._distributed and not partial:
            scalars = _dist.reduce_metrics(scalars, ops=_RANK_OPS)
        _weighted_loss(scalars)
        return scalars

    def _log(
        self,
        loop: Run,
        state: TrainState,
        epoch: int,
        sinks: Named,
        interrupted: bool = False,
        *,
        batch: Any = None,
        at_epoch_end: bool = False,
    ) -> None:
        """Write the interval's means; ``interrupted``: a partial interval, kept for a resume
        (this rank's numbers: no collective while a run fails)."""
        scalars = self._scalars(loop, state, interrupted, batch)
        scalars["epoch"] = epoch
        shown, skipped = sinks, []
        if at_epoch_end:  # the console skips epoch-end logs unless asked
            skipped = [(k, s) for k, s in sinks if isinstance(s, ConsoleSink) and not s.epoch_end]
            shown = [ks for ks in sinks if ks not in skipped]
        self._write(shown, Row(state.step, scalars, "train", time.time()), partial=interrupted)
        # the run's last log may be an epoch's end: the console shows it at RunEnd
        self._iv.skipped = (state.step, scalars, skipped) if skipped else None

    def _timing(self, loop: Run, means: dict[str, float]) -> dict[str, float]:
        """The interval's times (the timer's sums less those at the last log), elapsed, ETA
        and throughput; none without a :class:`~ftrain.hooks.timer.TimerHook`."""
        iv = self._iv
        timer = iv.timer.stats if iv.timer is not None else None
        if timer is None:
            return {}
        scalars: dict[str, float] = {}
        last, mark = iv.timer_mark
        now = timer.mark()
        n, _, data, it = (a - b for a, b in zip(now, mark if last is timer else (0, 0, 0, 0)))
        iv.timer_mark = (timer, now)
        if n > 0:
            scalars.update(data_time=data / n, iter_time=it / n)
            scalars["compute_time"] = max(it / n - data / n, 0.0)
        scalars["elapsed"] = timer.elapsed
        if (eta := timer.eta) is not None:
            scalars["eta"] = eta
        monitor = self.throughput
        if monitor is not None and n > 0:
            with contextlib.suppress(Exception):  # a consumed state, a failing count
                monitor.prepare(loop, iv.batch)
            scalars.update(monitor.rates(micro_batches=n, seconds=it, batch=iv.batch, means=means))
            if not monitor.needs_batch:
                iv.batch = None  # hold no batch (device memory) between logs
        return scalars

    def _save_times(self, loop: Run) -> dict[str, float]:
        """The seconds checkpoint saves held the training thread since the last log, and of
        them, waiting for an earlier write (:class:`~ftrain.persist.savetime.SaveClock`);
        nothing when no save ran."""
        times = loop.checkpointer.times
        last, saves, blocked, waited = self._iv.save_mark
        if last is not times:
            saves, blocked, waited = 0, 0.0, 0.0
        self._iv.save_mark = (times, times.saves, times.blocked_s, times.waited_s)
        if times.saves == saves:
            return {}
        out = {"perf/ckpt_blocked_s": times.blocked_s - blocked}
        if times.waited_s > waited:
            out["perf/ckpt_waited_s"] = times.waited_s - waited
        return out

    def _log_eval(self, ev: Evaluated, sinks: Named) -> None:
        from ftrain.metric_names import shown_name

        scalars: dict[str, float] = {}
        best: list[str] = []
        for key, value in ev.metrics.items():
            number = _number(value)
            if number is not None:
                scalars[shown_name(key)] = number
                if any(_is_new_best(h, key, number) for h in self._iv.best_hooks):
                    best.append(shown_name(key))
        # no reduction here: EvalHook(reduce=...) owns it (reduce=None keeps each rank's own)
        if not scalars:
            return
        epoch = ev.state.epoch
        if ev.by_epoch and epoch > 0:
            epoch -= 1  # evaluated at an epoch's end: the epoch that ended
        scalars["epoch"] = epoch
        self._write(sinks, Row(ev.state.step, scalars, "eval", time.time()), best=best)

    # --------------------------------------------------------------- the run
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

    def _setup(self, first: Event) -> Named:
        """At ``RunBegin``: start the sinks (this rank's), find the timer and the best-keeping
        hooks, and start (or continue) the interval; returns the sinks."""
        loop = first.loop
        restored, self._restored = self._restored, None  # a checkpoint's, when resumed
        if loop.resumed_from is None:
            restored = None
        if isinstance(first, RunBegin) and first.resumed and restored is None:
            restored = self.state_dict()  # the loop iterated again after a stop
        self._iv = iv = _Interval()
        self._distributed = _dist.world_size() > 1  # a run's processes do not change
        if self._distributed and _dist.rank() != 0:  # it takes part in each log's reduction
            sinks: Named = []
            _file_target(self.jsonl, loop, "metrics.jsonl", "jsonl")  # same errors
            _file_target(self.tensorboard, loop, "tb", "tensorboard")  # on every rank
        else:
            sinks = self._start_sinks(first, restored)
        self._open = sinks
        # hooks that keep a best value (BestCheckpointHook): evaluation lines mark a new best
        iv.best_hooks = loop.hooks.of_type(_KeepsBest)
        iv.device = model_device(loop.state)
        iv.timer = next(iter(loop.hooks.of_type(TimerHook)), None)
        timer = iv.timer.stats if iv.timer is not None else None
        iv.timer_mark = (timer, timer.mark() if timer is not None else None)
        # the interval the checkpoint (or the stopped iteration) was in
        self._begin(loop.totals, restored.get("window") if restored else None)
        return sinks

    def _handle(self, ev: Event, loop: Run, sinks: Named) -> None:
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
            for _, sink in sinks:
                sink.flush()
        elif kind is RunEnd:
            if self._pending():
                self._log(loop, ev.state, ev.state.epoch, sinks)
            elif self._iv.skipped is not None:
                step, scalars, skipped = self._iv.skipped
                for _, sink in skipped:
                    sink.write(step, scalars)
            self._iv.skipped = None

    def _finish(self, loop: Run, sinks: Named, outcome: str) -> None:
        if sinks and self._pending():  # interrupted mid-interval: log what there is, if it
            with contextlib.suppress(Exception):  # can be read (no collective on this path)
                # kept in the interval: a checkpoint saved after this holds it, and a
                # resumed run cuts this row and logs the whole interval
                self._log(loop, loop.state, loop.state.epoch, sinks, True)
        totals, mark = self._iv.totals, self._iv.mark
        self._iv = _Interval(totals=totals, mark=mark)  # hold no loop (nor model) after the run
        self._open = []
        close_all([s for _, s in sinks], outcome)


@runtime_checkable
class _KeepsBest(Protocol):
    """A hook keeping a best value (:class:`~ftrain.hooks.checkpoint.BestCheckpointHook`)."""

    metric: str

    def is_better(self, value: float) -> bool: ...


def _is_new_best(hook: _KeepsBest, key: str, value: float) -> bool:
    """Whether ``hook`` (a best-checkpoint hook of lower priority) takes ``value`` of the
    evaluated ``key`` as a new best (any spelling of the metric's name)."""
    from ftrain.metric_names import same_metric

    with contextlib.suppress(Exception):
        return same_metric(hook.metric, key) and bool(hook.is_better(value))
    return False
