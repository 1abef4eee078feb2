"""Checkpoints written by ftrain 0.1.0 still resume bitwise (issue 12, item 8).

``tests/fixtures/v0.1.0`` was written by ``tests/fixtures/make_v010_checkpoint.py``
with ftrain 0.1.0 and is never regenerated; ``expected.pt`` in it holds the
parameters and EMA weights of the uninterrupted 10-update run.
"""

import importlib.util
import shutil
from pathlib import Path

import torch

import ftrain

FIXTURE = Path(__file__).parent / "fixtures" / "v0.1.0"


def _maker():
    spec = importlib.util.spec_from_file_location("make_v010", FIXTURE.parent / "make_v010_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_v010_run_dir_resumes_bitwise(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    expected = torch.load(run / "expected.pt", weights_only=True)
    step, state, loader, hooks, ema = _maker().setup()
    state = ftrain.fit(step, state, loader, hooks, max_steps=10, work_dir=run, resume="auto")
    assert state.step == 10
    for got, want in zip(state.model.parameters(), expected["params"], strict=True):
        assert torch.equal(got.detach(), want)
    got_ema = ema.state_dict()["module"]
    assert got_ema.keys() == expected["ema"].keys()
    for k, v in expected["ema"].items():
        assert torch.equal(got_ema[k], v), k


def test_v010_weights_load(tmp_path):
    shutil.copy(FIXTURE / "iter_6.pth", tmp_path / "iter_6.pth")
    _, state, *_ = _maker().setup()
    before = [p.detach().clone() for p in state.model.parameters()]
    ftrain.checkpoint.load_weights(state.model, tmp_path / "iter_6.pth")
    after = [p.detach() for p in state.model.parameters()]
    saved = torch.load(FIXTURE / "iter_6.pth", weights_only=True)["state"]["model"]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    for (name, _p), a in zip(state.model.named_parameters(), after, strict=True):
        assert torch.equal(a, saved[name]), name
