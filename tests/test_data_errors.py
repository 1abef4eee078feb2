"""An exception out of ``next(data)`` loses and repeats no batch (issue 23, item 2).

A data error the caller catches, a second Ctrl-C or a Ctrl-C outside the main thread
raises out of the loader's ``next()``; the caller then continues the loop. Reference: the
same run without the exception. Compared bitwise: the weights, and the sample indices
every step saw, in order. The exception is injected deterministically: a dataset that
raises on the n-th read of one sample (counted in files, so in worker processes too), or,
for a list (whose iterator cannot raise), an exception right after ``next()`` returned.
"""

import itertools
import sys

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain.events import StepEnd

SAMPLES, BATCH, WINDOW, EPOCHS = 24, 4, 2, 2  # 6 batches per epoch, windows of 2


class DataError(Exception):
    """A failing read (a corrupt file, a network hiccup) the caller catches."""


class Flaky(torch.utils.data.Dataset):
    """Fixed samples with their index; the ``nth`` read of sample ``fail_at`` raises."""

    def __init__(self, reads_dir=None, fail_at=None, nth=2, error=DataError) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = torch.randn(SAMPLES, 2, generator=g)
        self.reads_dir, self.fail_at, self.nth, self.error = reads_dir, fail_at, nth, error

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        if i == self.fail_at:
            self.reads_dir.mkdir(exist_ok=True)
            reads = len(list(self.reads_dir.iterdir())) + 1
            (self.reads_dir / f"read{reads}").touch()
            if reads == self.nth:
                raise self.error(f"sample {i} cannot be read (read {reads})")
        return self.x[i], self.y[i], i


class FlakyStream(torch.utils.data.IterableDataset):
    """The samples as a stream; the ``nth`` read of sample ``fail_at`` raises (it dies)."""

    def __init__(self, flaky: Flaky) -> None:
        self.flaky = flaky

    def __iter__(self):
        for i in range(SAMPLES):
            yield self.flaky[i]


class Batches:
    """A re-iterable whose ``__iter__`` is a generator (it dies when a read raises)."""

    def __init__(self, flaky: Flaky) -> None:
        self.flaky = flaky

    def __len__(self) -> int:
        return SAMPLES // BATCH

    def __iter__(self):
        for b in range(len(self)):
            items = [self.flaky[i] for i in range(b * BATCH, (b + 1) * BATCH)]
            yield (torch.stack([x for x, _, _ in items]), torch.stack([y for _, y, _ in items]),
                   torch.tensor([i for _, _, i in items]))  # fmt: skip


def _batches(flaky: Flaky) -> list:
    return list(Batches(flaky))


def make_data(kind: str, flaky: Flaky):
    g = torch.Generator().manual_seed(5)
    if kind == "generator function":
        return Batches(flaky)
    if kind == "list":
        return _batches(flaky)
    if kind == "IterableDataset":
        return torch.utils.data.DataLoader(FlakyStream(flaky), batch_size=BATCH)
    if kind.startswith("DataLoader"):
        workers = int(kind[-1])
        gen = None if "global RNG" in kind else g
        return torch.utils.data.DataLoader(
            flaky, batch_size=BATCH, shuffle=True, num_workers=workers, generator=gen
        )
    workers = int(kind[-1])
    return StatefulDataLoader(flaky, batch_size=BATCH, shuffle=True, num_workers=workers,
                              generator=g)  # fmt: skip


def loss_fn(model, batch):
    x, y, _ = batch
    return torch.nn.functional.mse_loss(model(x), y)


def new_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    )
    return ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def build(data, seen, **loop_args):
    state = new_state()
    step = ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=WINDOW)

    def record(events):  # no cadence: it sees every micro-batch
        for ev in events:
            if type(ev) is StepEnd and ev.batch is not None:
                seen.append(ev.batch[2].tolist())
            yield ev

    hooks = [record, ftrain.hooks.AutoCheckpointHook()] if "work_dir" in loop_args else [record]
    return ftrain.Loop(step, state, data, hooks, epochs=EPOCHS, **loop_args)


def outcome(lp, seen):
    params = [p.detach().clone() for p in lp.state.model.parameters()]
    return params, list(seen), (lp.state.step, lp.totals.micro_batches, lp.totals.updates)


def assert_same(got, expected):
    params, seen, counts = got
    want_params, want_seen, want_counts = expected
    assert seen == want_seen, "the batches seen differ"
    assert counts == want_counts, "updates or micro-batches differ"
    assert all(torch.equal(a, b) for a, b in zip(params, want_params)), "the weights differ"


KINDS = [
    "generator function",
    "IterableDataset",
    "DataLoader 0",
    "DataLoader 2",
    "DataLoader, global RNG 0",
    "StatefulDataLoader 0",
    "StatefulDataLoader 2",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nth", [1, 2])  # epoch 0, or epoch 1 (after the reseed)
def test_a_caught_error_out_of_next_loses_and_repeats_no_batch(kind, nth, tmp_path):
    seen_ref: list = []
    ref = build(make_data(kind, Flaky()), seen_ref)
    ref.run()
    expected = outcome(ref, seen_ref)
    assert expected[2] == (SAMPLES // BATCH * EPOCHS // WINDOW, 12, 6)

    seen: list = []
    flaky = Flaky(tmp_path / "reads", fail_at=13, nth=nth)
    lp = build(make_data(kind, flaky), seen)
    with pytest.raises(DataError, match="sample 13 cannot be read"):
        lp.run()
    lp.run()  # the caller caught it and continues
    assert len(list((tmp_path / "reads").iterdir())) > nth  # the failed sample was read again
    assert_same(outcome(lp, seen), expected)


@pytest.mark.parametrize("kind", ["DataLoader 0", "StatefulDataLoader 0", "StatefulDataLoader 2"])
def test_the_checkpoint_saved_when_next_raised_resumes_exactly(kind, tmp_path):
    # the interrupted checkpoint holds the position before the lost batch: a new process
    # opens the epoch as it was opened and re-reads up to there
    seen_ref: list = []
    ref = build(make_data(kind, Flaky()), seen_ref)
    ref.run()
    seen: list = []
    flaky = Flaky(tmp_path / "reads", fail_at=13, nth=2)
    lp = build(make_data(kind, flaky), seen, work_dir=tmp_path / "run")
    with pytest.raises(DataError):
        lp.run()
    assert (tmp_path / "run" / "interrupted.pth").exists()
    resumed = build(make_data(kind, flaky), seen, work_dir=tmp_path / "run", resume="auto")
    resumed.run()
    assert resumed.resumed_from.name == "interrupted.pth"
    params, got_seen, (step, _, _) = outcome(resumed, seen)
    want_params, want_seen, (want_step, _, _) = outcome(ref, seen_ref)
    assert got_seen == want_seen and step == want_step
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))


# a sample of batch 6 of epoch 0 in each loader's order (not read before the pause)
@pytest.mark.parametrize(
    ("kind", "sample"), [("StatefulDataLoader 0", 9), ("StatefulDataLoader 2", 6)]
)
def test_an_error_out_of_next_after_a_mid_epoch_resume_loses_no_batch(kind, sample, tmp_path):
    # the epoch was opened from a restored loader position: it is opened from there again
    seen_ref: list = []
    ref = build(make_data(kind, Flaky()), seen_ref)
    ref.run()
    seen: list = []
    first = build(make_data(kind, Flaky()), seen, work_dir=tmp_path / "run")
    first.run(steps=2)
    first.close()  # interrupted.pth: micro-batch 4 of 6 in epoch 0
    flaky = Flaky(tmp_path / "reads", fail_at=sample, nth=1)
    lp = build(make_data(kind, flaky), seen, work_dir=tmp_path / "run", resume="auto")
    with pytest.raises(DataError):
        lp.run()
    assert lp.batch_in_epoch == 5 and lp.state.epoch == 0  # one batch after the restored one
    lp.run()
    params, got_seen, (step, _, _) = outcome(lp, seen)
    want_params, want_seen, (want_step, _, _) = outcome(ref, seen_ref)
    assert got_seen == want_seen and step == want_step
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))


def test_a_ctrl_c_raised_while_a_batch_is_read_loses_and_repeats_no_batch(tmp_path):
    seen_ref: list = []
    ref = build(make_data("StatefulDataLoader 0", Flaky()), seen_ref)
    ref.run()
    seen: list = []
    flaky = Flaky(tmp_path / "reads", fail_at=7, nth=2, error=KeyboardInterrupt)
    lp = build(make_data("StatefulDataLoader 0", flaky), seen)
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    lp.run()
    assert_same(outcome(lp, seen), outcome(ref, seen_ref))


def _raise_after_next(call: int, error: type[BaseException]):
    """A profile function raising ``error`` right after the ``call``-th ``next()`` the hot loop
    makes returned: the iterator has moved on and the batch is not stored (a signal handler
    raising at that bytecode boundary)."""
    calls = itertools.count(1)

    def profile(frame, event, arg):
        if event == "c_return" and arg is next and frame.f_code.co_name == "_train":
            if next(calls) == call:
                raise error("raised after next() returned")

    return profile


def test_an_exception_right_after_a_list_batch_was_read_loses_and_repeats_no_batch():
    seen_ref: list = []
    ref = build(make_data("list", Flaky()), seen_ref)
    ref.run()
    seen: list = []
    lp = build(make_data("list", Flaky()), seen)
    sys.setprofile(_raise_after_next(9, DataError))  # batch 3 of epoch 1 (a window's first)
    try:
        with pytest.raises(DataError, match="after next"):
            lp.run()
    finally:
        sys.setprofile(None)
    assert len(seen) == 8  # batch 9 was read, then lost with the exception
    lp.run()
    assert_same(outcome(lp, seen), outcome(ref, seen_ref))


def test_a_one_shot_generator_that_lost_a_batch_is_refused_with_the_fix(tmp_path):
    flaky = Flaky(tmp_path / "reads", fail_at=13, nth=1)
    one_shot = iter(Batches(flaky))  # a generator object: it can be read once
    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), one_shot, [], max_steps=6)
    with pytest.raises(DataError):
        lp.run()
    step = lp.state.step
    with pytest.raises(RuntimeError, match=r"one-shot iterator.*lost.*Pass data that can be read"):
        lp.run()
    assert lp.state.step == step  # refused before any step
