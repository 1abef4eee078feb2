"""Retention as data (ftrain.hooks.keep): what a run keeps is a pure function of its manifest.

The predicted sets are computed here from the save points and the evaluation values alone
(closed form), never by the policy code; the files are read from the disk.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch
from helpers import mse_loss

import ftrain
from ftrain.events import Evaluated, StepEnd
from ftrain.hooks.evaluation import EvalHook
from ftrain.hooks.keep import keep_any, keep_best, keep_every, keep_latest, stale, with_metrics
from ftrain.hooks.wallclock import every_minutes

UPDATES, INTERVAL, EVAL_EVERY, FOREVER, STOP_AT = 10_000, 100, 500, 2500, 3050


def val_loss(step: int) -> float:
    """A deterministic, non-monotone evaluation value per update."""
    return ((step * 7919) % 1009) / 1009


def predicted(last: int) -> set[str]:
    """What keep_latest(2) | keep_every(2500) | keep_best(2, val_loss, min) keeps of saves every 100 updates
    up to ``last``, evaluations every 500 (closed form: no policy code)."""
    saves = list(range(INTERVAL, last + 1, INTERVAL))
    newest = set(saves[-2:])
    forever = {n for n in saves if n % FOREVER == 0}
    evaluated = sorted((val_loss(n), -n) for n in saves if n % EVAL_EVERY == 0)
    best_two = {-m for _, m in evaluated[:2]}
    return {f"iter_{n}.pth" for n in newest | forever | best_two}


def policy():
    return keep_latest(2) | keep_every(FOREVER) | keep_best(2, "val_loss", mode="min")


def tiny_state(seed: int = 0) -> ftrain.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 1)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=1e-3))


def tiny_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 2, generator=g), torch.randn(2, 1, generator=g)) for _ in range(50)]


def periodic(d: Path) -> set[str]:
    return {p.name for p in d.glob("iter_*.pth")}


def manifest_names(d: Path, run: str | None = None) -> set[str]:
    files = orjson.loads((d / "manifest.json").read_bytes())["files"]
    return {e["name"] for e in files if run is None or e.get("run") == run}


def _stop_at(step: int):
    def stop(events):
        for ev in events:
            yield ev
            if type(ev) is StepEnd and ev.state.step == step:
                raise KeyboardInterrupt

    return ftrain.hook(stop, cadence=ftrain.Every(at=(step,)), priority="LOWEST")


def _hooks(extra=()):
    ev = EvalHook(lambda s: {"val_loss": val_loss(s.step)}, every=EVAL_EVERY, by_epoch=False)
    keep = ftrain.CheckpointHook(INTERVAL, keep=policy())
    return [ev, keep, ftrain.hooks.AutoCheckpointHook(), *extra]


def _another_run_and_user_files(here: Path, there: Path) -> dict[str, bytes]:
    """Another run's checkpoints in ``here`` (iter_1..3), a user's files, and a start point in
    ``there`` for our run (a fresh run would refuse a directory of another run's files)."""
    ftrain.Loop(ftrain.make_step(mse_loss), tiny_state(1), tiny_data(),
                [ftrain.CheckpointHook(1)], work_dir=here, max_steps=3).run()  # fmt: skip
    ftrain.Loop(ftrain.make_step(mse_loss), tiny_state(2), tiny_data(),
                [ftrain.CheckpointHook(1)], work_dir=there, max_steps=1).run()  # fmt: skip
    torch.save({"weight": torch.ones(2)}, here / "model_final.pth")  # a user's own file
    (here / "notes.txt").write_text("keep me")
    return {p.name: p.read_bytes() for p in here.iterdir() if p.suffix in (".pth", ".txt")}


def test_10k_updates_keep_exactly_the_predicted_set_across_a_resume(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    others = _another_run_and_user_files(here, there)
    other_run = orjson.loads((here / "manifest.json").read_bytes())["run"]
    step = ftrain.make_step(mse_loss)

    a = ftrain.Loop(step, tiny_state(), tiny_data(), _hooks([_stop_at(STOP_AT)]),
                    work_dir=here, resume=there / "iter_1.pth", max_steps=UPDATES)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        a.run()
    run = a.run_id
    assert run != other_run
    assert periodic(here) - set(others) == predicted(STOP_AT)  # 2900, 3000, 2500, 2 best
    assert (here / "interrupted.pth").exists()

    seen = []  # at each evaluation of the resumed run: is the interrupted save still there?

    def look(events):
        for ev in events:
            yield ev
            if type(ev) is Evaluated:
                seen.append((ev.state.step, (here / "interrupted.pth").exists(), periodic(here)))

    b = ftrain.Loop(step, tiny_state(), tiny_data(), _hooks([ftrain.hook(look, priority="LOWEST")]),
                    work_dir=here, resume="auto", max_steps=UPDATES)  # fmt: skip
    b.run()
    assert b.run_id == run and str(b.resumed_from).endswith("interrupted.pth")
    expected = predicted(UPDATES)
    print(f"kept after {UPDATES} updates: {sorted(expected, key=lambda n: int(n[5:-4]))}")
    assert periodic(here) - set(others) == expected
    assert manifest_names(here, run) == expected  # and the manifest agrees
    # the interrupted (preemption) save survived every prune until the run completed
    assert len(seen) == (UPDATES - STOP_AT) // EVAL_EVERY + 1 and all(s[1] for s in seen)
    # nothing the policy did not select, nor another run's file, was deleted or changed
    assert {n: (here / n).read_bytes() for n in others} == others
    assert manifest_names(here, other_run) == {"iter_1.pth", "iter_2.pth", "iter_3.pth"}
    # at every evaluation the kept set was the closed form of the saves so far
    for n, _, files in seen:
        assert files - set(others) == predicted(n), n


def _synthetic_run(policy, updates, every_save, every_eval, resume_at):
    """Drive :func:`stale` as the hook does: save (prune), evaluate (record, prune); at
    ``resume_at`` the entries go through JSON (a new process reading the manifest)."""
    entries = [
        {"name": "iter_5.pth", "kind": "periodic", "run": "other", "step": 5},
        {"name": "best_val_loss_iter_40.pth", "kind": "best", "run": "me", "step": 40},
        {"name": "interrupted.pth", "kind": "interrupted", "run": "me", "step": 3},
    ]
    fixed = {e["name"] for e in entries}
    dropped: list[str] = []
    for n in range(every_save, updates + 1, every_save):
        entries.append({"name": f"iter_{n}.pth", "kind": "periodic", "run": "me", "step": n,
                        "micro_step": n, "generation": n})  # fmt: skip
        gone = stale(entries, "me", policy)
        if n % every_eval == 0:
            entries = [e for e in entries if e["name"] not in gone]
            dropped += gone
            entries[-1] = with_metrics(entries[-1], {"val_loss": val_loss(n), "acc": "n/a"})
            gone = stale(entries, "me", policy)
        assert not fixed & set(gone)  # another run's, best and interrupted: never
        dropped += gone
        entries = [e for e in entries if e["name"] not in gone]
        if n == resume_at:
            entries = orjson.loads(orjson.dumps(entries))
    return {e["name"] for e in entries} - fixed, dropped


def test_the_selection_is_a_pure_function_of_the_manifest_entries():
    kept, dropped = _synthetic_run(policy(), UPDATES, INTERVAL, EVAL_EVERY, resume_at=STOP_AT - 50)
    assert kept == predicted(UPDATES)
    assert len(dropped) == len(set(dropped)) == UPDATES // INTERVAL - len(kept)
    # the same entries in any order, read back from JSON, select the same
    again, _ = _synthetic_run(policy(), UPDATES, INTERVAL, EVAL_EVERY, resume_at=-1)
    assert again == kept


def test_each_policy_alone_and_max_keep_as_latest():
    es = [{"name": f"iter_{n}.pth", "kind": "periodic", "run": "r", "step": n,
           "metrics": {"acc": [0.5, 0.9, 0.1, 0.9, 0.3][n - 1]}} for n in range(1, 6)]  # fmt: skip
    assert stale(es, "r", keep_latest(2)) == ["iter_3.pth", "iter_2.pth", "iter_1.pth"]
    assert stale(es, "r", keep_every(2)) == ["iter_3.pth", "iter_1.pth"]  # and the newest, 5
    # best 2 by acc (max): 4 and 2 tie at 0.9, both kept; 5 is the newest
    assert stale(es, "r", keep_best(2, "acc")) == ["iter_3.pth", "iter_1.pth"]
    assert stale(es, "r", keep_best(1, "acc")) == ["iter_3.pth", "iter_2.pth", "iter_1.pth"]
    either = stale(es, "r", keep_latest(1) | keep_every(3))
    assert stale(es, "r", keep_any(keep_latest(1), keep_every(3))) == either
    # the metric in the spelling the logs show (val/acc) finds the evaluation's 'acc'
    assert stale(es, "r", keep_best(1, "val/acc")) == stale(es, "r", keep_best(1, "acc"))
    assert stale(es, "other", keep_latest(1)) == []
    assert ftrain.CheckpointHook(5, max_keep=3).keep == keep_latest(3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: keep_latest(0), r"latest\(k\): k must be a whole number >= 1, got 0"),
        (lambda: keep_every(-1), r"every\(n\): n must be a whole number >= 1, got -1"),
        (lambda: keep_every(2, count="epochs"), r"count must be one of"),
        (lambda: keep_best(0, "acc"), r"best\(k, metric\): k must be a whole number >= 1"),
        (lambda: keep_best(1, "acc", mode="up"), r"mode must be 'min' or 'max', got 'up'"),
        (lambda: keep_best(1, ""), r"metric must be a metric's name"),
        (lambda: keep_any(), r"keep_any\(\*policies\) takes retention policies"),
        (lambda: keep_any(keep_latest(1), 3), r"keep_any\(\*policies\) takes retention policies"),
        (lambda: keep_latest(1) | 3, r"unsupported operand"),
        (lambda: ftrain.CheckpointHook(keep=3), r"keep must be a retention policy"),
        (lambda: ftrain.CheckpointHook(max_keep=2, keep=keep_latest(1)), r"not both"),
        (lambda: ftrain.CheckpointHook(count="iters"), r"count must be one of"),
        (lambda: ftrain.CheckpointHook(2, by_epoch=True, count="micro_batches"), r"by_epoch"),
        (lambda: ftrain.CheckpointHook(save_every=30), r"save_every must be"),
        (lambda: every_minutes(0), r"minutes must be a number > 0, got 0"),
        (lambda: every_minutes(1, clock=5), r"clock must be a function"),
    ],
)
def test_bad_policy_arguments_are_refused_clearly(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_save_every_minutes_with_an_injected_clock(tmp_path):
    now = [0.0]

    def loss(model, batch):  # each update takes 7 minutes of the test's clock
        now[0] += 7 * 60
        return mse_loss(model, batch)

    hook = ftrain.CheckpointHook(10**6, save_last=False, save_every=every_minutes(30,
                                 clock=lambda: now[0]), background=False)  # fmt: skip
    ftrain.Loop(ftrain.make_step(loss), tiny_state(), tiny_data(), [hook], work_dir=tmp_path,
                max_steps=22).run()  # fmt: skip
    expected, since = [], 0
    for n in range(1, 23):  # the clock after update n is 7n minutes
        if 7 * n - since >= 30:
            expected.append(n)
            since = 7 * n
    assert expected == [5, 10, 15, 20]
    assert periodic(tmp_path) == {f"iter_{n}.pth" for n in expected}


def test_interval_in_micro_batches_names_files_by_micro_batch(tmp_path):
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=4)
    hook = ftrain.CheckpointHook(6, count="micro_batches", max_keep=2)
    lp = ftrain.Loop(step, tiny_state(), tiny_data()[:16], [hook], work_dir=tmp_path, max_steps=4)
    lp.run()
    # saves after micro-batches 6, 12 (inside windows) and 16 (the end); max_keep=2
    assert periodic(tmp_path) == {"iter_12.pth", "iter_16.pth"}
    saved = torch.load(tmp_path / "iter_12.pth", weights_only=False)["meta"]
    assert (saved["step"], saved["micro_step"]) == (3, 12)


def test_the_docs_section_runs_and_keeps_what_it_says(capsys):
    page = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "checkpoints.md"
    section = page.read_text().split("## Which checkpoints are kept")[1].split("\n## ")[0]
    blocks = section.split("```python\n")[1:]
    assert blocks
    for i, block in enumerate(blocks):
        code = block.split("```")[0]
        exec(compile(code, f"docs/concepts/checkpoints.md keep block {i + 1}", "exec"), {})  # noqa: S102
    shown = eval(capsys.readouterr().out.strip().splitlines()[-1])  # noqa: S307
    assert shown == ["iter_20.pth", "iter_35.pth", "iter_40.pth"]  # what the page says


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.suffix == ".pth"}


def _evaluate_then_best(metric_of_step):
    ev = EvalHook(lambda model: {"val_loss": metric_of_step()}, every=1, by_epoch=False)
    return [ev, ftrain.BestCheckpointHook("val_loss")]


def test_a_run_resumed_into_another_runs_directory_never_overwrites_or_prunes_its_files(tmp_path):
    """Run B's checkpoints (iter_1..8, its best) in ``y``; run A's checkpoint of update 5
    resumed into ``y``: A's save of iter_6 would overwrite B's file of that name, so it is
    refused naming the file; B's best file is not A's to clean up."""
    x, y = tmp_path / "x", tmp_path / "y"
    step, n = ftrain.make_step(mse_loss), iter(range(100))
    hooks = [ftrain.CheckpointHook(1), *_evaluate_then_best(lambda: 1.0 / (1 + next(n)))]
    ftrain.Loop(step, tiny_state(1), tiny_data(), hooks, work_dir=y, max_steps=8).run()
    ftrain.Loop(step, tiny_state(2), tiny_data(), [ftrain.CheckpointHook(5)], work_dir=x,
                max_steps=5).run()  # fmt: skip
    b_files = _bytes(y)
    assert "best_val_loss_iter_8.pth" in b_files
    hooks = [ftrain.CheckpointHook(1), *_evaluate_then_best(lambda: 0.5)]
    a = ftrain.Loop(step, tiny_state(2), tiny_data(), hooks, work_dir=y,
                    resume=x / "iter_5.pth", max_steps=7)  # fmt: skip
    with pytest.raises(ftrain.CheckpointError, match=r"iter_6\.pth: that file is a checkpoint of "
                       r"another run .*Resume into the checkpoint's own directory"):  # fmt: skip
        a.run()
    after = _bytes(y)
    assert {k: after.get(k) for k in b_files} == b_files  # every file of B, byte for byte


def test_a_resume_from_an_older_checkpoint_keeps_it_until_the_run_saves(tmp_path):
    """resume=<iter_3> with max_keep=1 where iter_4 and iter_5 (the branch left) exist: the
    checkpoint resumed from is not pruned at the start; after the run's own saves, keep
    holds the newest of this branch."""
    d = tmp_path / "run"
    step = ftrain.make_step(mse_loss)
    ftrain.Loop(step, tiny_state(), tiny_data(), [ftrain.CheckpointHook(1, max_keep=3)],
                work_dir=d, max_steps=5).run()  # fmt: skip
    assert periodic(d) == {"iter_3.pth", "iter_4.pth", "iter_5.pth"}
    seen = []

    def look(events):
        for ev in events:
            if isinstance(ev, StepEnd) and not seen:  # update 4: after every hook's set-up
                seen.append(periodic(d))
            yield ev

    hooks = [ftrain.CheckpointHook(3, max_keep=1), ftrain.hook(look, priority="LOWEST")]
    ftrain.Loop(step, tiny_state(), tiny_data(), hooks, work_dir=d, resume=d / "iter_3.pth",
                max_steps=6).run()  # fmt: skip
    assert "iter_3.pth" in seen[0]
    assert periodic(d) == {"iter_6.pth"}
