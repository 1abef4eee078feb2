"""Checkpoints written by ftrain 0.1.0 still resume bitwise (issue 12, item 8).

``tests/fixtures/v0.1.0`` was written by ``tests/fixtures/make_v010_checkpoint.py``
with ftrain 0.1.0 and is never regenerated; ``expected.pt`` in it holds the
parameters and EMA weights of the uninterrupted 10-update run.
"""

import shutil
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain.transforms.ema import ema_state_dict

FIXTURE = Path(__file__).parent / "fixtures" / "v0.1.0"


def _setup():
    """The fixture's run (make_v010_checkpoint.setup) with today's API: the EMAHook(momentum=0.1)
    of 0.1.0 is now the step's with_ema(decay=0.9), its saved state mapped into the transform."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 8, generator=g), torch.randn(40, 4, generator=g)
    )
    loader = StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    )

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def evaluate(state):
        x, y = data.tensors
        return {"val_loss": torch.nn.functional.mse_loss(state.model(x), y)}

    step = ftrain.with_clip(
        ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2), max_norm=1.0
    )
    step = ftrain.with_ema(step, decay=0.9)
    hooks = [
        ftrain.CheckpointHook(interval=3, by_epoch=False),
        ftrain.EvalHook(evaluate, every=3, by_epoch=False),
        ftrain.BestCheckpointHook("val_loss"),
    ]
    return step, ftrain.TrainState.create(model, opt), loader, hooks


def test_v010_run_dir_resumes_bitwise(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    expected = torch.load(run / "expected.pt", weights_only=True)
    step, state, loader, hooks = _setup()
    lp = ftrain.Loop(step, state, loader, hooks, max_steps=10, work_dir=run, resume="auto")
    state = lp.run()
    assert state.step == 10
    for got, want in zip(state.model.parameters(), expected["params"], strict=True):
        assert torch.equal(got.detach(), want)
    assert state.transforms["ema"].updates == 10  # 6 from the EMAHook's saved state, 4 more
    got_ema = ema_state_dict(state)
    assert got_ema.keys() == expected["ema"].keys()
    for k, v in expected["ema"].items():
        assert torch.equal(got_ema[k], v), k


def test_v010_weights_load(tmp_path):
    shutil.copy(FIXTURE / "iter_6.pth", tmp_path / "iter_6.pth")
    _, state, *_ = _setup()
    before = [p.detach().clone() for p in state.model.parameters()]
    ftrain.checkpoint.load_weights(state.model, tmp_path / "iter_6.pth")
    after = [p.detach() for p in state.model.parameters()]
    saved = torch.load(FIXTURE / "iter_6.pth", weights_only=True)["state"]["model"]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    for (name, _p), a in zip(state.model.named_parameters(), after, strict=True):
        assert torch.equal(a, saved[name]), name
