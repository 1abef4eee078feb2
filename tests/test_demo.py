"""The built-in demo (``python -m ftrain.demo``), run in-process on small sizes."""

from __future__ import annotations

import importlib
import math
import re
import signal
from pathlib import Path

import orjson
import pytest
import torch

import ftrain
from ftrain.demo import CharTransformer, lm_loss, main, make_dataset
from ftrain.demo.train import CharWindows, lr_schedule, make_loader

demo_train = importlib.import_module("ftrain.demo.train")  # the module (ftrain.demo.train is
# also the name of the function that ftrain.demo exports)

SMALL = [
    "--batch-size", "8",
    "--context", "32",
    "--d-model", "32",
    "--layers", "1",
    "--heads", "2",
    "--threads", "1",
    "--warmup", "5",
    "--decay-steps", "40",
    "--eval-batches", "2",
    "--sample-chars", "40",
    "--progress", "lines",
]  # fmt: skip


def _interval_losses(out: str) -> list[float]:
    """The loss column of the progress lines (``update loss grad_norm lr ...``)."""
    return [float(m.group(1)) for m in re.finditer(r"^\s+\d+\s+(\d+\.\d+)\s", out, re.M)]


def _jsonl(run_dir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def _params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.state.model.state_dict().items()}


def test_demo_loss_falls_and_writes_a_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    args = ["--steps", "30", "--accum", "2", "--log-every", "5", "--eval-every", "10"]
    result = main([*args, "--run-dir", str(run_dir), *SMALL])
    out = capsys.readouterr().out

    # the console: the measured AMP choice, the composition, a falling loss, a sample
    assert "amp: measured one micro-step" in out and "fp32" in out
    assert result.amp in ("off", "bf16")
    assert "GradAccum(every=2)" in out and "Clip('norm'" in out
    assert "activation checkpointing: none" in out
    assert f"run dir {run_dir}/: a new run of 30 updates" in out
    losses = _interval_losses(out)
    assert len(losses) == 6
    assert [loss for _, loss in result.history] == pytest.approx(losses, abs=1e-3)
    assert losses[-1] < losses[0] - 0.3, losses  # ln(96) = 4.56 at the start
    assert result.state.step == 30 and result.state.micro_step == 60
    assert "sample:" in out and len(result.sample) == len("def ") + 40
    assert result.val_loss == result.val_loss and result.val_loss < 4.0

    # the run directory: periodic (max_keep=2) and best checkpoints, JSONL, TensorBoard
    names = {p.name for p in run_dir.iterdir()}
    assert {"iter_20.pth", "iter_30.pth", "manifest.json", "metrics.jsonl", "tb"} <= names
    assert "iter_10.pth" not in names  # pruned by max_keep
    best = [n for n in names if n.startswith("best_val_loss_iter_")]
    assert len(best) == 1, names
    assert "interrupted.pth" not in names  # only written when a run is interrupted

    records = _jsonl(run_dir)
    train_logs = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_logs] == [5, 10, 15, 20, 25, 30]
    assert [r["loss"] for r in train_logs] == pytest.approx(losses, abs=1e-3)
    # the schedule hook: update k ran with the learning rate lr_schedule(k - 1)
    sched = lr_schedule(3e-3, warmup=5, decay_steps=40)
    assert [r["lr"] for r in train_logs] == pytest.approx(
        [sched(r["step"] - 1) for r in train_logs]
    )
    val = [(r["step"], r["val/loss"]) for r in records if "val/loss" in r]
    assert [s for s, _ in val] == [10, 20, 30]
    assert val[-1][1] == pytest.approx(result.val_loss)
    best_step = min(val, key=lambda sv: sv[1])[0]
    assert best == [f"best_val_loss_iter_{best_step}.pth"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert {"loss", "lr", "grad_norm", "val/loss"} <= set(acc.Tags()["scalars"])
    tb_loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb_loss] == [5, 10, 15, 20, 25, 30]
    assert [v for _, v in tb_loss] == pytest.approx(losses, abs=1e-3)

    # the checkpoint holds the whole run: loadable into a fresh loop
    saved = ftrain.checkpoint.load_checkpoint(run_dir / "iter_30.pth")
    assert saved["state"]["step"] == 30 and saved["hooks"]["demo_config"]["d_model"] == 32


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_demo_amp_override(amp: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "4", "--accum", "3", "--amp", amp, "--log-every", "2", *SMALL]
    result = main([*argv, "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"amp: {amp} (from --amp)" in out and "measured" not in out
    assert result.amp == amp and "Amp(dtype=" in out
    assert result.state.step == 4 and len(_interval_losses(out)) == 2
    assert all(loss == loss for _, loss in result.history)


@pytest.mark.parametrize("plan", ["blocks", "dynamic"])
def test_demo_checkpoint_plan(
    plan: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--steps", "6", "--amp", "off", "--layers", "2", "--checkpoint-plan", plan]
    result = main([*SMALL, "--run-dir", str(tmp_path), *argv])  # the later --layers wins
    out = capsys.readouterr().out
    kind = "PatternPlan" if plan == "blocks" else "DynamicPlan"
    assert re.search(rf"^step: .*ActivationCheckpoint\(plan={kind}", out, re.M), out
    checkpointed = [r["checkpointed_modules"] for r in _jsonl(tmp_path) if "loss" in r]
    assert checkpointed and all(0 <= n <= 2 for n in checkpointed)
    if plan == "blocks":
        assert "activation checkpointing: every block" in out and checkpointed[-1] == 2
    else:
        assert "activation checkpointing: dynamic, budget" in out
    assert result.state.step == 6


def test_demo_resumes_exactly_and_does_not_retrain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["--amp", "off", "--log-every", "2", "--eval-every", "4", *SMALL]
    run, straight = tmp_path / "run", tmp_path / "straight"

    # one uninterrupted run of 20 updates
    reference = _params(main(["--steps", "20", "--run-dir", str(straight), *base]))
    capsys.readouterr()

    # 10 updates, then the same command with --steps 20: it continues at update 10
    first = main(["--steps", "10", "--run-dir", str(run), *base])
    assert first.state.step == 10 and first.resumed_from is None
    capsys.readouterr()
    second = main(["--steps", "20", "--run-dir", str(run), *base])
    out = capsys.readouterr().out
    assert f"resuming from {run / 'iter_10.pth'} at update 10 of 20" in out
    assert "amp: off" in out and "measured" not in out
    assert second.start_step == 10 and second.state.step == 20 and second.trained
    assert second.state.micro_step == 40  # 20 updates of 2 micro-batches in all
    assert second.history[0][0] == 12  # the first progress line of this run
    final = _params(second)
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(final[name], reference[name]), name  # bitwise, on the CPU
    steps = [r["step"] for r in _jsonl(run) if "loss" in r]
    assert steps == list(range(2, 21, 2))  # one line per logged step, continued

    # run again: it has finished, so it says so and trains nothing
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}
    jsonl = (run / "metrics.jsonl").read_bytes()
    again = main(["--steps", "20", "--run-dir", str(run), *base])
    out = capsys.readouterr().out
    assert "this run already finished" in out and "nothing to train" in out
    assert not again.trained and again.state.step == 20 and not _interval_losses(out)
    assert all(torch.equal(v, final[k]) for k, v in _params(again).items())
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()} == before
    assert (run / "metrics.jsonl").read_bytes() == jsonl

    # a setting that defines the run cannot change under it
    with pytest.raises(SystemExit, match="--d-model 64"):
        main(["--steps", "30", "--run-dir", str(run), *base, "--d-model", "64"])

    # Ctrl-C at update 7 saves interrupted.pth; the same command then resumes from it
    def interrupt_at_7(events):
        for ev in events:
            if isinstance(ev, ftrain.events.StepEnd) and ev.is_update and ev.state.step == 7:
                signal.raise_signal(signal.SIGINT)  # the loop turns it into KeyboardInterrupt
            yield ev

    build_hooks = demo_train.build_hooks

    def with_interrupt(*a, **k):
        hooks, table = build_hooks(*a, **k)
        return hooks.add(ftrain.hook(interrupt_at_7)), table

    cut = tmp_path / "cut"
    monkeypatch.setattr(demo_train, "build_hooks", with_interrupt)
    with pytest.raises(KeyboardInterrupt):
        main(["--steps", "20", "--run-dir", str(cut), *base])
    monkeypatch.setattr(demo_train, "build_hooks", build_hooks)
    out = capsys.readouterr().out
    assert "Ctrl-C: stopped at update 7" in out and (cut / "interrupted.pth").exists()
    resumed = main(["--steps", "20", "--run-dir", str(cut), *base])
    assert "at update 7 of 20" in capsys.readouterr().out
    assert resumed.start_step == 7 and resumed.state.step == 20
    assert all(torch.equal(v, reference[k]) for k, v in _params(resumed).items())
    assert not (cut / "interrupted.pth").exists()  # removed once the run completed

    # --fresh starts over: the earlier run's files go, a new run begins at update 0
    restart = main(["--steps", "4", "--run-dir", str(run), "--fresh", *base])
    out = capsys.readouterr().out
    assert "starting over" in out and restart.start_step == 0 and restart.state.step == 4
    assert not (run / "iter_20.pth").exists() and (run / "iter_4.pth").exists()
    assert [r["step"] for r in _jsonl(run) if "loss" in r] == [2, 4]


def test_dataset_loader_and_model_are_reusable() -> None:
    data = make_dataset(context=16)
    assert data.vocab_size > 60 and data.decode(data.encode("import os")) == "import os"
    x, y = data.sample(4, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    first = next(data.batches(4, seed=3))
    again = next(data.batches(4, seed=3))
    assert torch.equal(first[0], again[0])  # batches come from their own seeded generator
    model = CharTransformer(data.vocab_size, context=16, d_model=32, n_layers=1, n_heads=2)
    loss = lm_loss(model, (x, y))
    assert abs(loss.item() - torch.log(torch.tensor(float(data.vocab_size))).item()) < 0.5

    # the training loader: every window, batched in one gather, resumable mid-epoch
    windows = CharWindows(data.train, 16)
    bx, by = windows.__getitems__([0, 5])
    assert torch.equal(bx[1], windows[5][0]) and torch.equal(by[1], windows[5][1])
    loader = make_loader(data, 4, seed=1)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    expected = [next(it)[0] for _ in range(2)]
    other = make_loader(data, 4, seed=1)
    other.load_state_dict(state)
    it = iter(other)
    assert all(torch.equal(next(it)[0], e) for e in expected)


def test_lr_schedule() -> None:
    s = lr_schedule(1e-3, warmup=10, decay_steps=100)
    assert s(0) == pytest.approx(1e-4)  # warm-up starts at 0.1 x lr
    assert all(s(k) < s(k + 1) for k in range(9))  # and rises linearly
    assert s(10) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.1))))
    assert s(100) == pytest.approx(1e-4) and s(1000) == pytest.approx(1e-4)  # 0.1 x, then held
    assert lr_schedule(1e-3, warmup=10, decay_steps=100) == s  # a value: pure in the step
