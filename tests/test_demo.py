"""The built-in demo (``python -m ftrain.demo``), run in-process on small sizes."""

from __future__ import annotations

import re

import pytest
import torch

from ftrain.demo import CharTransformer, lm_loss, main, make_dataset
from ftrain.demo.train import lr_at

SMALL = [
    "--batch-size", "8",
    "--context", "32",
    "--d-model", "32",
    "--layers", "1",
    "--heads", "2",
    "--threads", "1",
    "--warmup", "5",
    "--eval-batches", "2",
    "--sample-chars", "40",
]  # fmt: skip


def _interval_losses(out: str) -> list[float]:
    """The loss column of the progress lines (``update loss grad_norm lr ...``)."""
    return [float(m.group(1)) for m in re.finditer(r"^\s+\d+\s+(\d+\.\d+)\s", out, re.M)]


def test_demo_loss_falls_and_prints(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--steps", "30", "--accum", "2", *SMALL])
    out = capsys.readouterr().out

    assert "amp: measured one micro-step" in out and "fp32" in out  # the auto choice, timed
    assert result.amp in ("off", "bf16")
    assert "GradAccum(every=2)" in out and "Clip('norm'" in out
    losses = _interval_losses(out)
    assert len(losses) >= 5
    assert [loss for _, loss in result.history] == pytest.approx(losses, abs=1e-3)
    assert losses[-1] < losses[0] - 0.3, losses  # ln(96) = 4.56 at the start
    assert result.state.step == 30 and result.state.micro_step == 60
    assert "sample:" in out and len(result.sample) == len("def ") + 40
    assert result.val_loss == result.val_loss  # finite, not NaN


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_demo_amp_override(amp: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--steps", "4", "--accum", "3", "--amp", amp, "--log-every", "2", *SMALL])
    out = capsys.readouterr().out
    assert f"amp: {amp} (from --amp)" in out
    assert result.amp == amp and "Amp(dtype=" in out
    assert result.state.step == 4 and len(_interval_losses(out)) == 2
    assert all(loss == loss for _, loss in result.history)


def test_dataset_and_model_are_reusable() -> None:
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


def test_lr_schedule() -> None:
    assert lr_at(0, warmup=10, total=100) == pytest.approx(0.1)
    assert lr_at(9, warmup=10, total=100) == pytest.approx(1.0)
    assert lr_at(100, warmup=10, total=100) == pytest.approx(0.1)
