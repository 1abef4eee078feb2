"""More places for :class:`~ftrain.hooks.logging.LoggerHook` to write: CSV, MLflow, Weights & Biases.

Each is a sink (``write``, ``write_eval``, ``close``) and gets the run's
flat config once through ``log_config`` (:func:`run_config`)::

    LoggerHook(every=50, sinks=[CsvSink("runs/a/metrics.csv"),
                                MLflowSink("runs/a/mlruns", experiment="a"),
                                WandbSink(project="a", dir="runs/a", mode="offline")])

or by name, created in ``work_dir``: ``LoggerHook(sinks=["csv", "mlflow", "wandb"])``.
MLflow (``pip install 'ftrain[mlflow]'``) and W&B (``'ftrain[wandb]'``) are
imported when the sink is created; neither uses the network unless pointed
at a server (a local MLflow store; W&B offline, ``wandb sync`` later).
"""

from __future__ import annotations

import csv
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrain.run import Run

__all__ = ["CsvSink", "MLflowSink", "WandbSink", "run_config", "flatten_config", "make_sink"]

PathLike = str | os.PathLike


def _missing(package: str, extra: str, exc: ImportError) -> ImportError:
    return ImportError(
        f"{package} is not installed ({exc}); install it with: pip install 'ftrain[{extra}]' "
        f"(or pip install {package})."
    )


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
    config: dict[str, Any] = {
        "max_steps": loop.max_steps,
        "epochs": loop.epochs,
        "work_dir": None if loop.work_dir is None else str(loop.work_dir),
        "step": repr(loop.step),
    }
    model, optimizer = loop.state.model, loop.state.optimizer
    if model is not None:
        params = list(model.parameters())
        config["model"] = type(model).__name__
        config["params"] = sum(p.numel() for p in params)
        config["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    if optimizer is not None:
        config["optimizer"] = type(optimizer).__name__
        for key, value in getattr(optimizer, "defaults", {}).items():
            if key not in ("params", "differentiable", "foreach", "fused", "capturable"):
                config[f"optimizer.{key}"] = value
        config["optimizer.param_groups"] = len(optimizer.param_groups)
    from ftrain import dist

    config["world_size"] = dist.world_size()
    if extra:
        config.update(extra)
    return flatten_config(config)


class FileSink:
    """``flush()`` and ``close()`` of a sink writing to the open file ``self._file``."""

    _file: Any

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class CsvSink(FileSink):
    """Logs as CSV rows: ``step``, ``time``, then every tag seen so far (a new tag rewrites
    the file with the wider header). ``purge_after=step`` keeps the rows up to that step.

    Example:
        >>> import tempfile, pathlib, csv
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> sink = CsvSink(path)
        >>> sink.write(10, {"loss": 0.5}); sink.write_eval(10, {"val/acc": 0.9}); sink.close()
        >>> [(r["step"], r["loss"], r["val/acc"]) for r in csv.DictReader(path.open())]
        [('10', '0.5', ''), ('10', '', '0.9')]
    """

    def __init__(self, path: PathLike, *, purge_after: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] = ["step", "time"]
        rows: list[dict[str, str]] = []
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or self.columns)
                for row in reader:
                    if None in row or None in row.values():  # a torn last row
                        continue
                    try:
                        step = int(row["step"])
                    except (KeyError, ValueError):
                        continue
                    if purge_after is None or step <= purge_after:
                        rows.append(row)
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns, restval="")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        row: dict[str, Any] = {"step": step, "time": f"{time.time():.3f}", **scalars}
        new = [k for k in row if k not in self.columns]
        if new:
            self._file.close()
            with open(self.path, newline="", encoding="utf-8") as f:
                old_rows = list(csv.DictReader(f))
            self.columns += new
            self._rewrite(old_rows)
        self._writer.writerow(row)
        self._file.flush()

    write_eval = write


_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")


class MLflowSink:
    """Logs as the metrics of an MLflow run, the config as its parameters.

    ``tracking_uri``: a local directory (a file store), a database URI or a server.
    A resumed run continues the MLflow run ``run_id``, or the one in ``run_id_file``.
    """

    def __init__(
        self,
        tracking_uri: PathLike,
        *,
        experiment: str = "ftrain",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow-skinny", "mlflow", exc) from exc
        uri = str(tracking_uri)
        self.store_dir: Path | None = None
        if isinstance(tracking_uri, os.PathLike) or uri.startswith("file:") or "://" not in uri:
            path = Path("/" + uri[5:].lstrip("/") if uri.startswith("file:") else uri).resolve()
            path.mkdir(parents=True, exist_ok=True)
            self.store_dir = path
            uri = path.as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # local file store
        self.tracking_uri = uri
        self._Metric, self._Param = Metric, Param
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        id_file = None if self.store_dir is None else self.store_dir / f"{experiment}.run_id"
        if run_id is None and id_file is not None and id_file.is_file():
            run_id = id_file.read_text().strip() or None
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
            self.run_id = run.info.run_id
        self.run_id_file = id_file
        if id_file is not None:  # now: a process killed before close() resumes this run
            tmp = id_file.with_name(id_file.name + ".tmp")
            tmp.write_text(self.run_id)
            os.replace(tmp, id_file)
        self._params_logged = False
        self._closed = False

    @staticmethod
    def _key(name: str) -> str:
        return _MLFLOW_BAD.sub("_", name)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as MLflow parameters (once per run; a resumed run keeps them)."""
        if self._params_logged:
            return
        existing = self.client.get_run(self.run_id).data.params
        params = [
            self._Param(self._key(k), str(v)[:6000])
            for k, v in flatten_config(config).items()
            if self._key(k) not in existing
        ]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self._params_logged = True

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self._closed:  # the same sink again, after an interrupted run() (a notebook)
            self.client.update_run(self.run_id, status="RUNNING")
            self._closed = False
        now = int(time.time() * 1000)
        metrics = [
            self._Metric(self._key(k), float(v), now, int(step))
            for k, v in scalars.items()
            if k != "epoch" and not math.isnan(float(v))
        ]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    write_eval = write

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run: ``"FINISHED"``, ``"FAILED"`` (an error) or ``"KILLED"``."""
        if self._closed:
            return
        self._closed = True
        self.client.set_terminated(self.run_id, status=status)


class WandbSink:
    """Logs to a Weights & Biases run, offline by default (files under ``dir/wandb/``).

    ``run_id`` (or the file ``dir/wandb_run_id``) continues a W&B run on resume.
    """

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
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb", exc) from exc
        self.dir = Path(dir) if dir is not None else Path.cwd()
        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "wandb_run_id"
        if run_id is None and id_file.is_file():
            run_id = id_file.read_text().strip() or None
        settings = init_kwargs.pop("settings", None) or wandb.Settings(
            silent=True, console="off", x_disable_stats=True
        )
        self.run = wandb.init(
            project=project,
            dir=str(self.dir),
            mode=mode,
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            settings=settings,
            reinit="create_new",
            **init_kwargs,
        )
        id_file.write_text(self.run.id)
        self._closed = False

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as ``run.config`` (keys already set are kept)."""
        self.run.config.update(flatten_config(config), allow_val_change=True)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

    write_eval = write

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()


# ---------------------------------------------------------------- by name
def check_sink_name(name: str) -> None:
    """Raise for a sink name :func:`make_sink` does not know."""
    if name not in ("csv", "mlflow", "wandb"):
        raise ValueError(
            f"LoggerHook: unknown sink {name!r}; the named sinks are 'csv', 'mlflow', 'wandb' "
            "(or pass a sink object)."
        )


def make_sink(name: str, loop: Run | None, *, purge_after: int | None = None) -> Any:
    """A sink from its name (``"csv"``, ``"mlflow"``, ``"wandb"``) in the run's ``work_dir``.

    Example:
        >>> make_sink("ftp", None)
        Traceback (most recent call last):
        ...
        ValueError: LoggerHook: unknown sink 'ftp'; the named sinks are 'csv', 'mlflow', 'wandb' (or pass a sink object).
    """
    check_sink_name(name)
    work_dir = None if loop is None else loop.log_dir  # a store's work_dir: its local copy
    if work_dir is None:
        raise ValueError(
            f"LoggerHook(sinks=[{name!r}]) needs a directory: pass work_dir= to ftrain.Loop, "
            f"or a sink object such as {'CsvSink(path)' if name == 'csv' else name}."
        )
    work_dir = Path(work_dir)
    if name == "csv":
        return CsvSink(work_dir / "metrics.csv", purge_after=purge_after)
    if name == "mlflow":
        return MLflowSink(work_dir / "mlruns", experiment=work_dir.name or "ftrain")
    return WandbSink(project=work_dir.name or "ftrain", dir=work_dir)
