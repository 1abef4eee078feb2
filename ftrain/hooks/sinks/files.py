"""Sinks into local files: JSONL (one JSON object per row) and CSV (a column per tag).

Both cut the file back to where the run restarts (:meth:`start`): to their size or row count
when the checkpoint was saved (their :meth:`mark`), so the rows a stopped run wrote after
it, a torn last row included, are gone before the resumed run writes them again; a fresh
start empties the file.
"""

from __future__ import annotations

import csv
import io
import os
import time
from typing import IO, Any, BinaryIO

import orjson

from ftrain.hooks.sinks.base import PathLike, Scalars, SinkBase, Start, file_path, write_failed

__all__ = ["JsonlSink", "CsvSink"]


class _FileSink(SinkBase):
    """A sink writing one open file (``_file``, opened on the first write or start): flushed
    and closed alike."""

    _file: IO[Any] | None = None

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, status: str = "FINISHED") -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()


class JsonlSink(_FileSink):
    """One JSON object per row (orjson): ``{"step", "time", **scalars}``, flushed.

    :meth:`start` cuts the file: a fresh start empties it, a resume cuts it to its size
    when the checkpoint was saved (:meth:`mark`; failing that, rows after the resumed step
    go); written without ``start``, the file is continued (a torn last line cut).

    Example:
        >>> import tempfile, pathlib, orjson
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> sink = JsonlSink(path)
        >>> sink.write(5, {"epoch": 0, "loss": 0.25}); sink.close()
        >>> orjson.loads(path.read_bytes().splitlines()[0])["loss"]
        0.25
    """

    def __init__(self, path: PathLike, *, arg: str = "JsonlSink(path)") -> None:
        self.path = file_path(path, arg, "metrics.jsonl")
        self._arg = arg
        self._file: BinaryIO | None = None
        self._end = 0

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"

    def start(self, at: Start) -> None:
        self.close()
        self._open(at)

    def _open(self, at: Start | None) -> BinaryIO:
        self.path = file_path(self.path, self._arg, "metrics.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # (a device such as /dev/stdout is only appended to)
            if at is None:
                self._drop_torn_tail()
            elif at.fresh:
                os.truncate(self.path, 0)
            elif isinstance(at.mark, int) and self.path.stat().st_size >= at.mark:
                os.truncate(self.path, at.mark)
            else:  # a checkpoint of an older ftrain: by step
                self._purge(at.step)
        # unbuffered: each row is one write (a failed one leaves nothing behind to flush)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._end = self._file.tell()
        return self._file

    def mark(self) -> int:
        """The file's size after the last row: where a run resumed from now continues."""
        return self._end

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
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, step: int, scalars: Scalars) -> None:
        f = self._file if self._file is not None else self._open(None)
        record = {"step": step, "time": time.time(), **scalars}
        try:
            f.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        except OSError as exc:
            raise write_failed(exc, self.path, f"point {self._arg} at another disk") from exc
        self._end = f.tell()


class CsvSink(_FileSink):
    """Logs as CSV rows: ``step``, ``time``, then every tag seen so far (a new tag rewrites
    the file with the wider header). :meth:`start` keeps the rows written before the
    checkpoint the run resumed from (:meth:`mark`: their count); a fresh start empties it.

    Example:
        >>> import tempfile, pathlib, csv
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> sink = CsvSink(path)
        >>> sink.write(10, {"loss": 0.5}); sink.write_eval(10, {"val/acc": 0.9}); sink.close()
        >>> [(r["step"], r["loss"], r["val/acc"]) for r in csv.DictReader(path.open())]
        [('10', '0.5', ''), ('10', '', '0.9')]
    """

    def __init__(self, path: PathLike) -> None:
        self.path = file_path(path, "CsvSink(path)", "metrics.csv")
        self.columns: list[str] = ["step", "time"]
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._rows = 0

    def __repr__(self) -> str:
        return f"CsvSink({str(self.path)!r})"

    def _read(self) -> list[dict[str, str]]:
        """The file's complete rows (its header sets :attr:`columns`)."""
        if not (self.path.exists() and self.path.stat().st_size):
            return []
        text = self.path.read_text(encoding="utf-8")
        text = text[: text.rfind("\n") + 1]  # a last row without its newline is torn
        reader = csv.DictReader(io.StringIO(text, newline=""))
        self.columns = list(reader.fieldnames or self.columns)
        return [r for r in reader if None not in r and None not in r.values()]

    def start(self, at: Start) -> None:
        self.close()
        self._open(at)

    def _open(self, at: Start | None) -> None:
        self.path = file_path(self.path, "CsvSink(path)", "metrics.csv")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = ["step", "time"]
        rows = [] if at is not None and at.fresh else self._read()
        if at is not None and not at.fresh:
            if isinstance(at.mark, int):
                rows = rows[: at.mark]
            else:  # a checkpoint of an older ftrain: by step
                rows = [r for r in rows if _step(r) is not None and _step(r) <= at.step]
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, fieldnames=self.columns, restval="")
                writer.writeheader()
                writer.writerows(rows)
            os.replace(tmp, self.path)
        except OSError as exc:
            raise write_failed(exc, self.path, "pass CsvSink a path on another disk") from exc
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns, restval="")
        self._rows = len(rows)

    def mark(self) -> int:
        """The number of rows written: where a run resumed from now continues."""
        return self._rows

    def write(self, step: int, scalars: Scalars) -> None:
        if self._file is None:
            self._open(None)
        row: dict[str, Any] = {"step": step, "time": f"{time.time():.3f}", **scalars}
        new = [k for k in row if k not in self.columns]
        if new:
            self.close()
            old_rows = self._read()
            self.columns += new
            self._rewrite(old_rows)
        try:
            self._writer.writerow(row)
            self._file.flush()
        except OSError as exc:
            raise write_failed(exc, self.path, "pass CsvSink a path on another disk") from exc
        self._rows += 1

    def write_eval(self, step: int, scalars: Scalars, *, best: Any = ()) -> None:
        self.write(step, scalars)


def _step(row: dict[str, str]) -> int | None:
    try:
        return int(row["step"])
    except (KeyError, ValueError):
        return None
