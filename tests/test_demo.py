"""The built-in demo (``python -m ftrain.demo``), run in-process with few updates."""

from __future__ import annotations

import doctest
import importlib
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

import ftrain
from ftrain.demo import CharTransformer, corpus, loss_fn, main

demo = importlib.import_module("ftrain.demo.train")


@pytest.fixture(autouse=True)
def _one_thread():
    """One CPU thread (as the demo sets unless OMP_NUM_THREADS says), then the suite's again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_losses(out: str) -> list[float]:
    """The loss of each progress line (``step 4/20  loss 3.1234 ...``)."""
    return [float(m) for m in re.findall(r"^step \d+/\d+  loss (\d+\.\d+)", out, re.M)]


def _jsonl(run_dir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def _params(state: ftrain.TrainState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def test_demo_learns_prints_text_and_writes_a_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    state = main(["--steps", "20", "--lines", "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    vocab = len(set(corpus()))

    # the loss falls from about ln(vocabulary) (a uniform guess), on the console and on disk
    losses = _train_losses(out)
    assert len(losses) == 10 and losses[0] > math.log(vocab) - 0.6, out
    assert losses[-1] < losses[0] - 0.8, losses
    records = _jsonl(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(2, 21, 2))
    assert [r["loss"] for r in train] == pytest.approx(losses, abs=1e-4)
    val = [(r["step"], r["val/loss"]) for r in records if "val/loss" in r]
    assert [s for s, _ in val] == [4, 8, 12, 16, 20]
    assert val[-1][1] < val[0][1] < math.log(vocab)

    # generated text: a short sample at each evaluation, a longer one at the end
    samples = re.findall(r"^  sample at update (\d+): (.*)$", out, re.M)
    assert [int(s) for s, _ in samples] == [4, 8, 12, 16, 20]
    final = out.split("\nsample:\n", 1)[1]
    assert final.startswith("def ") and len(final) > 200
    assert state.step == 20 and state.micro_step == 20

    # the run directory: what the library's default hooks, EvalHook and BestCheckpointHook wrote
    names = {p.name for p in run_dir.iterdir()}
    assert {"iter_16.pth", "iter_20.pth", "manifest.json", "metrics.jsonl", "tb"} <= names
    assert "iter_12.pth" not in names  # max_keep=2
    best_step = min(val, key=lambda sv: sv[1])[0]
    assert f"best_val_loss_iter_{best_step}.pth" in names
    assert "run again to resume, with --steps 40 to train further" in out


def test_demo_resumes_exactly_and_a_finished_run_trains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, straight = tmp_path / "run", tmp_path / "straight"
    reference = _params(main(["--steps", "12", "--lines", "--run-dir", str(straight)]))

    # Ctrl-C during update 5 of 6: the library saves interrupted.pth, the demo says how to go on
    calls = []

    def interrupting(model, batch):
        if torch.is_grad_enabled():  # a training step, not an evaluation
            calls.append(1)
            if len(calls) == 5:
                signal.raise_signal(signal.SIGINT)  # the loop stops at the end of this update
        return loss_fn(model, batch)

    monkeypatch.setattr(demo, "loss_fn", interrupting)
    with pytest.raises(SystemExit) as stopped:
        main(["--steps", "6", "--lines", "--run-dir", str(run)])
    monkeypatch.undo()
    assert stopped.value.code == 130 and (run / "interrupted.pth").is_file()
    assert isinstance(stopped.value, KeyboardInterrupt)  # a script's Ctrl-C, exiting 130
    said = capsys.readouterr()
    assert "starting fresh" in said.out  # the library says how each run starts...
    line = "interrupted at update 5, saved interrupted.pth; run the same call again to continue"
    assert said.err.strip().splitlines()[-1] == line  # ...and where Ctrl-C left it

    # the same command finishes the run; with more --steps it goes on from iter_6.pth:
    # bitwise what the uninterrupted run computed
    main(["--steps", "6", "--lines", "--run-dir", str(run)])
    out = capsys.readouterr().out
    assert "(this run resumed from interrupted.pth)" in out
    assert "resumed from interrupted.pth (update 5, epoch 0)" in out.splitlines()  # the library
    state = main(["--steps", "12", "--lines", "--run-dir", str(run)])
    out = capsys.readouterr().out
    assert re.findall(r"^step (\d+)/12  loss", out, re.M) == ["7", "8", "9", "10", "11", "12"]
    assert "(this run resumed from iter_6.pth)" in out
    assert state.step == 12
    final = _params(state)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference)  # on the CPU
    assert [r["step"] for r in _jsonl(run) if "loss" in r] == list(range(1, 13))
    assert not (run / "interrupted.pth").exists()  # the library removes it once passed

    # once more: nothing left to train, the same model writes the same sample
    again = main(["--steps", "12", "--lines", "--run-dir", str(run)])
    out2 = capsys.readouterr().out
    assert not _train_losses(out2) and again.step == 12
    assert all(torch.equal(v, final[k]) for k, v in _params(again).items())
    assert out2.split("\nsample:\n")[1].split("\n")[0] == out.split("\nsample:\n")[1].split("\n")[0]


def test_command_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ftrain.demo", "--help"], capture_output=True, text=True, check=True
    )
    flags = set(re.findall(r"--[a-z-]+", proc.stdout))
    assert flags == {"--help", "--steps", "--run-dir", "--lines", "--device"}, proc.stdout
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "0"])


def test_corpus_model_and_loss() -> None:
    text = corpus()
    assert 150_000 < len(text) < 250_000 and text.isascii() and text == corpus()
    assert " at 0x" not in text  # no memory addresses: the same text in every process
    model = CharTransformer(vocab_size=20, context=8, d_model=32, layers=1)
    x = torch.randint(20, (3, 8))
    loss = loss_fn(model, (x, x))
    assert abs(loss.item() - math.log(20)) < 0.5  # about a uniform guess when untrained
    # causal: changing a later character changes no earlier prediction
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1) % 20
    assert torch.allclose(model(x)[:, :5], model(y)[:, :5], atol=1e-6)
    assert not torch.allclose(model(x)[:, 5:], model(y)[:, 5:])
    assert doctest.testmod(demo).failed == 0
