"""Issue 21: training past a schedule's declared end warns once, naming the fix.

docs/getting-started.md's "train longer" ran 70 updates at lr 0 past a cosine's total with no
word. Now ``with_schedule`` warns at the first update past the end (once), and not before.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ftrain
from ftrain import schedules as S
from ftrain.transforms.schedule import declared_end


def updates(step, n, every=1):
    m = torch.nn.Linear(2, 1)
    state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n * every):
            state, _ = step(state, torch.ones(2, 2))
            seen.append(len([w for w in caught if "past its end" in str(w.message)]))
    return [str(w.message) for w in caught if "past its end" in str(w.message)], seen


def plain():
    return ftrain.make_step(lambda m, b: m(b).pow(2).mean())


def test_warns_once_at_the_first_update_past_the_total():
    step = ftrain.with_schedule(plain(), lr=S.warmup(S.cosine(0.1, total=4), iters=1))
    msgs, seen = updates(step, 8)
    # updates 1-5 read lr(0)..lr(4), the cosine's end; the 6th is the first past it
    assert seen == [0, 0, 0, 0, 0, 1, 1, 1]
    (msg,) = msgs
    assert msg.startswith("with_schedule: update 6 reads the lr schedule warmup(")
    assert "at 5, past its end at 4: from here it holds its last value (0)" in msg
    assert "give the schedule the new length (its total=), or end the run before it" in msg


def test_no_warning_within_the_schedule_or_without_an_end():
    within, _ = updates(ftrain.with_schedule(plain(), lr=S.cosine(0.1, total=6)), 7)
    endless, _ = updates(ftrain.with_schedule(plain(), lr=S.multistep(0.1, [2])), 8)
    assert within == endless == []


def test_micro_batches_count_as_the_schedule_does():
    step = ftrain.with_grad_accum(plain(), every=2)
    step = ftrain.with_schedule(step, lr=S.cosine(0.1, total=6), count="micro_batches")
    msgs, seen = updates(step, 5, every=2)
    assert seen.index(1) == 7 and msgs[0].startswith("with_schedule: micro-batch 8 reads")


@pytest.mark.parametrize(
    "schedule, end",
    [
        (S.cosine(0.1, total=70), 70),
        (S.warmup(S.polynomial(0.1, total=30), iters=5), 30),
        (S.join([S.constant(0.1), S.cosine(0.1, 90)], [10]), 100),
        (S.by_epoch(S.cosine(0.1, total=3), steps_per_epoch=10), 30),
        (S.cosine_restarts(1.0, periods=[4, 6]), 10),
        (S.onecycle(0.1, total=50), 50),
        (S.constant(0.1), None),
        (S.step_decay(0.1, step_size=3), None),
    ],
)
def test_declared_ends(schedule, end):
    assert declared_end(schedule) == end
