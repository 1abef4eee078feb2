"""Taking the data position never changes the data order (issue 23, item 1).

Reference: the same run trained without a stop and without extra position-taking.
Compared bitwise: the weights, and the sequence of sample indices every step saw.
"""

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain.events import EpochBegin, EpochEnd, Event, RunBegin, StepEnd

SAMPLES, BATCH, WINDOW, EPOCHS = 28, 4, 3, 3  # 7 batches: windows of 3, 3 and a partial 1


class Indexed(torch.utils.data.Dataset):
    """Fixed random samples, each with its index (what a step saw is read from the batch)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = torch.randn(SAMPLES, 2, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def loss_fn(model, batch):
    x, y, _ = batch
    return torch.nn.functional.mse_loss(model(x), y)


class Killed(BaseException):
    """Stands in for SIGKILL: no hook saves on it."""


def crash_when(predicate):
    def crash(events):
        for ev in events:
            if predicate(ev):
                raise Killed
            yield ev

    return ftrain.hooks.Hook(crash, priority="LOWEST", name="crash")


def recorder(seen):
    """Every micro-batch's sample indices, in order (a hook without a cadence sees all)."""

    def record(events):
        for ev in events:
            if type(ev) is StepEnd and ev.batch is not None:
                seen.append(ev.batch[2].tolist())
            yield ev

    return ftrain.hooks.Hook(record, priority="HIGHEST", name="record")


def position_taker(priority):
    """Takes the data position (a full checkpoint) at every event the hook sees."""

    def take(events):
        for ev in events:
            ev.loop.checkpoint()
            yield ev
            ev.loop.checkpoint()  # after the later hooks too

    return ftrain.hooks.Hook(take, priority=priority, name=f"take_{priority}")


def build(work_dir, workers, *, hooks=(), resume="auto", seen=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=WINDOW)
    data = StatefulDataLoader(
        Indexed(), batch_size=BATCH, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    evaluations = iter(range(1000))
    base = [
        recorder([] if seen is None else seen),
        # every evaluation is a new best: the best-checkpoint hook saves at every epoch's end
        ftrain.EvalHook(lambda s: {"acc": float(next(evaluations))}, by_epoch=True),
        ftrain.BestCheckpointHook("acc"),
        ftrain.CheckpointHook(1, background=False),
    ]
    return ftrain.Loop(
        step, ftrain.TrainState.create(model, opt), data, [*base, *hooks],
        epochs=EPOCHS, work_dir=work_dir, resume=resume,
    )  # fmt: skip


def outcome(lp, seen):
    return [p.detach().clone() for p in lp.state.model.parameters()], list(seen)


def assert_same(got, expected):
    (params, seen), (want_params, want_seen) = got, expected
    assert seen == want_seen, "the data order differs"
    assert all(torch.equal(a, b) for a, b in zip(params, want_params)), "the weights differ"


_REFERENCE = {}


def reference(workers, tmp_path_factory):
    if workers not in _REFERENCE:
        seen = []
        lp = build(tmp_path_factory.mktemp("ref"), workers, resume=None, seen=seen)
        lp.run()
        _REFERENCE[workers] = outcome(lp, seen)
    return _REFERENCE[workers]


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_at_an_epoch_end_flush_that_is_evaluated_trains_the_next_epoch_alike(
    workers, tmp_path, tmp_path_factory
):
    # update 3 is epoch 0's flush (a window of 1); the evaluation at that epoch's end comes
    # after the resume and saves a best checkpoint before epoch 1 opens its data
    expected = reference(workers, tmp_path_factory)
    seen = []
    at_flush = crash_when(lambda ev: type(ev) is StepEnd and ev.state.step == 3)
    lp = build(tmp_path, workers, hooks=[at_flush], resume=None, seen=seen)
    with pytest.raises(Killed):
        lp.run()
    assert lp.state.step == 3 and lp.state.epoch == 0 and len(seen) == 7
    resumed = build(tmp_path, workers, seen=seen)
    resumed.run()
    assert resumed.resumed_from.name == "iter_3.pth"
    assert_same(outcome(resumed, seen), expected)


def _stops():
    """Where a run is stopped and resumed: (name, predicate on the event a hook raises at)."""
    return {
        "at an epoch's begin": lambda ev: type(ev) is EpochBegin and ev.epoch == 1,
        "mid epoch": lambda ev: type(ev) is StepEnd and ev.state.micro_step == 11,
        "at the flush": lambda ev: type(ev) is StepEnd and ev.state.step == 6,
        "after an epoch's end": lambda ev: type(ev) is EpochEnd and ev.epoch == 0,
    }


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", list(_stops()))
def test_taking_the_position_at_every_point_leaves_the_data_order_unchanged(
    stop, workers, tmp_path, tmp_path_factory
):
    expected = reference(workers, tmp_path_factory)
    predicate = _stops()[stop]

    def interrupt(events):
        for ev in events:
            if predicate(ev):
                raise KeyboardInterrupt
            yield ev

    takers = [position_taker("HIGHEST"), position_taker("LOWEST")]
    seen: list[list[int]] = []
    lp = build(tmp_path, workers, resume=None, seen=seen,
               hooks=[*takers, ftrain.hooks.Hook(interrupt, priority="HIGH"),
                      ftrain.hooks.AutoCheckpointHook()])  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    resumed = build(tmp_path, workers, seen=seen, hooks=takers)
    resumed.run()
    assert resumed.resumed_from is not None
    assert_same(outcome(resumed, seen), expected)


def test_the_event_types_the_position_is_taken_at_are_all_seen(tmp_path):
    kinds: set[type[Event]] = set()

    def note(events):
        for ev in events:
            kinds.add(type(ev))
            yield ev

    build(tmp_path, 0, resume=None, hooks=[note]).run()
    assert {RunBegin, EpochBegin, StepEnd, EpochEnd} <= kinds
