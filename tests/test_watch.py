"""Watching a run (issue 16): throughput, FLOPs, memory, the CSV / MLflow / W&B sinks,
the model summary and what the console shows.

References are independent of the code under test: a plain PyTorch loop's
losses, closed-form FLOP counts, batch sizes and step counts the test chose,
the files each tracker wrote (read back with the tracker's own client or
format), and ``resource.getrusage``.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import torch
from helpers import make_batches, make_model, mean, mse_loss, plain_losses, read_jsonl

import ftrain
from ftrain.hooks.logging import LoggerHook
from ftrain.hooks.monitor import Throughput, count_flops, memory_stats, peak_flops_for
from ftrain.hooks.sinks import ConsoleSink, CsvSink, MLflowSink, Start, WandbSink, flatten_config
from ftrain.hooks.sinks import console as console_mod
from ftrain.hooks.timer import TimerHook
from ftrain.summary import model_summary


def new_state(seed=0, lr=0.1, opt="sgd"):
    model = make_model(seed)
    if opt == "adamw":
        return ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=lr))
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=lr))


# ------------------------------------------------------------ throughput
def test_samples_tokens_and_times_match_counted_steps(tmp_path):
    batches = make_batches(12, batch_size=8)  # 8 samples per micro-batch

    def loss_fn(model, batch):
        loss = mse_loss(model, batch)
        return loss, {"ntok": torch.tensor(float(batch[0].shape[0] * 3))}  # 24 per batch

    throughput = Throughput(tokens="ntok")
    hooks = [
        TimerHook(skip_first_k=0),
        LoggerHook(every=4, progress=False, tensorboard=False, throughput=throughput),
    ]
    ftrain.Loop(
        ftrain.make_step(loss_fn), new_state(), batches, hooks, epochs=1, work_dir=tmp_path
    ).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [4, 8, 12]
    for r in records:
        # 4 micro-batches of 8 samples (24 tokens) per interval, iter_time seconds each
        assert r["perf/samples_per_s"] == pytest.approx(8 / r["iter_time"], rel=1e-9)
        assert r["perf/tokens_per_s"] == pytest.approx(24 / r["iter_time"], rel=1e-9)
        assert r["compute_time"] == pytest.approx(r["iter_time"] - r["data_time"], abs=1e-12)
        assert r["compute_time"] >= 0 and r["data_time"] >= 0
        assert "perf/mfu" not in r  # no FLOPs asked for


def test_batch_size_function_and_accumulation(tmp_path):
    batches = make_batches(8, batch_size=6)
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=2)
    hooks = [
        TimerHook(skip_first_k=0),
        LoggerHook(
            every=2,
            progress=False,
            tensorboard=False,
            throughput=Throughput(batch_size=lambda b: len(b[0]) * 10, tokens=7),
        ),
    ]
    ftrain.Loop(step, new_state(), batches, hooks, epochs=1, work_dir=tmp_path).run()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4]  # 4 micro-batches per log
    for r in records:  # iter_time is per micro-batch
        assert r["perf/samples_per_s"] == pytest.approx(60 / r["iter_time"], rel=1e-9)
        assert r["perf/tokens_per_s"] == pytest.approx(7 / r["iter_time"], rel=1e-9)


def test_flop_counter_matches_the_closed_form_of_a_linear_layer():
    m, k, n = 16, 32, 8
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k)
    # forward m x k @ k x n: 2mnk; backward to the weight: 2mnk (x needs no gradient)
    assert count_flops(lambda mod, b: mod(b).sum(), lin, x) == 4 * m * n * k
    x.requires_grad_(True)
    assert count_flops(lambda mod, b: mod(b).sum(), lin, x) == 4 * m * n * k  # weights only


def test_flop_counting_leaves_grads_rng_and_buffers_alone():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    rng = torch.get_rng_state()
    flops = count_flops(lambda mod, b: mod(b).pow(2).mean(), model, x)
    assert flops == 4 * 5 * 4 * 8
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_mfu_against_a_given_peak(tmp_path):
    batches = make_batches(8, batch_size=8)
    peak = 1e9
    hooks = [
        TimerHook(skip_first_k=0),
        LoggerHook(
            every=4,
            progress=False,
            tensorboard=False,
            throughput=Throughput(flops="auto", peak_flops=peak),
        ),
    ]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks, epochs=1, work_dir=tmp_path
    ).run()
    model = make_model(0)
    # the MLP's FLOPs per micro-batch, counted on a fresh model with the same shapes
    expected = count_flops(mse_loss, model, batches[0])
    lin = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
    # 2mnk each for the forward, the weight gradient and (past the first layer, whose
    # input needs none) the input gradient
    closed = 4 * 8 * lin[0].in_features * lin[0].out_features + sum(
        6 * 8 * mod.in_features * mod.out_features for mod in lin[1:]
    )
    assert expected == closed
    for r in read_jsonl(tmp_path / "metrics.jsonl"):
        assert r["perf/tflops"] == pytest.approx(expected / r["iter_time"] / 1e12, rel=1e-9)
        assert r["perf/mfu"] == pytest.approx(expected / r["iter_time"] / peak, rel=1e-9)


def test_peak_table_and_memory_counters():
    assert peak_flops_for("NVIDIA H200") == 989.4e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("Intel Xeon") is None
    stats = memory_stats("cpu")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**20
    assert stats["memory/rss_peak_mib"] == pytest.approx(rss, rel=0.05)
    assert "memory/max_allocated_mib" not in stats  # CPU model: no CUDA counters


def test_throughput_arguments_are_checked():
    with pytest.raises(TypeError, match="flops"):
        Throughput(flops="lots")
    with pytest.raises(ValueError, match="peak_flops"):
        Throughput(peak_flops=0)
    with pytest.raises(TypeError, match="batch_size"):
        Throughput(batch_size=True)
    with pytest.raises(TypeError, match="Throughput"):
        LoggerHook(throughput="yes")


# ------------------------------------------------------------------ sinks
def test_csv_sink_holds_the_plain_loop_losses_and_grows_columns(tmp_path):
    batches = make_batches(6)

    def evaluate(state):
        return {"val_loss": torch.tensor(0.5)}

    hooks = [
        TimerHook(skip_first_k=0),
        ftrain.EvalHook(evaluate, every=3, by_epoch=False),
        LoggerHook(every=2, progress=False, tensorboard=False, jsonl=False, sinks=["csv"]),
    ]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks, epochs=1, work_dir=tmp_path
    ).run()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["loss"]]
    evals = [r for r in rows if r["val/loss"]]
    assert [int(r["step"]) for r in train] == [2, 4, 6]
    assert [(int(r["step"]), float(r["val/loss"])) for r in evals] == [(3, 0.5), (6, 0.5)]
    losses = plain_losses(batches)
    for r in train:
        s = int(r["step"])
        assert float(r["loss"]) == pytest.approx(mean(losses[s - 2 : s]), rel=1e-6)
    # a resumed run keeps the rows up to its step and appends
    sink = CsvSink(tmp_path / "metrics.csv")
    sink.start(Start(step=4, resumed_from="iter_4.pth"))  # a checkpoint without a row count
    sink.write(5, {"loss": 1.0, "new_tag": 2.0})
    sink.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 3, 4, 5]
    assert rows[-1]["new_tag"] == "2.0" and rows[0]["new_tag"] == ""


def test_named_sinks_need_a_work_dir_and_known_names():
    with pytest.raises(ValueError, match="'csv', 'mlflow', 'wandb'"):
        LoggerHook(sinks=["ftp"])
    state = new_state()
    with pytest.raises(ValueError, match="needs a directory"):
        ftrain.Loop(
            ftrain.make_step(mse_loss),
            state,
            make_batches(2),
            [LoggerHook(progress=False, sinks=["csv"])],
        ).run()


def _missing_module_env(tmp_path, module):
    """An environment where importing ``module`` fails (a sitecustomize that blocks it)."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r} or name.startswith({module!r} + '.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(block), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize(
    "module, code, extra",
    [
        ("mlflow", "MLflowSink('x')", "ftrain[mlflow]"),
        ("wandb", "WandbSink(dir='x')", "ftrain[wandb]"),
    ],
)
def test_a_missing_tracker_names_its_extra(tmp_path, module, code, extra):
    env = _missing_module_env(tmp_path, module)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from ftrain.hooks.sinks import MLflowSink, WandbSink\n{code}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and f"pip install '{extra}'" in proc.stderr


def _run_with(tmp_path, sinks, config=None, steps=6):
    hooks = [
        TimerHook(skip_first_k=0),
        ftrain.EvalHook(lambda s: {"val_loss": torch.tensor(0.25)}, every=3, by_epoch=False),
        LoggerHook(
            every=2, progress=False, tensorboard=False, jsonl=True, sinks=sinks, config=config
        ),
    ]
    batches = make_batches(steps)
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks, epochs=1, work_dir=tmp_path
    ).run()
    return plain_losses(batches)


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="pip install 'ftrain[mlflow]'"
)
def test_mlflow_store_read_back_with_mlflows_client(tmp_path):
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    sink = MLflowSink(store, experiment="watch", run_name="r1")
    losses = _run_with(tmp_path, [sink], config={"seed": 3, "data": {"root": "/d"}})
    client = MlflowClient(tracking_uri=store.as_uri())
    exp = client.get_experiment_by_name("watch")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [2, 4, 6]
    for m in history:
        assert m.value == pytest.approx(mean(losses[m.step - 2 : m.step]), rel=1e-6)
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert [(m.step, m.value) for m in val] == [(3, 0.25), (6, 0.25)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "perf/samples_per_s")] == [
        2,
        4,
        6,
    ]
    params = run.data.params
    assert params["seed"] == "3" and params["data.root"] == "/d"
    assert params["optimizer"] == "SGD" and params["optimizer.lr"] == "0.1"
    assert params["model.params"] == str(sum(p.numel() for p in make_model(0).parameters()))
    assert "epoch" not in run.data.metrics  # the x axis is the step


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install 'ftrain[wandb]'")
def test_wandb_offline_run_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(project="watch", dir=tmp_path / "wb")
    losses = _run_with(tmp_path, [sink], config={"seed": 3})
    (run_file,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's service process may still be writing the file when finish() returns: wait
    # (a bounded time) for its exit record
    deadline = time.monotonic() + 30
    while True:
        history, config, kinds = _read_wandb(run_file)
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "exit" in kinds, kinds
    train = [h for h in history if "loss" in h]
    assert [h["_step"] for h in train] == [2, 4, 6]
    for h in train:
        assert h["loss"] == pytest.approx(mean(losses[h["_step"] - 2 : h["_step"]]), rel=1e-6)
        assert h["perf/samples_per_s"] > 0
    evals = [h for h in history if "val/loss" in h]
    assert [(h["_step"], h["val/loss"]) for h in evals] == [(3, 0.25), (6, 0.25)]
    assert config["seed"] == 3 and config["optimizer"] == "SGD"


def _wandb_records(path: Path):
    """The records of a W&B transaction log (LevelDB log format: 32 KiB blocks, 7-byte headers)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            pos += left - 7
            continue
        if pos + length > len(data):
            return  # a record still being written
        chunks += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            yield chunks
            chunks = b""


def _read_wandb(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    history, config, kinds = [], {}, []
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = orjson.loads(item.value_json)
            history.append(row)
        elif kind == "config":
            for item in rec.config.update:
                key = item.key or "/".join(item.nested_key)
                config[key] = orjson.loads(item.value_json)
    return history, config, kinds


def test_flatten_config():
    assert flatten_config({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {
        "a.b": 1,
        "a.c": "[1, 2]",
        "d": None,
    }


# ---------------------------------------------------------------- summary
def test_model_summary_counts_per_top_level_module():
    model = torch.nn.Sequential()
    model.add_module("backbone", torch.nn.Linear(10, 20))  # 220
    model.add_module("head", torch.nn.Linear(20, 3))  # 63
    model.add_module("bn", torch.nn.BatchNorm1d(3))  # 6 params, 3 + 3 + 1 buffers
    model.head.weight.requires_grad_(False)  # 60 frozen
    state = ftrain.TrainState.create(
        model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    )
    s = model_summary(state)
    assert s.rows == [("backbone", 220, 220), ("head", 63, 3), ("bn", 6, 6)]
    assert (s.params, s.trainable) == (289, 229)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert s.weight_bytes == 289 * 4 + buffers
    assert s.grad_bytes == 229 * 4
    assert s.optimizer_bytes == 2 * 229 * 4 and s.optimizer_estimated  # AdamW: 2 per param
    text = str(s)
    assert "289 parameters (229 trainable)" in text and "backbone" in text
    # after a step the optimizer state is measured, not estimated
    step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
    state, _ = step(state, torch.randn(4, 10))
    measured = model_summary(state)
    exp_avg = sum(
        v.numel() * v.element_size()
        for st in state.optimizer.state.values()
        for v in st.values()
        if v.dim() > 0
    )
    assert measured.optimizer_bytes == exp_avg == 2 * 229 * 4
    assert not measured.optimizer_estimated


def test_default_hooks_print_the_summary_once_and_sinks_get_it(tmp_path, capsys):
    hooks = ftrain.default_hooks(log_every=2, progress=False, sinks=["csv"])
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(4), hooks, work_dir=tmp_path
    ).run()
    out = capsys.readouterr().out
    assert out.count("model MLP:") == 1
    total = sum(p.numel() for p in make_model(0).parameters())
    assert f"{total:,} parameters" in out


# ---------------------------------------------------------------- console
def test_console_is_quiet_marks_best_and_keeps_epoch_logs_in_files(tmp_path, capsys):
    batches = make_batches(3)  # 3 updates per epoch, logs every 2: epoch ends fall between
    values = iter([0.5, 0.7, 0.4])
    hooks = [
        TimerHook(skip_first_k=0),
        ftrain.EvalHook(lambda s: {"val_loss": next(values)}, every=1),
        LoggerHook(every=2, progress=False, tensorboard=False),
        ftrain.BestCheckpointHook("val_loss"),
    ]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), batches, hooks, epochs=3, work_dir=tmp_path
    ).run()
    lines = capsys.readouterr().out.splitlines()
    train = [ln for ln in lines if "loss " in ln and "val/" not in ln]
    evals = [ln for ln in lines if "val/loss" in ln]
    assert [ln.split()[1] for ln in train] == ["2", "4", "6", "8", "9"]  # 9: the run's end
    assert [ln.endswith("*best") for ln in evals] == [True, False, True]
    assert all("val/val_loss" not in ln for ln in lines)
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert steps == [2, 3, 4, 6, 8, 9]  # the files keep the epoch-end logs (3, 6, 9)


def test_console_keys_bar_format_and_eta_of_a_huge_run(capsys):
    sink = ConsoleSink(progress=False, keys=["loss", "data_time"])
    sink.write(3, {"loss": 0.5, "lr": 0.1, "data_time": 0.001, "epoch": 0})
    assert capsys.readouterr().out.strip() == "step 3  loss 0.5000  data_time 0.0010  epoch 0"
    ConsoleSink(progress=False).write(
        1, {"eta": 68204 * 86400.0, "memory/rss_peak_mib": 100.0, "perf/samples_per_s": 1234.5}
    )
    assert capsys.readouterr().out.strip() == "step 1  eta > 1 year  samples/s 1234"


def test_progress_bar_format_is_customisable(monkeypatch):
    import io

    monkeypatch.setattr(console_mod, "_bar_can_show", lambda: True)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    stream = io.StringIO()
    sink = ConsoleSink(
        progress=True,
        bar_format="<{n}|{postfix}>",
        postfix=("acc",),
        bar_kwargs={"file": stream, "ascii": True},
    )
    sink.bar.total = 10
    sink.write(4, {"acc": 0.75, "loss": 1.0})
    sink.close()
    assert "acc 0.7500>" in stream.getvalue()
    assert "loss" not in stream.getvalue()


def test_relative_file_paths_are_inside_work_dir(tmp_path, monkeypatch):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    work = tmp_path / "work"
    hooks = [LoggerHook(every=1, progress=False, tensorboard="log", jsonl="logs/m.jsonl")]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(2), hooks, work_dir=work
    ).run()
    assert list((work / "log").glob("events.out.tfevents.*"))
    assert (work / "logs" / "m.jsonl").is_file()
    assert not any(elsewhere.iterdir())


def test_torchdata_set_vital_warning_is_silenced_narrowly():
    code = (
        "import warnings, torch, ftrain\n"
        "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        "ds = torch.utils.data.TensorDataset(torch.zeros(4, 2))\n"
        "list(StatefulDataLoader(ds, batch_size=2))\n"
        "warnings.warn(\"'set_vital' is deprecated (someone else)\")\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "torchdata" not in proc.stderr
    assert "someone else" in proc.stderr  # only torchdata's own call is filtered


def test_the_watching_page_examples_run(tmp_path):
    """Every Python block of docs/watching.md, in order, as one script in a fresh process
    (MLflow's read-back included: with no MLFLOW_ALLOW_FILE_STORE but the page's own)."""
    import re

    pytest.importorskip("mlflow", reason="the page's MLflow blocks: pip install 'ftrain[mlflow]'")
    root = Path(__file__).resolve().parent.parent
    page = root / "docs" / "watching.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 6
    script = "".join(f"# docs/watching.md python block {i + 1}\n{b}\n" for i, b in enumerate(blocks))
    script += (
        "print('CHECK', rows[0]['step'], float(rows[0]['loss']) > 0, "
        "[s for s, _ in mine.rows], run.info.status, len(losses))\n"
    )
    (tmp_path / "page.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "model Linear: 17 parameters" in proc.stdout and "mfu" in proc.stdout
    assert "CHECK 5 True [5, 10, 15, 20] FINISHED 4" in proc.stdout, proc.stdout[-2000:]


def test_readme_run_is_quiet_and_marks_the_best(tmp_path, monkeypatch, capsys):
    """Issue 16: the README's 100 updates printed 29 lines (and val/val_loss, no *best)."""
    import re

    readme = Path(__file__).resolve().parent.parent / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.S)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # lines, as in a pipe or CI log
    namespace: dict = {}
    run = next(i for i, code in enumerate(blocks) if "runs/readme" in code)
    for i in (0, run):  # the step, then the run
        exec(compile(blocks[i], f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    lines = capsys.readouterr().out.splitlines()
    train = [ln for ln in lines if ln.startswith("step ") and "val/" not in ln]
    evals = [ln for ln in lines if "val/" in ln]
    assert [ln.split()[1] for ln in train] == ["20/100", "40/100", "60/100", "80/100", "100/100"]
    assert len(evals) == 4 and all("val/loss" in ln for ln in evals)
    assert not any("val/val_loss" in ln for ln in lines)
    assert evals[0].endswith("*best")  # the first evaluation is always a new best
    assert len(lines) <= 15, lines  # 5 logs, 4 evaluations, the model summary


def test_bar_mode_keeps_the_best_marker(monkeypatch, capsys):
    import io

    monkeypatch.setattr(console_mod, "_bar_can_show", lambda: True)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    sink = ConsoleSink(progress=True, bar_kwargs={"file": io.StringIO()})
    assert sink.bar is not None
    sink.write_eval(25, {"val/loss": 0.5, "epoch": 1}, best=["val/loss"])
    sink.write_eval(50, {"val/loss": 0.7, "epoch": 2})
    sink.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert lines == [
        "step 25  val/loss 0.5000  epoch 1  *best",
        "step 50  val/loss 0.7000  epoch 2",
    ]
