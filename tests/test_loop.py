"""The loop, hook ordering, checkpoint hooks and exact resume."""

import os
from pathlib import Path

import orjson
import pytest
import torch
from helpers import make_model, mse_loss
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain.checkpoint import CheckpointError, load_checkpoint
from ftrain.events import EpochBegin, EpochEnd, Evaluated, RunBegin, RunEnd, StepEnd


def dataset(n=40, d_in=8, d_out=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
    )


def loader(batch_size=4, n=40):
    return StatefulDataLoader(
        dataset(n), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(1)
    )


def new_state(seed=0, dropout=0.2):
    model = make_model(seed, dropout=dropout)
    return ftrain.TrainState.create(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )


def composed():
    step = ftrain.make_step(mse_loss)
    step = ftrain.with_amp(step, "fp16", loss_scale={"init_scale": 2.0**10})
    step = ftrain.with_grad_accum(step, every=3)
    return ftrain.with_clip(step, "moving_average", tolerance=1.5)


def params(state):
    return [p.detach().clone() for p in state.model.parameters()]


def assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# ------------------------------------------------------------------ ordering
def test_hooks_run_by_priority_then_registration_order():
    log = []

    def make(tag):
        def h(events):
            log.append(("setup", tag))
            try:
                for ev in events:
                    if isinstance(ev, StepEnd):
                        log.append(("pre", tag))
                    yield ev
                    if isinstance(ev, StepEnd):
                        log.append(("post", tag))
            finally:
                log.append(("finally", tag))
            log.append(("after", tag))

        return h

    hooks = [
        ftrain.hook(make("low"), priority="LOW"),
        ftrain.hook(make("n1"), priority=50),
        ftrain.hook(make("highest"), priority="HIGHEST"),
        ftrain.hook(make("n2"), priority="NORMAL"),
    ]
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), [next(iter(loader()))], hooks=hooks)
    # names follow registration (h, h#2, ...); the plan is in priority order
    assert [h.name for h in lp.hooks] == ["h#3", "h#2", "h#4", "h"]
    assert [h.priority for h in lp.hooks] == [0, 50, 50, 70]
    lp.run()
    order = ["highest", "n1", "n2", "low"]
    assert [t for k, t in log if k == "setup"] == order
    assert [t for k, t in log if k == "pre"] == order
    assert [t for k, t in log if k == "post"] == order[::-1]
    assert [t for k, t in log if k == "after"] == order
    assert [t for k, t in log if k == "finally"] == order
    assert "HookPlan" in repr(lp.hooks) and "HIGHEST (0)" in repr(lp.hooks)


def test_bad_hook_configuration_fails_at_construction():
    with pytest.raises(ValueError, match="Unknown hook priority 'SOON'.*HIGHEST"):
        ftrain.hook(lambda ev: ev, priority="SOON")
    with pytest.raises(ValueError, match="0..100"):
        ftrain.hook(lambda ev: ev, priority=101)
    with pytest.raises(ValueError, match="n must be"):
        ftrain.every(0, print)
    with pytest.raises(ValueError, match="interval"):
        ftrain.CheckpointHook(interval=0)


def test_a_plain_callback_is_rejected_before_it_can_swallow_the_run():
    ran = []

    def callback(events):  # forgot to yield: would consume every event itself
        for ev in events:
            ran.append(ev)

    with pytest.raises(TypeError, match="not a generator function.*ftrain.every"):
        ftrain.hook(callback)
    with pytest.raises(TypeError, match="not a generator function"):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), [], hooks=[callback])
    ftrain.hook(lambda events: (ev for ev in events))  # returns an iterator: fine

    class ReturnsNone:
        def __call__(self, events):
            return None

    with pytest.raises(TypeError, match="'ReturnsNone' is not a generator function"):
        ftrain.hook(ReturnsNone())

    class ReturnsANumber:  # not visibly wrong: caught when the run starts, before any step
        value = 3

        def __call__(self, events):
            return self.value

    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(), hooks=[ReturnsANumber()])
    with pytest.raises(TypeError, match="returned int, not an iterator"):
        lp.run()
    assert ran == [] and lp.state.step == 0


def test_once_and_every_call_at_the_right_updates():
    calls = []
    hooks = [
        ftrain.hooks.once(lambda ev: calls.append(("once", ev.state.step)), at=3),
        ftrain.hooks.once(lambda ev: calls.append(("epoch", ev.epoch)), at=2, by="epoch"),
        ftrain.every(4, lambda ev: calls.append(("every", ev.state.step))),
    ]
    ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(n=24), hooks=hooks, epochs=2).run()
    assert calls == [("once", 3), ("every", 4), ("every", 8), ("every", 12), ("epoch", 1)]
    with pytest.raises(ValueError, match="at must be"):
        ftrain.hooks.once(print, at=0)
    with pytest.raises(ValueError, match="mode='max' or mode='min'"):
        ftrain.BestCheckpointHook("f1_weird")


def test_finally_sees_interruption_and_state_stays_consistent():
    seen = {}

    def watcher(events):
        try:
            for ev in events:
                yield ev
        except KeyboardInterrupt:
            seen["interrupt"] = True
            raise
        finally:
            seen["finally"] = True

    def interrupt_at_5(events):
        for ev in events:
            yield ev
            if isinstance(ev, StepEnd) and ev.state.micro_step == 5:
                raise KeyboardInterrupt

    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    data = loader()
    lp = ftrain.Loop(
        step, new_state(), data, hooks=[watcher, ftrain.hook(interrupt_at_5, priority="HIGHEST")]
    )
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    assert seen == {"interrupt": True, "finally": True}
    assert lp.state.micro_step == 5 and step.pending(lp.state) == 2  # valid mid-window state
    lp.hooks = ftrain.hooks.resolve_hooks([])  # continue without the interrupting hook
    final = lp.run()
    assert final.epoch == 1 and final.micro_step == 10


def test_interrupt_during_a_step_is_deferred_until_it_finishes():
    import signal

    calls = []

    def loss_fn(model, batch):
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of a step
        calls.append(1)
        return mse_loss(model, batch)

    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), loader(), hooks=[])
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    assert len(calls) == 3 and lp.state.step == 3  # the interrupted step completed
    assert not lp.state.is_consumed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupt_delivers_the_finished_update_to_the_hooks_first(tmp_path):
    """The step that was running when Ctrl-C came completes, and every hook sees it."""
    import signal

    calls, seen = [], []

    def loss_fn(model, batch):
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of update 4
        calls.append(1)
        return mse_loss(model, batch)

    def record(events):
        for ev in events:
            if isinstance(ev, StepEnd):
                seen.append(ev.state.step)
            yield ev

    hooks = [record, ftrain.CheckpointHook(2, save_last=False)]
    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), loader(), hooks, work_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    assert seen == [1, 2, 3, 4] and lp.state.step == 4
    assert (tmp_path / "iter_4.pth").is_file()  # the checkpoint hook saw update 4
    lp.run()  # continue where it stopped
    assert seen == list(range(1, 11))
    straight = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(), hooks=[]).run()
    assert_bitwise(params(lp.state), params(straight))


def test_interrupt_while_loading_data_then_continue_is_exact():
    """Ctrl-C inside a generator-based data source: continuing re-reads to the position."""
    data = list(loader())
    trips = {"armed": True}

    class Source:
        def __iter__(self):
            for i, batch in enumerate(data):
                if i == 4 and trips["armed"]:
                    trips["armed"] = False
                    raise KeyboardInterrupt  # the generator dies with it
                yield batch

    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    lp = ftrain.Loop(step, new_state(), Source(), hooks=[], epochs=2)
    with pytest.raises(KeyboardInterrupt):
        lp.run()
    assert lp.state.micro_step == 4 and not lp.state.is_consumed
    state = lp.run()
    assert state.micro_step == 20 and state.epoch == 2
    straight = ftrain.Loop(step, new_state(), data, hooks=[], epochs=2).run()
    assert_bitwise(params(state), params(straight))


def test_events_and_final_window_flush():
    kinds = []

    def rec(events):
        for ev in events:
            kinds.append((type(ev).__name__, getattr(ev, "is_update", None)))
            yield ev

    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=4)
    state = ftrain.Loop(step, new_state(), loader(n=40), hooks=[rec], epochs=2).run()
    # 10 micro-batches per epoch: updates after 4, 8, and the flushed 2
    assert state.step == 6 and state.micro_step == 20 and state.epoch == 2
    per_epoch = [k for k in kinds if k[0] == "StepEnd"][:11]
    assert [u for _, u in per_epoch] == [False] * 3 + [True] + [False] * 3 + [
        True,
        False,
        False,
        True,
    ]
    assert kinds[0][0] == "RunBegin" and kinds[1][0] == "EpochBegin" and kinds[-1][0] == "RunEnd"


def test_max_steps_and_set_epoch():
    class Sampler(torch.utils.data.Sampler):
        def __init__(self):
            self.epochs = []

        def set_epoch(self, e):
            self.epochs.append(e)

        def __iter__(self):
            return iter(range(8))

        def __len__(self):
            return 8

    sampler = Sampler()
    data = torch.utils.data.DataLoader(dataset(8), batch_size=2, sampler=sampler)
    state = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), data, hooks=[], max_steps=10).run()
    assert state.step == 10 and sampler.epochs == [0, 1, 2]


# ---------------------------------------------------------------- checkpoint
def _saved_steps(tmp_path, **kw):
    hook = ftrain.CheckpointHook(**kw)
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 11
    by_epoch = kw.get("by_epoch", False)
    if by_epoch:
        ftrain.Loop(
            ftrain.make_step(mse_loss),
            new_state(),
            data[:1],
            hooks=[hook],
            epochs=11,
            work_dir=tmp_path,
        ).run()
    else:
        ftrain.Loop(
            ftrain.make_step(mse_loss), new_state(), data, hooks=[hook], work_dir=tmp_path
        ).run()
    names = sorted(p.name for p in Path(tmp_path).glob("*.pth"))
    return sorted(int(n.split("_")[1].split(".")[0]) for n in names)


@pytest.mark.parametrize("by_epoch", [False, True])
def test_checkpoint_saved_steps_follow_mmengine(tmp_path, by_epoch):
    assert _saved_steps(tmp_path / "a", interval=2, by_epoch=by_epoch) == [2, 4, 6, 8, 10, 11]
    assert _saved_steps(tmp_path / "b", interval=2, save_begin=5, by_epoch=by_epoch) == [
        5,
        7,
        9,
        11,
    ]
    assert _saved_steps(tmp_path / "c", interval=2, save_last=False, by_epoch=by_epoch) == [
        2,
        4,
        6,
        8,
        10,
    ]
    assert _saved_steps(tmp_path / "d", interval=3, max_keep=2, by_epoch=by_epoch) == [9, 11]
    prefix = "epoch" if by_epoch else "iter"
    assert (tmp_path / "d" / f"{prefix}_11.pth").exists()


def test_max_keep_survives_resume_and_spares_foreign_files(tmp_path):
    foreign = tmp_path / "iter_1.pth"
    tmp_path.mkdir(exist_ok=True)
    foreign.write_bytes(b"someone else's file")
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 6
    hook = ftrain.CheckpointHook(interval=2, max_keep=2, save_last=False)
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), data, hooks=[hook], work_dir=tmp_path
    ).run()
    assert sorted(p.name for p in tmp_path.glob("iter_*.pth")) == [
        "iter_1.pth",
        "iter_4.pth",
        "iter_6.pth",
    ]
    # resume and continue: the keep-list comes from the manifest on disk
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        data,
        hooks=[ftrain.CheckpointHook(interval=2, max_keep=2, save_last=False)],
        work_dir=tmp_path,
        resume="auto",
        epochs=2,
    ).run()
    assert sorted(p.name for p in tmp_path.glob("iter_*.pth")) == [
        "iter_1.pth",
        "iter_10.pth",
        "iter_12.pth",
    ]
    assert foreign.read_bytes() == b"someone else's file"


def _files(d):
    return sorted((p.name for p in d.glob("iter_*.pth")), key=lambda n: int(n[5:-4]))


def test_a_fresh_run_refuses_a_directory_of_another_run_and_auto_continues_it(tmp_path):
    # issue 12: a fresh run (resume=None) in a used directory used to overwrite the earlier
    # run's files of the same names and prune them as its own; now it refuses, naming the fixes
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 6

    def run(epochs, **kw):
        hook = ftrain.CheckpointHook(interval=2, max_keep=2, save_last=False)
        return ftrain.Loop(
            ftrain.make_step(mse_loss), new_state(), data, [hook], work_dir=tmp_path,
            epochs=epochs, **kw,
        ).run()  # fmt: skip

    run(3)  # an earlier run: iter_2 ... iter_18, keeps 16 and 18
    assert _files(tmp_path) == ["iter_16.pth", "iter_18.pth"]
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")}
    with pytest.raises(CheckpointError, match=r"another run.*resume='auto'.*new work_dir"):
        run(1)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pth")} == before
    state = run(4, resume="auto")  # continues the earlier run from update 18
    assert state.step == 24
    assert _files(tmp_path) == ["iter_22.pth", "iter_24.pth"]


def test_resume_from_an_older_checkpoint_then_auto_follows_the_new_branch(tmp_path):
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 6
    step = ftrain.make_step(mse_loss)
    hooks = [ftrain.CheckpointHook(interval=2, max_keep=None, save_last=False)]
    ftrain.Loop(step, new_state(), data, hooks, work_dir=tmp_path).run()  # iter_2, 4, 6
    first_iter_4 = load_checkpoint(tmp_path / "iter_4.pth")["time"]
    # go back to iter_2 and train to update 4: the new branch writes iter_4 again
    ftrain.Loop(
        step, new_state(), data, hooks, work_dir=tmp_path, resume=tmp_path / "iter_2.pth",
        max_steps=4,
    ).run()  # fmt: skip
    assert load_checkpoint(tmp_path / "iter_4.pth")["time"] > first_iter_4
    lp = ftrain.Loop(step, new_state(), data, [], work_dir=tmp_path, resume="auto")
    next(iter(lp))  # resume happens when iteration starts
    # the newest written (the new branch's iter_4), not the abandoned branch's iter_6
    assert lp.resumed_from.name == "iter_4.pth" and lp.state.step == 4


@pytest.mark.parametrize(
    "metric, mode",
    [
        ("acc", "max"),
        ("val/acc_top1", "max"),
        ("coco/bbox_mAP", "max"),
        ("mIoU", "max"),
        ("AR@100", "max"),
        ("loss", "min"),
        ("val_loss", "min"),
        ("val/Accuracy", "max"),  # MMEngine 0.10.7 matches case-insensitively
        ("Top1", "max"),
    ],
)
def test_best_mode_is_inferred_like_mmengine(metric, mode):
    from ftrain.hooks.checkpoint import infer_mode

    assert infer_mode(metric) == mode
    assert ftrain.BestCheckpointHook(metric).mode == mode


def test_best_mode_that_cannot_be_inferred_asks_for_it():
    with pytest.raises(ValueError, match="mode='max' or mode='min'"):
        ftrain.BestCheckpointHook("psnr_db")


def test_best_checkpoint_max_and_min(tmp_path):
    scores = iter([0.5, 0.7, float("nan"), 0.7, 0.6, 0.9, 0.8])

    def evaluate(events):
        for ev in events:
            yield ev
            if isinstance(ev, StepEnd) and ev.is_update:
                v = next(scores)
                yield Evaluated(ev.loop, ev.state, {"acc": v, "val_loss": 1 - v})

    best_acc = ftrain.BestCheckpointHook("acc")
    best_loss = ftrain.BestCheckpointHook("val_loss", out_dir=tmp_path / "loss")
    assert best_acc.mode == "max" and best_loss.mode == "min"
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 7
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        data,
        hooks=[ftrain.hook(evaluate, priority="HIGH"), best_acc, best_loss],
        work_dir=tmp_path,
    ).run()
    assert sorted(p.name for p in tmp_path.glob("best_*.pth")) == ["best_acc_iter_6.pth"]
    assert best_acc.best == 0.9
    assert sorted(p.name for p in (tmp_path / "loss").glob("best_*.pth")) == [
        "best_val_loss_iter_6.pth"
    ]
    saved = load_checkpoint(tmp_path / "best_acc_iter_6.pth")
    assert saved["hooks"]["best_acc"]["best"] == 0.9 and saved["state"]["step"] == 6
    # the best value is remembered across a resume: 0.85 is not a new best
    hook2 = ftrain.BestCheckpointHook("acc")
    hook2.load_state_dict(saved["hooks"]["best_acc"])
    assert not hook2.is_better(0.85) and not hook2.is_better(0.9) and hook2.is_better(0.95)


def test_corrupt_checkpoint_is_detected_and_previous_is_used(tmp_path):
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 4
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        data,
        hooks=[ftrain.CheckpointHook(interval=2)],
        work_dir=tmp_path,
    ).run()
    newest = tmp_path / "iter_4.pth"
    good = newest.read_bytes()
    newest.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(newest)
    newest.write_bytes(good[:-10] + b"0123456789")  # same size, corrupt
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(newest)
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(tmp_path / "garbage.pth")
    assert (tmp_path / "iter_2.pth").exists()
    with pytest.warns(UserWarning, match="Skipping checkpoint"):
        lp = ftrain.Loop(
            ftrain.make_step(mse_loss),
            new_state(),
            data,
            hooks=[],
            work_dir=tmp_path,
            resume="auto",
            max_steps=4,
        )
        lp.run()
    assert lp.resumed_from.name == "iter_2.pth" and lp.state.step == 4


def test_writes_are_atomic_and_manifest_lists_files(tmp_path):
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 3
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        data,
        hooks=[ftrain.CheckpointHook(interval=1)],
        work_dir=tmp_path,
    ).run()
    manifest = orjson.loads((tmp_path / "manifest.json").read_bytes())
    assert [e["name"] for e in manifest["files"]] == ["iter_1.pth", "iter_2.pth", "iter_3.pth"]
    assert all(e["size"] == (tmp_path / e["name"]).stat().st_size for e in manifest["files"])
    assert not list(tmp_path.glob(".*tmp*"))


# ------------------------------------------------------------------- resume
def _straight(step, make_data, total_epochs):
    torch.manual_seed(42)
    state = ftrain.Loop(step, new_state(), make_data(), hooks=[], epochs=total_epochs).run()
    return state


@pytest.mark.parametrize("stop_at", [5, 7, 10, 14])  # mid-window, mid-epoch, epoch end, next epoch
@pytest.mark.parametrize("data_kind", ["stateful", "list"])
def test_kill_and_resume_is_bitwise_exact(tmp_path, stop_at, data_kind):
    batches = [(x, y) for x, y in loader(n=40)]
    make_data = loader if data_kind == "stateful" else (lambda: batches)
    step = composed()
    straight = _straight(step, make_data, 2)

    def stop(events):
        for ev in events:
            yield ev
            if isinstance(ev, StepEnd) and ev.state.micro_step == stop_at:
                raise KeyboardInterrupt

    torch.manual_seed(42)
    with pytest.raises(KeyboardInterrupt):
        ftrain.Loop(
            step,
            new_state(),
            make_data(),
            hooks=[ftrain.hooks.AutoCheckpointHook(), ftrain.hook(stop, priority="HIGHEST")],
            epochs=2,
            work_dir=tmp_path,
        ).run()
    assert (tmp_path / "interrupted.pth").exists()
    torch.manual_seed(0)  # RNG must come from the checkpoint
    lp = ftrain.Loop(
        step,
        new_state(seed=5),
        make_data(),
        hooks=[ftrain.hooks.AutoCheckpointHook()],
        epochs=2,
        work_dir=tmp_path,
        resume="auto",
    )
    resumed = lp.run()
    assert lp.resumed_from.name == "interrupted.pth"
    assert resumed.step == straight.step and resumed.micro_step == straight.micro_step
    assert_bitwise(params(straight), params(resumed))
    sd_a, sd_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sd_a[k]["momentum_buffer"], sd_b[k]["momentum_buffer"]) for k in sd_a)
    assert not (tmp_path / "interrupted.pth").exists()  # a completed run removes it


def test_resume_sees_the_same_batches(tmp_path):
    seen_straight, seen_resumed = [], []

    def recorder(out):
        def h(events):
            for ev in events:
                if isinstance(ev, StepEnd) and ev.batch is not None:
                    out.append(ev.batch[0][0, 0].item())
                yield ev

        return h

    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), loader(), hooks=[recorder(seen_straight)], epochs=2
    ).run()

    def stop(events):
        for ev in events:
            yield ev
            if isinstance(ev, StepEnd) and ev.state.micro_step == 13:
                raise KeyboardInterrupt

    first = []
    with pytest.raises(KeyboardInterrupt):
        ftrain.Loop(
            ftrain.make_step(mse_loss),
            new_state(),
            loader(),
            hooks=[recorder(first), ftrain.hooks.AutoCheckpointHook(), stop],
            epochs=2,
            work_dir=tmp_path,
        ).run()
    ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        loader(),
        hooks=[recorder(seen_resumed)],
        epochs=2,
        work_dir=tmp_path,
        resume="auto",
    ).run()
    assert first + seen_resumed == seen_straight


def test_resume_without_checkpoint_starts_fresh_and_explicit_path(tmp_path):
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 4
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        data,
        hooks=[ftrain.CheckpointHook(2)],
        work_dir=tmp_path,
        resume="auto",
    )
    assert lp.run().step == 4 and lp.resumed_from is None
    lp = ftrain.Loop(
        ftrain.make_step(mse_loss),
        new_state(),
        data,
        hooks=[],
        resume=tmp_path / "iter_2.pth",
        epochs=1,
    )
    lp.run()
    assert lp.resumed_from.name == "iter_2.pth" and lp.state.step == 4
    model = make_model(9)
    missing, unexpected = ftrain.checkpoint.load_weights(model, tmp_path / "iter_4.pth")
    assert missing == [] and unexpected == []
    assert torch.equal(
        model.fc1.weight, load_checkpoint(tmp_path / "iter_4.pth")["state"]["model"]["fc1.weight"]
    )


def test_notebook_style_continue_after_interrupt():
    """Iterating the same loop again continues where it stopped."""
    batches = [(x, y) for x, y in loader(n=40)]
    step = composed()
    straight = _straight(step, lambda: batches, 1)

    torch.manual_seed(42)
    lp = ftrain.Loop(step, new_state(), batches, hooks=[])
    for ev in lp:
        if isinstance(ev, StepEnd) and ev.state.micro_step == 4:
            break  # like a KeyboardInterrupt in a notebook cell
    assert not lp.state.is_consumed
    events = [type(ev) for ev in lp]
    assert events[0] is RunBegin and events[-1] is RunEnd and EpochBegin not in events
    assert EpochEnd in events
    assert_bitwise(params(straight), params(lp.state))


# ----------------------------------------------------- background checkpoint writes
def _manifest(d):
    return [
        (e["name"], e["step"], e["kind"])
        for e in orjson.loads((d / "manifest.json").read_bytes())["files"]
    ]  # noqa: E501


def test_background_writes_give_the_same_files_as_synchronous_ones(tmp_path):
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 7
    runs = {}
    for background in (False, True):
        d = tmp_path / str(background)
        hook = ftrain.CheckpointHook(2, max_keep=2, background=background)
        state = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), data, [hook], work_dir=d).run()
        # when fit returns, every write is complete: files renamed, manifest updated, pruned
        assert not list(d.glob(".*.tmp-*"))
        runs[background] = (_files(d), _manifest(d), params(state))
        for name in _files(d):
            saved = load_checkpoint(
                d / name, expected=ftrain.persist.manifest.Manifest(d).entry(name)
            )
            assert saved["state"]["step"] == int(name[5:-4])
    assert runs[True][0] == runs[False][0] == ["iter_6.pth", "iter_7.pth"]
    assert runs[True][1] == runs[False][1]
    assert_bitwise(runs[True][2], runs[False][2])


def test_a_failed_background_write_surfaces_at_the_next_step(tmp_path, monkeypatch):
    # issue 12: a failed background write used to surface only at the next checkpoint
    import threading

    import ftrain.persist.files as files

    calls = []

    def failing_stage(obj, path):  # the background half of a write: the disk is full
        calls.append(threading.current_thread().name)
        raise OSError(28, "No space left on device")

    def loss_fn(model, batch):
        for t in threading.enumerate():  # make "the write has ended" deterministic
            if t.name == "ftrain-checkpoint":
                t.join()
        return mse_loss(model, batch)

    monkeypatch.setattr(files, "stage_atomic", failing_stage)
    data = [(torch.randn(2, 8), torch.randn(2, 4))] * 10
    hook = ftrain.CheckpointHook(2, save_last=False)
    lp = ftrain.Loop(ftrain.make_step(loss_fn), new_state(), data, [hook], work_dir=tmp_path)
    with pytest.raises(CheckpointError, match=r"iter_2.pth: the disk of .* is full \(.* free\)"):
        lp.run()
    assert calls == ["ftrain-checkpoint"]  # tried once, on the writer thread
    assert lp.state.step == 3  # the step after the save, not the next checkpoint (4)


def test_interrupt_waits_for_pending_background_writes(tmp_path):
    import signal

    calls = []

    def loss_fn(model, batch):
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        calls.append(1)
        return mse_loss(model, batch)

    hooks = [ftrain.CheckpointHook(1, save_last=False), ftrain.hooks.AutoCheckpointHook()]
    with pytest.raises(KeyboardInterrupt):
        ftrain.Loop(
            ftrain.make_step(loss_fn), new_state(), loader(), hooks, work_dir=tmp_path
        ).run()
    names = [n for n, _, _ in _manifest(tmp_path)]
    assert names == ["iter_1.pth", "iter_2.pth", "iter_3.pth", "iter_4.pth", "iter_5.pth",
                     "iter_6.pth", "interrupted.pth"]  # fmt: skip
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_latest_finds_the_newest_state_after_an_interrupted_fit():
    """The notebook pattern: fit raised, the loop is gone, the start state is consumed."""
    import gc
    import signal

    calls = []

    def loss_fn(model, batch):
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)
        calls.append(1)
        return mse_loss(model, batch)

    start = new_state()
    try:
        ftrain.Loop(ftrain.make_step(loss_fn), start, loader(), hooks=[]).run()
    except KeyboardInterrupt:
        pass
    gc.collect()  # nothing but the consumed start state refers to the run any more
    assert start.is_consumed
    state = start.latest()
    assert state.step == 5 and not state.is_consumed
    state = ftrain.Loop(ftrain.make_step(mse_loss), state, loader(), hooks=[], max_steps=10).run()
    assert state.step == 10


def test_a_script_exiting_with_an_abandoned_loop_exits_and_leaves_a_resumable_checkpoint(
    tmp_path,
):
    """Exit with a loop mid-run: no hang (TensorBoard's flush at shutdown), interrupted.pth saved."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import itertools, torch, ftrain
        m = torch.nn.Linear(4, 1)
        state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        hooks = ftrain.default_hooks(checkpoint_every=10, progress=False)
        lp = ftrain.Loop(step, state, itertools.repeat(torch.ones(2, 4)), hooks,
                         max_steps=1000, work_dir={str(tmp_path)!r})
        events = iter(lp)
        for _ in range(30):
            next(events)
        print("exiting at step", lp.state.step)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
    saved = load_checkpoint(tmp_path / "interrupted.pth")
    step = int(next(ln for ln in proc.stdout.splitlines() if ln.startswith("exiting")).split()[-1])
    assert saved["state"]["step"] == step > 10
    assert (tmp_path / "metrics.jsonl").is_file() and list((tmp_path / "tb").glob("events.*"))


# ---------------------------------------------------- bad input (issue 15)
def test_a_one_shot_generator_or_an_empty_loader_with_max_steps_stops_with_the_fix():
    def three():
        yield from loader(n=12)

    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), three(), [], max_steps=10)
    with pytest.raises(ValueError, match=r"gave no batch in epoch 1.*a list, a DataLoader"):
        lp.run()
    assert lp.state.step == 3  # the generator's batches were trained on; nothing ran forever
    empty = torch.utils.data.DataLoader(dataset(n=0), batch_size=4)
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), empty, [], max_steps=10)
    with pytest.raises(ValueError, match=r"gave no batch in epoch 0.*batch_size and drop_last"):
        lp.run()


def test_epochs_over_a_one_shot_generator_is_refused_before_training():
    batches = (b for b in loader(n=12))
    with pytest.raises(ValueError, match=r"one-shot iterator \(generator\).*epochs=5 would train"):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, [], epochs=5)
    # one pass over it is fine
    assert ftrain.Loop(ftrain.make_step(mse_loss), new_state(), batches, []).run().step == 3


@pytest.mark.parametrize("swallow", [False, True])
def test_a_hook_that_stops_passing_events_on_is_named(swallow):
    @ftrain.hook(priority="HIGH")
    def quits(events):
        for ev in events:
            if isinstance(ev, StepEnd) and ev.state.step == 2:
                if swallow:  # keeps reading, passes nothing on
                    for _ in events:
                        pass
                return
            yield ev

    seen = []
    later = ftrain.hooks.on(StepEnd, lambda ev: seen.append(ev.state.step), name="later")
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(n=20), [quits, later])
    with pytest.raises(RuntimeError, match=r"Hook 'quits' stopped passing events on.*\(later\)"):
        lp.run()
    assert seen == [1]


def test_two_stateful_hooks_with_one_name_are_refused_with_the_fix():
    hooks = [ftrain.LoggerHook(every=5), ftrain.LoggerHook(every=50)]
    with pytest.raises(ValueError, match=r"Two hooks are named 'logger'.*every=5.*every=50.*name="):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(), hooks)
    renamed = [hooks[0], ftrain.hook(hooks[1], name="logger_2")]
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(), renamed)
    assert [h.name for h in lp.hooks] == ["logger", "logger_2"]
    assert lp.hooks["logger_2"].priority == 60 and lp.hooks["logger_2"].cadence.steps == 50


def test_a_hook_class_instead_of_an_instance_names_the_fix():
    with pytest.raises(TypeError, match=r"TimerHook is a class.*pass an instance, TimerHook\(\)"):
        ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(), [ftrain.TimerHook])


def test_in_epoch_and_batch_in_epoch_are_public():
    seen = []
    lp = ftrain.Loop(ftrain.make_step(mse_loss), new_state(), loader(n=8), [], epochs=2)
    assert not lp.in_epoch and lp.batch_in_epoch == 0
    for ev in lp:
        seen.append((type(ev).__name__, lp.in_epoch, lp.batch_in_epoch))
    assert seen[:4] == [
        ("RunBegin", False, 0),
        ("EpochBegin", False, 0),
        ("StepEnd", True, 1),
        ("StepEnd", True, 2),
    ]
    assert seen[4] == ("EpochEnd", False, 0)
