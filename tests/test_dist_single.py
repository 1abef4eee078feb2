"""Distributed behaviour checked in one process: faked ranks, a world-size-1 group.

The logger's per-log reduction (ranks faked by monkeypatching ``ftrain.dist``),
the accountant's host syncs and parameters, and the teardown of a DDP model
left in a reference cycle (a real gloo group of one process, in memory).
"""

from __future__ import annotations

import copy
import gc
import weakref

import orjson
import pytest
import torch
import torch.distributed as tdist
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import dist
from ftrain.hooks.timer import TimerHook
from ftrain.memory.accounting import ActivationAccountant


def _state(lr: float = 0.1) -> ftrain.TrainState:
    model = make_model(0)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=lr))


# --------------------------------------------------------------- LoggerHook
def _fake_ranks(monkeypatch, rank: int, reduced: list) -> None:
    """Pretend to be ``rank`` of 2; ``reduce_metrics`` records its input, adds 100 to numbers."""

    def reduce_metrics(metrics, op="mean", *, ops=None):
        reduced.append((dict(metrics), dict(ops or {})))
        return {k: float(v) + 100.0 for k, v in metrics.items()}

    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "rank", lambda: rank)
    monkeypatch.setattr(dist, "reduce_metrics", reduce_metrics)


def _eval_hook():
    return ftrain.EvalHook(lambda s: {"score": 1.0}, every=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_logger_reduces_over_ranks_at_each_log_and_only_rank_0_writes(
    tmp_path, monkeypatch, capsys, rank
):
    reduced: list = []
    _fake_ranks(monkeypatch, rank, reduced)
    hooks = [TimerHook(), _eval_hook(), ftrain.LoggerHook(every=2, progress=False)]
    # 3 batches, 2 epochs: logs at steps 2, 3 (epoch end), 4, 6, and 2 evaluations
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        _state(),
        make_batches(3),
        hooks=hooks,
        epochs=2,
        work_dir=tmp_path,
    ).run()
    # EvalHook reduces its results first (ops=None), so hooks after it agree (issue 13)
    by_eval = [m for m, ops in reduced if not ops]
    assert by_eval == [{"score": 1.0}, {"score": 1.0}]
    reduced = [(m, ops) for m, ops in reduced if ops]
    train = [m for m, _ in reduced if "loss" in m]
    evals = [m for m, _ in reduced if "val/score" in m]
    # the logger does not reduce evaluation metrics again (EvalHook owns that)
    assert len(train) == 4 and evals == [] and len(reduced) == 4  # same on every rank
    # issue 16: throughput is summed over the ranks, memory peaks take the largest
    assert all(ops["elapsed"] == ops["eta"] == "max" for _, ops in reduced)
    assert all(ops["perf/samples_per_s"] == "sum" for _, ops in reduced)
    assert all(ops["memory/rss_peak_mib"] == "max" for _, ops in reduced)
    assert all("lr" in m and "elapsed" in m and "epoch" not in m for m in train)
    out = capsys.readouterr().out
    if rank == 1:
        assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
        assert out == ""
        return
    records = [orjson.loads(line) for line in (tmp_path / "metrics.jsonl").read_bytes().split()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [2, 3, 4, 6]
    # what was written is what reduce_metrics returned (the local loss + 100)
    for record, local in zip(logged, train):
        assert record["loss"] == local["loss"] + 100.0
    # reduced once, by EvalHook (+100)
    assert [r["val/score"] for r in records if "val/score" in r] == [101.0, 101.0]
    assert "step 2" in out


def test_eval_reduce_none_keeps_each_ranks_own_numbers_in_the_logs(tmp_path, monkeypatch):
    reduced: list = []
    _fake_ranks(monkeypatch, 0, reduced)
    hooks = [
        ftrain.EvalHook(lambda s: {"score": 1.5}, every=1, reduce=None),
        ftrain.LoggerHook(every=2, progress=False, console=False),
    ]
    ftrain.Loop(
        ftrain.make_step(mse_loss), _state(), make_batches(2), hooks, work_dir=tmp_path
    ).run()
    assert not any("score" in m or "val/score" in m for m, _ in reduced)  # no collective
    records = [orjson.loads(line) for line in (tmp_path / "metrics.jsonl").read_bytes().split()]
    assert [r["val/score"] for r in records if "val/score" in r] == [1.5]


def test_logger_on_a_failing_rank_logs_local_numbers_without_a_collective(tmp_path, monkeypatch):
    reduced: list = []
    _fake_ranks(monkeypatch, 0, reduced)

    @ftrain.hook(priority="LOWEST")
    def boom(events):
        for ev in events:
            if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == 3:
                raise RuntimeError("boom")
            yield ev

    hooks = [ftrain.LoggerHook(every=2, progress=False, console=False), boom]
    with pytest.raises(RuntimeError, match="boom"):
        ftrain.Loop(
            ftrain.make_step(mse_loss), _state(), make_batches(6), hooks=hooks, work_dir=tmp_path
        ).run()
    assert len(reduced) == 1  # the log at step 2; the interval cut by the error: local
    records = [orjson.loads(line) for line in (tmp_path / "metrics.jsonl").read_bytes().split()]
    assert [r["step"] for r in records] == [2, 3]
    assert records[1]["loss"] < 100.0


def test_logger_config_errors_are_raised_on_every_rank(monkeypatch):
    _fake_ranks(monkeypatch, 1, [])
    with pytest.raises(ValueError, match="needs a directory"):
        ftrain.Loop(
            ftrain.make_step(mse_loss),
            _state(),
            make_batches(2),
            hooks=[ftrain.LoggerHook(jsonl=True, console=False)],
        ).run()


def test_reduce_metrics_keeps_equal_numbers_exactly():
    assert dist._mean([0.1, 0.1, 0.1]) == 0.1  # (0.1 + 0.1 + 0.1) / 3 != 0.1
    assert dist._mean([1.0, 100.0]) == 50.5


def test_logger_holds_no_loop_after_the_run():
    import gc
    import weakref

    logger = ftrain.LoggerHook(every=1, progress=False, console=False)
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss), _state(), make_batches(2), hooks=[TimerHook(), logger]
    )
    lp.run()
    alive = weakref.ref(lp)
    del lp
    gc.collect()
    assert alive() is None  # the logger (still referenced here) keeps no loop alive


# -------------------------------------------------------------- accounting
def test_accountant_syncs_the_device_only_to_time(monkeypatch):
    syncs = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a, **k: syncs.__setitem__(0, syncs[0] + 1)
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(3, 4)
    with ActivationAccountant(model, time=False, sync=True) as acc:
        model(x).sum()
    assert syncs[0] == 0 and acc.total > 0
    with ActivationAccountant(model, time=True, sync=True):
        model(x).sum()
    assert syncs[0] == 2 * 4  # before and after each of the 4 modules (root included)


def test_accountant_does_not_count_parameters_outside_the_model():
    """FSDP2 gathers full weights into unsharded Parameters not in model.parameters()."""
    model = torch.nn.Linear(4, 4)
    gathered = torch.nn.Parameter(torch.randn(4, 4))  # stands in for the unsharded weight
    x = torch.randn(2, 4, requires_grad=True)
    with ActivationAccountant(model) as acc:
        torch.nn.functional.linear(x, gathered).sum()
    assert acc.total == x.numel() * 4  # the input only, not the weight (nor weight.t())


# ----------------------------------------------------------------- teardown
@pytest.fixture
def one_process_group():
    assert not tdist.is_initialized()
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def _train_ddp(refs: list) -> None:
    model = dist.wrap(make_model(0), "ddp")
    assert dist.strategy(model) == "ddp"
    refs.append(weakref.ref(model))
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ftrain.Loop(
        ftrain.make_step(mse_loss), state, make_batches(3), hooks=ftrain.default_hooks()
    ).run()


def test_shutdown_collects_a_ddp_model_before_destroying_the_group(one_process_group, monkeypatch):
    refs: list = []
    gc.disable()  # an automatic collection must not do shutdown()'s work
    try:
        _train_ddp(refs)
        seen = []
        destroy = tdist.destroy_process_group
        monkeypatch.setattr(
            tdist, "destroy_process_group", lambda *a: (seen.append(refs[0]()), destroy(*a))
        )
        dist.shutdown()
    finally:
        gc.enable()
    assert seen == [None]  # the wrapper was gone before its process group
    assert not tdist.is_initialized()


def test_a_trained_model_dies_with_its_last_reference():
    refs: list = []
    gc.disable()
    try:
        model = make_model(0)
        refs.append(weakref.ref(model))
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        del model
        state = ftrain.Loop(
            ftrain.make_step(mse_loss),
            state,
            make_batches(3),
            hooks=ftrain.default_hooks(progress=False),
        ).run()
        del state
        assert refs[0]() is None
    finally:
        gc.enable()


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
            for _ in range(3)
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_accountant_under_fsdp2_measures_what_the_plain_model_saves(one_process_group):
    """DTensor parameters, unsharded weights FSDP2 gathers and frees: activations only."""
    from ftrain.memory import dynamic, measure_activations, pattern

    torch.manual_seed(0)
    plain = _Blocks()
    sharded = dist.wrap(copy.deepcopy(plain), "fsdp2")
    assert dist.strategy(sharded) == "fsdp2"
    x = torch.randn(4, 8)
    expected = measure_activations(plain, lambda: plain(x).sum()).total_bytes
    assert measure_activations(sharded, lambda: sharded(x).sum()).total_bytes == expected

    plan = dynamic(2000, warmup_iters=1, candidates=pattern(under="blocks", level=1))
    monitored = []
    for model in (plain, sharded):
        state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = ftrain.with_activation_checkpoint(
            ftrain.make_step(lambda m, b: m(b).pow(2).mean()), plan, monitor=True
        )
        for _ in range(3):
            state, metrics = step(state, x)
        assert state.transforms["activation_checkpoint"].planner.fitted
        monitored.append(int(metrics["activation_bytes"]))
    assert monitored[1] == monitored[0] > 0


def test_create_compares_a_wrapped_models_own_parameters(one_process_group):
    """DDP: the optimizer over the wrapper's parameters is the model's; FSDP2 built late is not."""
    ddp = dist.wrap(make_model(0), "ddp")
    for params in (ddp.parameters(), ddp.module.parameters()):
        ftrain.TrainState.create(ddp, torch.optim.SGD(params, lr=0.1))
    plain = make_model(0)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)  # built before fully_shard swapped them
    sharded = dist.wrap(plain, "fsdp2")
    with pytest.raises(ValueError, match="before it was wrapped, sharded"):
        ftrain.TrainState.create(sharded, opt)
    ftrain.TrainState.create(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1))
