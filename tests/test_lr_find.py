"""The learning-rate finder (issue 22, item 4).

References: Lightning's ``Tuner(trainer).lr_find`` on the same model, data and seed; a
plain PyTorch loop with accumulation and clipping; ``numpy.gradient``; the state's own
tensors before and after.
"""

from __future__ import annotations

import copy
import doctest
import itertools
import json
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
import ftrain.checkpoint
import ftrain.lr_finder
from ftrain import schedules as S
from ftrain.lr_finder import LRFindResult, steepest_index, sweep_lr

DOCS = Path(__file__).resolve().parent.parent / "docs" / "lr_find.md"


# ------------------------------------------------------------------ Lightning
def regression_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin() + 0.1 * torch.randn(256, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def tanh_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def test_suggestion_matches_lightning_tuner(tmp_path):
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    dataset = regression_data()
    sweep = dict(min_lr=1e-4, max_lr=10.0, num_training=100)

    # Lightning 2.6: the same network, data (2 batches an epoch, in order) and seed
    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tanh_net()

        def training_step(self, batch, batch_idx):
            return mse_loss(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1000, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = Tuner(trainer).lr_find(
            Regressor(),
            train_dataloaders=torch.utils.data.DataLoader(dataset, batch_size=128),
            mode="exponential",
            early_stop_threshold=4.0,
            update_attr=False,
            **sweep,
        )
    theirs = found.suggestion()  # skip_begin=10, skip_end=1

    # ftrain
    net = tanh_net()
    state = ftrain.TrainState.create(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = torch.utils.data.DataLoader(dataset, batch_size=128)
    ours = ftrain.lr_find(ftrain.make_step(mse_loss), state, data, **sweep)

    print(f"Lightning: {len(found.results['lr'])} points, suggestion point {found._optimal_idx} "
          f"lr {theirs}; ftrain: {len(ours.lrs)} points, point {ours.index} lr {ours.suggestion} "
          f"({ours.stop_reason})")  # fmt: skip
    assert 10 < ours.index < len(ours.lrs) - 2  # a suggestion inside the curve, not at an end
    assert abs(ours.index - found._optimal_idx) <= 1
    assert ours.stop_reason == "diverged" and len(ours.lrs) == len(found.results["lr"]) < 100
    assert list(ours.lrs) == found.results["lr"]  # the same sweep, float for float
    assert np.allclose(ours.losses, found.results["loss"], rtol=1e-6, atol=0)
    assert ours.suggestion == pytest.approx(theirs, rel=0.25)  # within one sweep point


# ------------------------------------------------------------------ the state is untouched
def snapshot(state):
    return copy.deepcopy(ftrain.checkpoint.state_dict(state, rng=False))


def assert_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def full_step():
    step = ftrain.make_step(mse_loss)
    step = ftrain.with_grad_accum(step, every=2)
    step = ftrain.with_clip(step, "norm", max_norm=1.0)
    step = ftrain.with_schedule(step, lr=S.cosine(0.05, total=100))
    return ftrain.with_ema(step, decay=0.9)


def test_the_state_is_untouched_no_file_is_written_and_rng_is_restored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = make_model(0, dropout=0.3)  # dropout draws from the global generator
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    step = full_step()
    for batch in make_batches(4):  # two updates: Adam moments, an EMA, a schedule position
        state, _ = step(state, batch)
    before = snapshot(state)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                            for g in state.optimizer.param_groups])  # fmt: skip
    torch.manual_seed(123)
    result = ftrain.lr_find(step, state, make_batches(6), min_lr=1e-4, max_lr=1.0, num_training=8)
    drawn = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(drawn, torch.rand(4))  # the generators are where they were
    assert len(result.lrs) == 8 and result.stop_reason == "completed"
    assert not state.is_consumed and (state.step, state.micro_step) == (2, 4)
    assert_equal(snapshot(state), before)  # model, optimizer, transforms, bitwise
    assert [{k: v for k, v in g.items() if k != "params"}
            for g in state.optimizer.param_groups] == groups  # fmt: skip
    assert os.listdir(tmp_path) == []  # nothing written (Lightning writes a checkpoint)
    state, _ = step(state, make_batches(1)[0])  # still the live state to train on
    assert state.step == 2 and state.micro_step == 5


# ------------------------------------------------------------------ param groups
class RecordingSGD(torch.optim.SGD):
    seen: list[list[tuple[float, float]]] = []  # shared by the finder's copy

    def step(self, closure=None):
        RecordingSGD.seen.append([(g["lr"], g["momentum"]) for g in self.param_groups])
        return super().step(closure)


def test_every_param_group_keeps_its_ratio_and_schedules_still_apply():
    model = make_model(0)
    groups = [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(), "lr": 0.01}]
    state = ftrain.TrainState.create(model, RecordingSGD(groups, lr=0.1, momentum=0.9))
    step = ftrain.make_step(mse_loss)
    step = ftrain.with_schedule(step, lr=S.constant(0.5), momentum=S.constant(0.8))
    RecordingSGD.seen = []
    result = ftrain.lr_find(step, state, make_batches(5), min_lr=1e-3, max_lr=1.0,
                            num_training=12, early_stop_threshold=None)  # fmt: skip
    assert len(RecordingSGD.seen) == 12 and list(result.lrs) == [g[0][0] for g in RecordingSGD.seen]
    for k, ((lr0, m0), (lr1, m1)) in enumerate(RecordingSGD.seen):
        assert lr0 == sweep_lr(k, 1e-3, 1.0, 12)  # the sweep's, not the schedule's 0.5
        assert lr1 == lr0 * (0.01 / 0.1)  # group 1 keeps its ratio to group 0
        assert m0 == m1 == 0.8  # the momentum schedule still applies
    assert [g["lr"] for g in state.optimizer.param_groups] == [0.1, 0.01]
    assert [g["momentum"] for g in state.optimizer.param_groups] == [0.9, 0.9]
    assert not any(k.startswith("ftrain_") for g in state.optimizer.param_groups for k in g)


def test_the_sweep_is_lightnings_exponential_schedule():
    lrs = [sweep_lr(k, 1e-8, 1.0, 100) for k in range(100)]
    assert lrs[0] == 1e-8 and lrs[-1] == 1.0
    assert lrs[1] == pytest.approx(1e-8 * 1e8 ** (2 / 100))  # Lightning skips exponent 1/100
    ratios = [b / a for a, b in zip(lrs[1:], lrs[2:])]
    assert max(ratios) == pytest.approx(min(ratios)) == pytest.approx(1e8 ** (1 / 100))


# ------------------------------------------------------------------ every transform applies
class Counting:
    """An iterable of batches that counts the batches read."""

    def __init__(self, batches):
        self.batches, self.read = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.read += 1
            yield b


def plain_sweep(batches, n, min_lr, max_lr, every, max_norm):
    """The sweep as a plain PyTorch loop: bf16 autocast, accumulation over ``every``
    micro-batches, clipping, Lightning's learning rates; each update's mean micro-batch loss."""
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = itertools.cycle(batches)
    losses = []
    for k in range(n):
        lr = min_lr if k == 0 else min_lr * (max_lr / min_lr) ** ((k + 1) / n)
        for group in opt.param_groups:
            group["lr"] = lr
        window = []
        for _ in range(every):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mse_loss(model, next(stream))
            (loss / every).backward()
            window.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(float(torch.stack(window).mean()))
    return losses


def test_amp_accumulation_and_clipping_match_a_plain_loop():
    batches = make_batches(6)
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    step = ftrain.with_amp(ftrain.with_clip(step, "norm", max_norm=0.5), dtype="bf16")
    data = Counting(batches)
    result = ftrain.lr_find(step, state, data, min_lr=1e-3, max_lr=3.0, num_training=10,
                            early_stop_threshold=None)  # fmt: skip
    assert len(result.lrs) == 10 and data.read == 30  # one point per update of 3 micro-batches
    expected = plain_sweep(batches, 10, 1e-3, 3.0, every=3, max_norm=0.5)
    assert list(result.raw_losses) == expected
    avg, smoothed = 0.0, []  # Lightning's smoothing, written out
    for k, loss in enumerate(expected):
        avg = 0.98 * avg + (1 - 0.98) * loss
        smoothed.append(avg / (1 - 0.98 ** (k + 2)))
    assert list(result.losses) == smoothed


def test_a_summed_loss_point_is_its_windows_total_over_its_count():
    totals = [float(torch.tensor(v)) for v in (6.0, 2.0, 9.0, 1.0, 4.0, 4.0)]
    counts = [3, 1, 2, 4, 5, 3]
    it = iter(zip(totals, counts))

    def loss_fn(model, batch):
        total, count = next(it)
        return ftrain.SummedLoss(model.fc1.weight.sum() * 0.0 + total, count)

    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2)
    result = ftrain.lr_find(step, state, make_batches(2), num_training=3)
    expected = [(totals[i] + totals[i + 1]) / (counts[i] + counts[i + 1]) for i in (0, 2, 4)]
    assert list(result.raw_losses) == pytest.approx(expected, rel=1e-7)


# ------------------------------------------------------------------ stopping
def scripted(values):
    """A loss function returning ``values`` one after the other (with a gradient)."""
    it = iter(values)

    def loss_fn(model, batch):
        return model.fc1.weight.sum() * 0.0 + next(it)

    return loss_fn


def first_divergence(values, threshold=4.0, beta=0.98):
    avg = best = 0.0
    for k, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        smooth = avg / (1 - beta ** (k + 2))
        if k >= 1 and smooth > threshold * best:
            return k
        if smooth < best or k == 0:
            best = smooth
    return None


def test_it_stops_when_the_smoothed_loss_diverges_or_a_loss_is_not_finite():
    values = [1.0] * 20 + [float(torch.tensor(1.6**i)) for i in range(60)]  # float32 losses
    stop = first_divergence(values)
    assert stop is not None and 20 < stop < 79

    def find(values, **kw):
        model = make_model(0)
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = ftrain.make_step(scripted(values))
        return ftrain.lr_find(step, state, make_batches(2), num_training=len(values), **kw)

    result = find(values)
    assert result.stop_reason == "diverged" and len(result.lrs) == stop + 1
    assert list(result.raw_losses) == values[: stop + 1]
    assert find(values, early_stop_threshold=None).stop_reason == "completed"
    nan = find([1.0] * 5 + [math.nan] + [1.0] * 4, early_stop_threshold=None)
    assert nan.stop_reason == "diverged" and len(nan.lrs) == 6


def test_an_iterator_that_runs_out_ends_the_sweep():
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.make_step(mse_loss)
    result = ftrain.lr_find(step, state, iter(make_batches(5)), num_training=20)
    assert result.stop_reason == "out_of_data" and len(result.lrs) == 5
    again = ftrain.lr_find(step, state, make_batches(5), num_training=20, max_lr=1e-3)
    assert again.stop_reason == "completed" and len(again.lrs) == 20  # a list is read again


# ------------------------------------------------------------------ the suggestion
def test_the_suggestion_is_the_steepest_numpy_gradient():
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(15, 60))
        lrs = list(np.geomspace(1e-5, 1.0, n))
        losses = list(np.cumsum(rng.normal(0, 1, n)))
        if trial % 2:
            losses[int(rng.integers(0, n))] = math.nan
        kept = [i for i in range(10, n - 1) if math.isfinite(losses[i])]
        grad = np.gradient(np.array([losses[i] for i in kept]), np.array([lrs[i] for i in kept]))
        assert steepest_index(lrs, losses) == kept[int(np.argmin(grad))]
    assert steepest_index([1.0] * 12, [1.0] * 12) is None  # one point after the skips
    result = LRFindResult(
        (1.0, 2.0, 4.0), (3.0, 2.9, 0.5), (3.0, 2.9, 0.5), None, None, "completed"
    )
    assert np.argmin(np.gradient([3.0, 2.9, 0.5], [1.0, 2.0, 4.0])) == 2
    assert result.suggest(skip_begin=0, skip_end=0) == 4.0


def test_plot_draws_the_curve_and_without_matplotlib_says_what_to_install(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    result = LRFindResult((1e-3, 1e-2, 1e-1), (1.0, 0.5, 2.0), (1.0, 0.5, 2.0), 1e-2, 1, "diverged")
    fig = result.plot()
    ax = fig.axes[0]
    curve, marker = ax.get_lines()
    assert list(curve.get_xdata()) == list(result.lrs) and ax.get_xscale() == "log"
    assert list(marker.get_xdata()) == [1e-2] and marker.get_color() == "red"
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        result.plot()


# ------------------------------------------------------------------ bad input
def test_bad_arguments_are_clear_errors():
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.make_step(mse_loss)
    data = make_batches(2)
    for kw, message in (
        ({"min_lr": 1.0, "max_lr": 0.1}, r"min_lr \(1.0\) must be below max_lr"),
        ({"min_lr": 0.0}, "min_lr must be a finite number > 0"),
        ({"num_training": 0}, "num_training must be a whole number >= 1"),
        ({"early_stop_threshold": -1.0}, "early_stop_threshold must be"),
        ({"beta": 1.0}, r"beta must be a number in \[0, 1\)"),
        ({"skip_end": -1}, "skip_end must be a whole number >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            ftrain.lr_find(step, state, data, **kw)
    with pytest.raises(TypeError, match="step must be an ftrain Step"):
        ftrain.lr_find(mse_loss, state, data)
    accum = ftrain.with_grad_accum(step, every=2)
    mid, _ = accum(state, data[0])
    with pytest.raises(ValueError, match="inside an accumulation window.*step.flush"):
        ftrain.lr_find(accum, mid, data)
    with pytest.raises(ftrain.StaleStateError):
        ftrain.lr_find(step, state, data)  # consumed by the call above
    with pytest.raises(ValueError, match="data yielded no batch"):
        ftrain.lr_find(step, mid, [])


def test_doctests():
    assert doctest.testmod(ftrain.lr_finder, optionflags=doctest.ELLIPSIS).failed == 0


def test_docs_page_runs(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/lr_find.md block {i + 1}", "exec"), namespace)  # noqa: S102


# ------------------------------------------------------------------ DDP
@pytest.mark.dist
def test_ddp_ranks_agree_and_match_one_process(tmp_path):
    from test_export import launch_worker

    launch_worker("lr_find", tmp_path)
    ranks = [json.loads((tmp_path / f"lr_find_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # every rank took the same decisions
    got = ranks[0]
    assert got["untouched"] and not got["consumed"]
    model = make_model(0)  # one process on the whole batches: the same sweep
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.with_clip(ftrain.make_step(mse_loss), "norm", max_norm=1.0)
    one = ftrain.lr_find(step, state, make_batches(4, batch_size=16), min_lr=1e-3, max_lr=100.0,
                         num_training=30)  # fmt: skip
    assert got["lrs"] == list(one.lrs) and got["stop"] == one.stop_reason
    assert np.allclose(got["raw"], one.raw_losses, rtol=1e-5)
    assert got["index"] == one.index
