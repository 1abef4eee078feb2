"""The TensorBoard sink: scalars into event files (``torch.utils.tensorboard``, imported when a
writer opens)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrain.hooks.sinks.base import PathLike, Scalars, SinkBase, Start, write_failed

__all__ = ["TensorBoardSink"]


class TensorBoardSink(SinkBase):
    """Scalars into TensorBoard event files.

    :meth:`start` opens a writer whose ``purge_step`` is the update the run (re)starts from
    (0 for a fresh start): TensorBoard then hides every earlier event at or after that step,
    and the rows logged at that step before the checkpoint are written again
    (``Start.rows``), so nothing a stopped run wrote later shows twice. Logs are written in
    one batch every ``flush_secs``, at :meth:`flush` (before each checkpoint) and on
    ``close()`` (the writer's checksums, fed one log at a time, held the GIL: a 110 us step
    cost 12 us more).

    Example:
        >>> import tempfile
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.write(1, {"loss": 0.5}); sink.close()
    """

    def __init__(self, log_dir: PathLike, *, flush_secs: float = 10) -> None:
        self.log_dir = Path(log_dir)
        if self.log_dir.is_file():
            raise ValueError(
                f"TensorBoardSink: {self.log_dir} is a file; TensorBoard writes a directory "
                "of event files: pass a directory (e.g. work_dir/tb)."
            )
        self.flush_secs = flush_secs
        self.writer: Any = None
        self._pending: list[tuple[int, float, list[tuple[str, float]]]] = []
        self._written = time.monotonic()

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.log_dir)!r})"

    def _after_existing_files(self) -> None:
        """Wait (under a second) until the clock passes the second of the newest event file
        in ``log_dir``: readers take the files in name order
        (``events.out.tfevents.<second>.<host>.<pid>.<n>``), and within one second a process's
        10th writer (``.10``) sorts before its 9th: a run restarted that fast would be read
        before the one it continues, and its ``purge_step`` would hide nothing."""
        newest = 0
        for f in self.log_dir.glob("events.out.tfevents.*"):
            second = f.name.split(".")[3]
            newest = max(newest, int(second)) if second.isdigit() else newest
        while int(time.time()) <= newest:
            time.sleep(min(0.05, newest + 1 - time.time()) + 0.001)

    def _open(self, purge_step: int | None) -> Any:
        from torch.utils.tensorboard import SummaryWriter  # slow import: only here

        self._after_existing_files()
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=purge_step, flush_secs=self.flush_secs
        )
        try:  # one event per log (add_scalar makes one per scalar: ~50 us each)
            from tensorboard.compat.proto.summary_pb2 import Summary

            self._summary: Any = Summary
            self._file_writer: Any = self.writer._get_file_writer()
        except (ImportError, AttributeError):  # pragma: no cover - other tensorboard versions
            self._summary = self._file_writer = None
        self._written = time.monotonic()
        return self.writer

    def start(self, at: Start) -> None:
        self.close()
        self._open(0 if at.fresh else at.step)
        for row in at.rows:  # what was logged at the restart step before the checkpoint
            if row.step == at.step:
                self._hold(row.step, row.scalars, row.time)

    def _hold(self, step: int, scalars: Mapping[str, float], wall_time: float) -> None:
        items = [(k, float(v)) for k, v in scalars.items() if k != "epoch"]
        self._pending.append((step, wall_time, items))

    def write(self, step: int, scalars: Scalars) -> None:
        if self.writer is None:
            self._open(None)
        self._hold(step, scalars, time.time())
        if time.monotonic() - self._written >= self.flush_secs:
            self.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as a text summary ``config`` (a Markdown table)."""
        writer = self.writer if self.writer is not None else self._open(None)
        rows = "\n".join(f"| {k} | {v} |" for k, v in config.items())
        writer.add_text("config", "| name | value |\n|---|---|\n" + rows, 0)

    def flush(self) -> None:
        """Write the held logs and flush the file."""
        if self.writer is None:
            return
        pending, self._pending = self._pending, []
        try:
            for step, wall_time, items in pending:
                if self._file_writer is not None:
                    value = self._summary.Value
                    summary = self._summary(value=[value(tag=k, simple_value=v) for k, v in items])
                    self._file_writer.add_summary(summary, step, wall_time)
                else:  # pragma: no cover
                    for k, v in items:
                        self.writer.add_scalar(k, v, step, wall_time)
            self.writer.flush()
        except OSError as exc:
            fix = "pass LoggerHook(tensorboard=...) a directory on another disk"
            raise write_failed(exc, self.log_dir, fix) from exc
        self._written = time.monotonic()

    def close(self, status: str = "FINISHED") -> None:
        if self.writer is None:
            return
        try:
            self.flush()
        finally:
            writer, self.writer = self.writer, None
            writer.close()
