"""Issue 21: a resume never writes a duplicate or partial row, in any sink.

A small run (tests/sink_resume_child.py: 12 updates, a log every 2, an evaluation every 3, a
checkpoint every 6, every sink) runs three ways in subprocesses: uninterrupted; killed with
a real SIGKILL the child sends itself after update 10, then resumed (from iter_6.pth, whose
evaluation was still due: it runs again); stopped by SIGINT after update 7 (a partial log
interval is written on the way out), then resumed from interrupted.pth. Each sink's own
output is read back (the files; TensorBoard's EventAccumulator; MLflow's client; the W&B
offline run files) and must hold exactly the uninterrupted run's rows: the same steps and
the same numbers, no row twice, no torn or partial row. Times and throughput are left out
(they measure the machine).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from test_watch import _read_wandb

HERE = Path(__file__).resolve().parent
CHILD = HERE / "sink_resume_child.py"
#: Tags that depend on the training only (not on the machine's speed).
TAGS = ("loss", "lr", "val/loss", "epoch")

pytestmark = pytest.mark.slow


def _run(work: Path, *signal_at: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(
        PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1", TQDM_DISABLE="1",
        WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(work),
    )  # fmt: skip
    return subprocess.run(
        [sys.executable, str(CHILD), str(work), *signal_at],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The work directories and outputs of the three runs (each resumed run: both halves)."""
    root = tmp_path_factory.mktemp("sinks")
    out = {"straight": [_run(root / "straight")]}
    for name, signal_at, code in (
        ("killed", ("SIGKILL", "10"), -9),
        ("sigint", ("SIGINT", "7"), 130),
    ):
        first = _run(root / name, *signal_at)
        assert first.returncode == code, first.stderr[-3000:]
        out[name] = [first, _run(root / name)]
    for procs in out.values():
        assert procs[-1].returncode == 0 and "DONE" in procs[-1].stdout, procs[-1].stderr[-3000:]
    return root, out


def _rows(records, kind_key="kind"):
    """(step, tag, value) of each deterministic tag, in the order written."""
    return [
        (int(r["step"]), t, float(r[t]))
        for r in records
        for t in TAGS
        if r.get(t) not in (None, "")
    ]


def test_the_runs_say_how_they_start_and_stop(runs):
    _, out = runs
    (straight,) = out["straight"]
    assert (
        straight.stdout.splitlines()[0]
        == f"starting fresh (no checkpoint in {runs[0] / 'straight'})"
    )
    killed, resumed = out["killed"]
    assert resumed.stdout.splitlines()[0] == "resumed from iter_6.pth (update 6, epoch 0)"
    stopped, resumed = out["sigint"]
    assert stopped.stderr.strip().splitlines()[-1] == (
        "interrupted at update 7, saved interrupted.pth; run the same call again to continue"
    )
    assert "Traceback" not in stopped.stderr
    assert resumed.stdout.splitlines()[0] == "resumed from interrupted.pth (update 7, epoch 0)"


@pytest.mark.parametrize("name", ["killed", "sigint"])
def test_jsonl(runs, name):
    root, _ = runs

    def read(d):
        return [
            orjson.loads(line) for line in (root / d / "metrics.jsonl").read_bytes().splitlines()
        ]

    assert _rows(read(name)) == _rows(read("straight"))


@pytest.mark.parametrize("name", ["killed", "sigint"])
def test_csv(runs, name):
    root, _ = runs

    def read(d):
        with open(root / d / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))

    assert _rows(read(name)) == _rows(read("straight"))


@pytest.mark.parametrize("name", ["killed", "sigint"])
def test_tensorboard(runs, name):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = runs

    def read(d):
        acc = EventAccumulator(str(root / d / "tb"))
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in TAGS if t != "epoch"}

    straight = read("straight")
    assert [s for s, _ in straight["val/loss"]] == [3, 6, 9, 12]
    assert read(name) == straight


def _console(text: str) -> list[tuple[int, dict[str, str], bool]]:
    """Each log line: its step, its deterministic tags and whether it ends with *best."""
    out = []
    for line in text.splitlines():
        m = re.match(r"step (\d+)(?:/\d+)?  (.*)$", line)
        if m:
            pairs = dict(re.findall(r"(\S+) (\S+)", m.group(2).replace("*best", "")))
            out.append((int(m.group(1)), {k: v for k, v in pairs.items() if k in TAGS},
                        line.endswith("*best")))  # fmt: skip
    return out


def test_console(runs):
    _, out = runs
    straight = _console(out["straight"][0].stdout)
    killed, resumed = (_console(p.stdout) for p in out["killed"])
    # the resumed run shows nothing up to update 6 (the evaluation due there runs again,
    # without a second line or a second *best), then exactly what the straight run showed
    assert min(step for step, _, _ in resumed) > 6
    assert [r for r in killed if r[0] <= 6] + resumed == straight
    assert sum(best for _, _, best in straight) >= 1


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="pip install 'ftrain[mlflow]'"
)
@pytest.mark.parametrize("name", ["killed", "sigint"])
def test_mlflow(runs, name, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read a directory store here
    root, _ = runs

    def read(d):
        client = MlflowClient(tracking_uri=(root / d / "mlruns").as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name(d).experiment_id])
        assert run.info.status == "FINISHED"
        return {t: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, t))
                for t in TAGS if t != "epoch"}  # fmt: skip

    assert read(name) == read("straight")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install 'ftrain[wandb]'")
@pytest.mark.parametrize("name", ["killed", "sigint"])
def test_wandb(runs, name):
    root, _ = runs

    def read(d):
        files = sorted((root / d / "wandb").glob("offline-run-*/run-*.wandb"))
        ids = {f.stem for f in files}
        assert len(ids) == 1, ids  # one W&B run, continued by the resumed process
        rows = [r for f in files for r in _read_wandb(f)[0]]
        return {t: sorted((r["_step"], r[t]) for r in rows if t in r) for t in TAGS}

    straight = read("straight")
    assert [s for s, _ in straight["val/loss"]] == [3, 6, 9, 12]
    assert read(name) == straight
