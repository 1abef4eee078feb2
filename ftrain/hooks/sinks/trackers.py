"""Experiment trackers as sinks: MLflow and Weights & Biases (each imported when its sink is made).

Neither uses the network unless pointed at a server (a local MLflow store; W&B offline,
``wandb sync`` later). A tracker keeps every row it is sent, so it cannot take rows back:
when a run resumes, its sink writes no row at or before the last step the tracker already
holds for that tag (the rows a stopped run wrote after its checkpoint are the ones the
resumed run would write again, bitwise the same numbers), and the row of an interrupted
log interval is never sent (``takes_partial_rows = False``). W&B offline writes its file every
15 s: a resumed W&B sink also sends again what a killed process had sent before its
checkpoint and W&B had not written (kept in ``wandb_sent.ndjson``). A fresh start begins a new
tracker run. Neither changes a process-wide setting: MLflow's permission to use a local
directory store is given only while the sink talks to it, and what W&B sets for the
process (``os.environ``, ``sys.excepthook``, ``sys.exit``) is put back.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from ftrain.hooks.sinks.base import PathLike, Scalars, SinkBase, Start, flatten_config

__all__ = ["MLflowSink", "WandbSink"]

_ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"


def _missing(package: str, extra: str, exc: ImportError) -> ImportError:
    return ImportError(
        f"{package} is not installed ({exc}); install it with: pip install 'ftrain[{extra}]' "
        f"(or pip install {package})."
    )


def _new_rows(steps: Mapping[str, int], step: int, scalars: Scalars) -> Scalars:
    """The tags of a row the tracker does not hold yet (``steps``: the last step of each
    tag it holds); ``epoch`` goes along with any other tag."""
    kept = {k: v for k, v in scalars.items() if k != "epoch" and step > steps.get(k, -1)}
    if kept and "epoch" in scalars:
        kept["epoch"] = scalars["epoch"]
    return kept


@contextlib.contextmanager
def _process_kept() -> Iterator[None]:
    """Put back what a library sets for the whole process: ``os.environ``,
    ``sys.excepthook`` and ``sys.exit`` (W&B's ``init`` replaces both hooks)."""
    env, excepthook, exit_ = dict(os.environ), sys.excepthook, sys.exit
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in env]:
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        sys.excepthook, sys.exit = excepthook, exit_


# ------------------------------------------------------------------- MLflow
def _store_dir(tracking_uri: PathLike) -> Path | None:
    """The local directory of a file store (a path or a ``file:`` URI); ``None`` otherwise."""
    uri = str(tracking_uri)
    if isinstance(tracking_uri, os.PathLike) or uri.startswith("file:") or "://" not in uri:
        return Path("/" + uri[5:].lstrip("/") if uri.startswith("file:") else uri).resolve()
    return None


def _check_uri(tracking_uri: Any) -> None:
    if isinstance(tracking_uri, bool) or not isinstance(tracking_uri, (str, os.PathLike)):
        raise TypeError(
            f"MLflowSink: tracking_uri must be a directory (a path or a file: URI), a "
            f"database URI or a server URL, got {tracking_uri!r}; e.g. "
            "MLflowSink('runs/a/mlruns') or LoggerHook(sinks=['mlflow'])."
        )
    if not str(tracking_uri).strip():
        raise ValueError("MLflowSink: tracking_uri is empty; pass a directory such as 'mlruns'.")


class MLflowSink(SinkBase):
    """Logs as the metrics of an MLflow run, the config as its parameters.

    ``tracking_uri``: a local directory (a file store), a database URI or a server. A fresh
    ftrain run starts a new MLflow run (named ``run_name``); a resumed one continues the
    MLflow run ``run_id``, or the one whose id is kept next to a local store
    (``<experiment>.run_id``, written as soon as the run is created).

    Example:
        >>> MLflowSink(123)
        Traceback (most recent call last):
        ...
        TypeError: MLflowSink: tracking_uri must be a directory (a path or a file: URI), a database URI or a server URL, got 123; e.g. MLflowSink('runs/a/mlruns') or LoggerHook(sinks=['mlflow']).
    """

    takes_partial_rows = False

    def __init__(
        self,
        tracking_uri: PathLike,
        *,
        experiment: str = "ftrain",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        _check_uri(tracking_uri)
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow-skinny", "mlflow", exc) from exc
        self.store_dir = _store_dir(tracking_uri)
        if self.store_dir is not None and self.store_dir.is_file():
            raise ValueError(
                f"MLflowSink: {self.store_dir} is a file; a local MLflow store is a directory "
                "(e.g. runs/a/mlruns)."
            )
        self.tracking_uri = str(tracking_uri) if self.store_dir is None else self.store_dir.as_uri()
        self.experiment, self.run_name, self.tags = experiment, run_name, dict(tags or {})
        self._Client, self._Metric, self._Param = MlflowClient, Metric, Param
        self._given_id = run_id
        self.client: Any = None
        self.run_id: str | None = run_id
        self._steps: dict[str, int] = {}  # the last step of each tag the MLflow run holds
        self._params_logged = False
        self._open = False

    def __repr__(self) -> str:
        return f"MLflowSink({self.tracking_uri!r}, experiment={self.experiment!r})"

    @property
    def run_id_file(self) -> Path | None:
        """Where a local store keeps the MLflow run's id (a resumed run continues it)."""
        return None if self.store_dir is None else self.store_dir / f"{self.experiment}.run_id"

    @contextlib.contextmanager
    def _store(self) -> Iterator[None]:
        """MLflow 3 opens a local directory store only when ``MLFLOW_ALLOW_FILE_STORE`` is
        set: set it while this sink talks to its store, and only if it is not set."""
        if self.store_dir is None or _ALLOW_FILE_STORE in os.environ:
            yield
            return
        os.environ[_ALLOW_FILE_STORE] = "true"
        try:
            yield
        finally:
            os.environ.pop(_ALLOW_FILE_STORE, None)

    def start(self, at: Start) -> None:
        self.close("KILLED")  # (an open run of this sink: a loop iterated again)
        with self._store():
            if self.store_dir is not None:
                self.store_dir.mkdir(parents=True, exist_ok=True)
            self.client = client = self._Client(tracking_uri=self.tracking_uri)
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = (
                exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
            )
            run_id = self._given_id or (None if at.fresh else self._resumed_id(at))
            if run_id is None:
                run = client.create_run(exp_id, run_name=self.run_name, tags=self.tags)
                self.run_id, self._steps = run.info.run_id, {}
            else:
                self.run_id = run_id
                client.update_run(run_id, status="RUNNING")
                self._steps = {} if at.fresh else self._held_steps(run_id)
        if self.run_id_file is not None:  # now: a process killed before close() resumes it
            self.run_id_file.write_text(self.run_id)
        self._params_logged = False
        self._open = True

    def mark(self) -> str | None:
        """The MLflow run's id, kept in each checkpoint: a run resumed from one continues
        that MLflow run, even when other runs share the store and experiment."""
        return self.run_id

    def _resumed_id(self, at: Start) -> str | None:
        """The MLflow run to continue: the checkpoint's (its :meth:`mark`), else the one the
        store's run-id file names (a checkpoint of an older ftrain, a loop run again)."""
        return at.mark if isinstance(at.mark, str) and at.mark else self._kept_id()

    def _kept_id(self) -> str | None:
        f = self.run_id_file
        return (f.read_text().strip() or None) if f is not None and f.is_file() else None

    def _held_steps(self, run_id: str) -> dict[str, int]:
        """The last step of each metric the MLflow run holds."""
        keys = self.client.get_run(run_id).data.metrics
        history = self.client.get_metric_history
        return {k: max(m.step for m in history(run_id, k)) for k in keys}

    @staticmethod
    def _key(name: str) -> str:
        return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in name)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as MLflow parameters (once per run; a resumed run keeps them)."""
        if self._params_logged or not self._open:
            return
        with self._store():
            existing = self.client.get_run(self.run_id).data.params
            params = [
                self._Param(self._key(k), str(v)[:6000])
                for k, v in flatten_config(config).items()
                if self._key(k) not in existing
            ]
            for i in range(0, len(params), 100):  # log_batch takes at most 100 params
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self._params_logged = True

    def write(self, step: int, scalars: Scalars) -> None:
        if not self._open:  # written without start(): a fresh run
            self.start(Start())
        now = int(time.time() * 1000)
        row = _new_rows(self._steps, step, {self._key(k): v for k, v in scalars.items()})
        metrics = [
            self._Metric(k, float(v), now, int(step))
            for k, v in row.items()
            if k != "epoch" and not math.isnan(float(v))
        ]
        with self._store():
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run: ``"FINISHED"``, ``"FAILED"`` (an error) or ``"KILLED"``."""
        if not self._open:
            return
        self._open = False
        with self._store():
            self.client.set_terminated(self.run_id, status=status)


# -------------------------------------------------------------------- W&B
_BLOCK = 32768  # the .wandb transaction log: LevelDB's log format, 32 KiB blocks


def _mark_rows(mark: Any) -> int | None:
    """The rows count of a :meth:`WandbSink.mark` (ftrain 0.2 kept the bare count)."""
    rows = mark.get("rows") if isinstance(mark, dict) else mark
    return rows if isinstance(rows, int) else None


def _mark_run(mark: Any) -> str | None:
    """The W&B run id of a :meth:`WandbSink.mark` (``None`` in ftrain 0.2's)."""
    run = mark.get("run") if isinstance(mark, dict) else None
    return run if isinstance(run, str) and run else None


def _log_records(data: bytes) -> Iterator[bytes]:
    """The complete records of a W&B transaction log (a torn tail is left out)."""
    pos, chunks = 7, b""  # after the file header (":W&B" and its version)
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pos += 7
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left - 7
            continue
        if pos + length > len(data):
            return
        chunks += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # a whole record, or a record's last piece
            yield chunks
            chunks = b""


def _offline_steps(wandb_dir: Path, run_id: str) -> dict[str, int]:
    """The last step of each tag the offline files of W&B run ``run_id`` hold on disk."""
    from wandb.proto import wandb_internal_pb2 as pb

    steps: dict[str, int] = {}
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for raw in _log_records(path.read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            step = int(orjson.loads(items.pop("_step", str(rec.history.step.num))))
            for key in items:
                if not key.startswith("_"):
                    steps[key] = max(steps.get(key, -1), step)
    return steps


class WandbSink(SinkBase):
    """Logs to a Weights & Biases run, offline by default (files under ``dir/wandb/``).

    A fresh ftrain run starts a new W&B run; a resumed one continues ``run_id``, or the run
    whose id is kept in ``dir/wandb_run_id``. Each row sent is also kept in
    ``dir/wandb_sent.ndjson``: W&B writes its offline file every 15 s, so a killed process
    loses what W&B had not written yet; a resumed run sends again the rows from before its
    checkpoint that the offline files lack, and no row they hold. (Online, W&B's server
    keeps one row per step itself.)

    Example:
        >>> WandbSink(mode="cloud")
        Traceback (most recent call last):
        ...
        ValueError: WandbSink: mode must be 'offline', 'online' or 'disabled', got 'cloud'.
    """

    takes_partial_rows = False

    def __init__(
        self,
        *,
        project: str = "ftrain",
        dir: PathLike | None = None,
        mode: str = "offline",
        name: str | None = None,
        run_id: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(
                f"WandbSink: mode must be 'offline', 'online' or 'disabled', got {mode!r}."
            )
        if dir is not None and (isinstance(dir, bool) or not isinstance(dir, (str, os.PathLike))):
            raise TypeError(f"WandbSink: dir must be a directory path, got {dir!r}.")
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb", exc) from exc
        self._wandb = wandb
        self.dir = Path(dir) if dir is not None else Path.cwd()
        if self.dir.is_file():
            raise ValueError(f"WandbSink: dir={str(self.dir)!r} is a file; pass a directory.")
        self.project, self.mode, self.name = project, mode, name
        self._given_id, self._init_kwargs = run_id, init_kwargs
        self.run: Any = None
        self._held: dict[str, int] = {}  # the last step of each tag W&B holds on disk
        self._journal: Any = None
        self._rows = 0  # rows in the journal

    def __repr__(self) -> str:
        return f"WandbSink(project={self.project!r}, dir={str(self.dir)!r}, mode={self.mode!r})"

    def start(self, at: Start) -> None:
        self.close("KILLED")
        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "wandb_run_id"
        run_id, rows = self._given_id, _mark_rows(at.mark)
        if run_id is None and not at.fresh:  # the checkpoint's W&B run, else the dir's newest
            run_id = _mark_run(at.mark) or (
                (id_file.read_text().strip() or None) if id_file.is_file() else None
            )
        sent = self._journal_rows(run_id, None if at.fresh else rows)
        self._held = {}
        if run_id is not None and not at.fresh and self.mode == "offline":
            self._held = _offline_steps(self.dir / "wandb", run_id)
        self.run = self._init(run_id)
        id_file.write_text(self.run.id)
        self._open_journal(sent)
        for step, row in sent:  # rows from before the checkpoint that W&B lost (a kill)
            self._send(step, row)

    def _journal_rows(self, run_id: str | None, mark: Any) -> list[tuple[int, Scalars]]:
        """The rows sent to ``run_id`` before the checkpoint (its ``mark``: their count)."""
        path = self.dir / "wandb_sent.ndjson"
        if run_id is None or not isinstance(mark, int) or not path.is_file():
            return []
        rows = []
        for line in path.read_bytes().splitlines()[:mark]:
            with contextlib.suppress(orjson.JSONDecodeError):
                saved = orjson.loads(line)
                if saved.get("run") == run_id:
                    rows.append((int(saved["step"]), dict(saved["row"])))
        return rows

    def _open_journal(self, rows: list[tuple[int, Scalars]]) -> None:
        path, run = self.dir / "wandb_sent.ndjson", self.run.id
        lines = [orjson.dumps({"run": run, "step": s, "row": r}) + b"\n" for s, r in rows]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(lines))
        os.replace(tmp, path)
        self._journal = open(path, "ab")  # noqa: SIM115 - closed in close()
        self._rows = len(rows)

    def _init(self, run_id: str | None) -> Any:
        wandb, kwargs = self._wandb, dict(self._init_kwargs)
        settings = kwargs.pop("settings", None) or wandb.Settings(
            silent=True, console="off", x_disable_stats=True
        )
        with _process_kept():
            return wandb.init(
                project=self.project,
                dir=str(self.dir),
                mode=self.mode,
                name=self.name,
                id=run_id,
                resume="allow" if run_id else None,
                settings=settings,
                reinit="create_new",
                **kwargs,
            )

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as ``run.config`` (keys already set are kept)."""
        if self.run is not None:
            self.run.config.update(flatten_config(config), allow_val_change=True)

    def mark(self) -> dict[str, Any]:
        """The W&B run's id and the number of rows sent: the run a resume continues (even
        when other runs share ``dir``) and what it sent before."""
        return {"run": None if self.run is None else self.run.id, "rows": self._rows}

    def _send(self, step: int, scalars: Scalars) -> None:
        row = _new_rows(self._held, step, scalars)
        if row:
            self.run.log({k: float(v) for k, v in row.items()}, step=int(step))

    def write(self, step: int, scalars: Scalars) -> None:
        if self.run is None:  # written without start(): a fresh run
            self.start(Start())
        self._send(step, scalars)
        line = {
            "run": self.run.id,
            "step": int(step),
            "row": {k: float(v) for k, v in scalars.items()},
        }
        self._journal.write(orjson.dumps(line) + b"\n")
        self._journal.flush()
        self._rows += 1

    def close(self, status: str = "FINISHED") -> None:
        run, self.run = self.run, None
        journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()
        if run is not None:
            with _process_kept():
                run.finish(exit_code=0 if status == "FINISHED" else 1)
