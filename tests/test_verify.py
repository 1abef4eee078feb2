"""The resume verifier (``ftrain.verify``) against runs whose outcome is known in advance.

An exact pipeline must give "bitwise equal at N/N"; planted resume faults (a hook with
unsaved state, a loader whose order depends on when its state is taken) and the flush +
evaluation hole of issue 23 must be found at the update, part and key they break, with
the difference computed here in closed form; a nondeterministic run must be called that,
not blamed on resume. The runs are small (12 updates) and fully seeded.
"""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import torch
from helpers import MLP, mse_loss
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain.events import Event, StepEnd
from ftrain.verify import PARTS, verify_resume
from ftrain.verify.campaign import EXIT_CODES, plan
from ftrain.verify.fingerprint import END, difference, digest, flatten

ROOT = Path(__file__).resolve().parent.parent
EPOCHS, BATCHES, EVERY = 3, 10, 3  # 10 batches an epoch in windows of 3: 3 updates and a flush
UPDATES = EPOCHS * -(-BATCHES // EVERY)  # 12


def _tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)


def full_stack(work_dir: Path, resume: str | Path | None, *, eval_every: int = 5,
               by_epoch: bool = False, extra: tuple = ()) -> ftrain.Loop:  # fmt: skip
    """Dropout, AdamW, accumulation with a partial last window (flushed at each epoch's end),
    clipping, a warmup+cosine schedule, EMA, a shuffled StatefulDataLoader, evaluation, the
    best checkpoint, the default hooks (logger, periodic and interrupt checkpoints)."""
    torch.manual_seed(0)
    model = MLP(3, 16, 1, dropout=0.2)
    data = StatefulDataLoader(
        torch.utils.data.TensorDataset(*_tensors(BATCHES * 4, 0)),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    val = _tensors(16, 2)
    S = ftrain.schedules
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=EVERY)
    step = ftrain.with_clip(step, "norm", max_norm=0.5)
    step = ftrain.with_schedule(step, lr=S.warmup(S.cosine(0.05, total=UPDATES), iters=2))
    step = ftrain.with_ema(step, decay=0.9)
    hooks = ftrain.default_hooks(
        log_every=2, checkpoint_every=3, max_keep=2, progress=False, summary=False
    ).add(
        ftrain.EvalHook(
            lambda s: {"val_loss": mse_loss(s.model, val)}, every=eval_every, by_epoch=by_epoch
        ),  # fmt: skip
        ftrain.BestCheckpointHook("val_loss"),
        *extra,
    )
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    return ftrain.Loop(step, state, data, hooks, epochs=EPOCHS, work_dir=work_dir, resume=resume)


def test_an_exact_run_is_bitwise_equal_at_every_update():
    verdict = verify_resume(full_stack)
    assert verdict.ok, verdict
    assert (verdict.updates, verdict.snapshots, verdict.equal) == (
        UPDATES,
        tuple(range(1, UPDATES + 1)),
        UPDATES,
    )
    assert str(verdict).startswith(f"bitwise equal at {UPDATES}/{UPDATES} resume points")


def _better(state: ftrain.TrainState) -> dict[str, float]:
    return {"val_loss": -float(state.step)}  # a new best at every evaluation: always saved


def saving_best_at_epoch_ends(work_dir: Path, resume: str | Path | None) -> ftrain.Loop:
    at_epoch_ends = ftrain.EvalHook(_better, every=1, by_epoch=True, name="better")
    return full_stack(work_dir, resume, eval_every=UPDATES, extra=(at_epoch_ends,))


def test_resume_at_an_epoch_end_flush_with_an_evaluation_is_exact():
    """The issue's "done when" sweep: every update of a full-stack run with a partial last
    window and evaluations (and best-checkpoint saves) at epoch ends.

    On ftrain 0.2 the verifier found the issue-23 hole here: the snapshots at the flushes
    ending epochs 0 and 1 (updates 4 and 8) resumed into a next epoch read in another order
    (``data order`` at micro-batches 11 and 21), because the resumed run's best-checkpoint
    save took the loader's ``state_dict()`` before the epoch began. Now every point is exact."""

    verdict = verify_resume(saving_best_at_epoch_ends)
    assert verdict.ok, str(verdict)
    assert verdict.equal == verdict.points == UPDATES


# ------------------------------------------------------------------ planted resume faults
class CountingHook:
    """A hook with unsaved state: ``calls`` counts the updates it saw and is not saved, so
    ``total`` (saved) grows differently after a resume. After update j, uninterrupted:
    ``total = j (j + 1) / 2``; resumed from update k: ``k (k + 1) / 2 + (j - k)(j - k + 1) / 2``:
    at update k + 1 they differ by ``k``."""

    name = "planted"

    def __init__(self) -> None:
        self.calls = 0  # the fault: not in state_dict()
        self.total = 0

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.total = saved["total"]

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        for ev in events:
            if type(ev) is StepEnd and ev.is_update:
                self.calls += 1
                self.total += self.calls
            yield ev


def plain(
    work_dir: Path, resume: str | Path | None, *, hooks: tuple = (), data=None
) -> ftrain.Loop:
    """SGD on 8 fixed batches an epoch, 2 epochs, the default hooks and ``hooks``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = _tensors(32, 5)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 32, 4)]
    hooks = (*ftrain.default_hooks(log_every=1, progress=False, summary=False), *hooks)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ftrain.make_step(mse_loss)
    return ftrain.Loop(step, state, data if data is not None else batches, hooks, epochs=2,
                       work_dir=work_dir, resume=resume)  # fmt: skip


def with_counting_hook(work_dir: Path, resume: str | Path | None) -> ftrain.Loop:
    return plain(work_dir, resume, hooks=(CountingHook(),))


def test_a_hook_with_unsaved_state_is_found_as_hook_state():
    verdict = verify_resume(with_counting_hook)
    n = verdict.updates
    assert n == 16 and verdict.equal == 1  # only the snapshot at the last update continues
    got = [(d.source, d.update, d.part, d.key, d.max_difference) for d in verdict.divergences]
    assert got == [
        (f"resumed from the snapshot at update {k}", k + 1, "hook state", "planted.total", k)
        for k in range(1, n)
    ]
    assert str(verdict).splitlines()[1] == (
        "  resumed from the snapshot at update 1: first divergence at update 2: hook state: "
        "planted.total: 3 vs 2 (max difference 1)"
    )


def logging_counter(log: str) -> ftrain.hooks.Hook:
    """A stateless hook that writes a line every 3rd update *it has seen* (its own count,
    not the run's step): a resumed run writes its lines at other updates."""

    def counter(events: Iterator[Event]) -> Iterator[Event]:
        seen = 0
        loop = None
        for ev in events:
            loop = loop or ev.loop
            if type(ev) is StepEnd and ev.is_update:
                seen += 1
                if seen % 3 == 0:
                    with open(Path(loop.work_dir) / log, "ab") as f:
                        f.write(orjson.dumps({"step": ev.state.step}) + b"\n")
            yield ev

    return ftrain.hooks.Hook(counter, name="counter")


def with_logging_counter(work_dir: Path, resume: str | Path | None) -> ftrain.Loop:
    return plain(work_dir, resume, hooks=(logging_counter("counter.jsonl"),))


def test_a_hook_logging_by_an_unsaved_count_is_found_as_log_lines():
    verdict = verify_resume(with_logging_counter, points=[4])
    # uninterrupted: lines at updates 3, 6, 9...; resumed from 4: at 7, 10...: update 6 lacks one
    (d,) = verdict.divergences
    assert (d.update, d.part, d.key) == (6, "log lines", "counter.jsonl line 2")
    assert d.detail == "only in the uninterrupted run"


class KeyedLoader:
    """A planted fault: batches shuffled each epoch by a key, and ``state_dict()`` draws a
    new key from the loader's generator, so the order depends on when its state is taken."""

    def __init__(self) -> None:
        self.x, self.y = _tensors(32, 5)
        self.rng = torch.Generator().manual_seed(0)
        self.key, self.pos = 0, 0

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(32, generator=torch.Generator().manual_seed(self.key))
        while self.pos < 8:
            idx = order[self.pos * 4 : self.pos * 4 + 4]
            self.pos += 1
            yield self.x[idx], self.y[idx]
        self.pos, self.key = 0, self.key + 1

    def state_dict(self) -> dict:
        self.key = int(torch.randint(1 << 30, (1,), generator=self.rng))  # the fault
        return {"key": self.key, "pos": self.pos, "rng": self.rng.get_state()}

    def load_state_dict(self, saved: dict) -> None:
        self.key, self.pos = saved["key"], saved["pos"]
        self.rng.set_state(saved["rng"])


def with_keyed_loader(work_dir: Path, resume: str | Path | None) -> ftrain.Loop:
    return plain(work_dir, resume, data=KeyedLoader())


def test_a_loader_whose_order_depends_on_when_its_state_is_taken_is_found_as_data_order():
    verdict = verify_resume(with_keyed_loader)
    # saving a checkpoint in epoch 0 re-keys epoch 1: it reads another order from update 9
    d = verdict.divergences[0]
    assert d.source == "an uninterrupted run saving checkpoints (the last before it: update 8)"
    assert (d.update, d.part, d.key) == (9, "data order", "micro-batch 9.0")
    assert not verdict.nondeterministic and verdict.snapshots == tuple(range(1, 9))


def unseeded(work_dir: Path, resume: str | Path | None) -> ftrain.Loop:
    """Data drawn from a generator seeded by the operating system: every run differs."""
    torch.manual_seed(0)
    g = torch.Generator()
    g.seed()
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]
    return plain(work_dir, resume, data=batches)


def test_a_nondeterministic_run_is_reported_as_such_not_as_a_resume_fault():
    verdict = verify_resume(unseeded, points=[2])
    assert verdict.nondeterministic and not verdict.ok
    (d,) = verdict.divergences
    assert (d.source, d.update, d.part, d.key) == (
        "a second uninterrupted run",
        1,
        "data order",
        "micro-batch 1.0",
    )
    assert str(verdict).startswith("nondeterministic: a second uninterrupted run: first ")


# ------------------------------------------------------------------------ signals
@pytest.mark.slow  # subprocesses
def test_signals_in_subprocesses_arrive_and_the_resumed_runs_are_exact():
    kinds = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    verdict = verify_resume(full_stack, points=0, signals=3, kinds=kinds, seed=3)
    assert verdict.ok, verdict
    planned = [d for campaign in plan(3, kinds, BATCHES * EPOCHS, 3) for d in campaign]
    got = [(s.signal, s.micro_batch, s.exit_code) for s in verdict.signals]
    assert got == [(sig.name, m, EXIT_CODES[sig]) for sig, m in planned]  # each one arrived
    assert {s.signal for s in verdict.signals} == {"SIGINT", "SIGTERM", "SIGKILL"}
    for s in verdict.signals:  # SIGINT/SIGTERM: the interrupt checkpoint; SIGKILL: a periodic
        periodic = s.resumed_from is None or re.fullmatch(r"iter_\d+\.pth", s.resumed_from)
        assert s.resumed_from == "interrupted.pth" if s.signal != "SIGKILL" else periodic, s
    assert verdict.equal == verdict.points == 3


@pytest.mark.slow  # subprocesses
def test_a_subprocess_resumed_after_a_signal_finds_the_planted_hook():
    verdict = verify_resume(with_counting_hook, points=0, signals=1, kinds=[signal.SIGTERM], seed=1)
    (s,) = verdict.signals
    (d,) = verdict.divergences
    k = s.micro_batch  # one micro-batch an update: the run stopped after update k
    assert s.resumed_from == "interrupted.pth" and s.exit_code == ftrain.loop.PREEMPTED_EXIT_CODE
    assert (d.update, d.part, d.key, d.max_difference) == (k + 1, "hook state", "planted.total", k)
    assert d.source == f"resumed after SIGTERM at micro-batch {k} (campaign 0)"


# ------------------------------------------------------------------ the pieces
def test_digests_are_bitwise_and_differences_name_the_tensor():
    assert digest({"w": torch.tensor([0.0])}) != digest({"w": torch.tensor([-0.0])})
    assert digest({"w": torch.tensor([1.0])}) != digest(
        {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
    )
    assert digest({"a": 1}) != digest({"a": 1.0}) and digest({"a": 1}) != digest({"b": 1})
    x = torch.arange(6.0).reshape(2, 3)
    ref = {"weights": {"fc.weight": x, "fc.bias": torch.zeros(2)}}
    got = {
        "weights": {
            "fc.weight": x + torch.tensor([[0, 0, 0], [0, 2**-9, 0]]),  # exact in float32
            "fc.bias": torch.zeros(2),
        }
    }
    assert difference("weights", ref, got) == (
        "fc.weight",
        "max difference 0.00195",
        2**-9,
    )
    assert flatten({"opt": {"state": {0: {"m": 1}}, "groups": [{"lr": 0.1}], "e": []}}) == {
        "opt.state.0.m": 1,
        "opt.groups.0.lr": 0.1,
        "opt.e": "[]",
    }
    assert PARTS[0] == "data order" and END > 10**9


def test_bad_arguments_are_refused_before_any_training(tmp_path):
    with pytest.raises(TypeError, match="build must be a function"):
        verify_resume("train:build")
    with pytest.raises(ValueError, match="points must be None"):
        verify_resume(with_counting_hook, points=-1)
    with pytest.raises(ValueError, match="signals must be a whole number"):
        verify_resume(with_counting_hook, signals=True)
    with pytest.raises(ValueError, match="kinds must be signals of"):
        verify_resume(with_counting_hook, kinds=[signal.SIGHUP])
    with pytest.raises(TypeError, match="cannot load build"):
        verify_resume(lambda w, r: plain(w, r), signals=1)
    mine = tmp_path / "mine"
    with pytest.raises(ValueError, match="made a Loop with work_dir="):
        verify_resume(lambda work_dir, resume: plain(mine, resume))
    assert not mine.exists()  # nothing was written into the user's directory
    with pytest.raises(ValueError, match="made a Loop with resume='auto'"):
        verify_resume(lambda work_dir, resume: plain(work_dir, "auto"))
    with pytest.raises(ValueError, match="the run has no update 99"):
        verify_resume(with_counting_hook, points=[99])


@pytest.mark.slow  # subprocesses
def test_command_line(tmp_path):
    script = tmp_path / "mytrain.py"
    tests = str(Path(__file__).parent)
    script.write_text(
        f"import sys\nsys.path.insert(0, {tests!r})\n"
        "from test_verify import with_counting_hook, plain\n\n"
        "def build(work_dir, resume):\n    return plain(work_dir, resume)\n"
    )
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    ok = run([sys.executable, "-m", "ftrain.verify", "mytrain:build", "--points", "3"])
    assert ok.returncode == 0, ok.stderr
    assert re.match(
        r"bitwise equal at 3/3 resume points \(3 snapshots, 0 signals; 16 updates", ok.stdout
    )
    assert re.search(r"^wall time: \d+\.\d s$", ok.stdout, re.M)
    bad = run(
        [sys.executable, "-m", "ftrain.verify", "mytrain:with_counting_hook", "--points", "1"]
    )
    assert bad.returncode == 1 and "hook state: planted.total" in bad.stdout
    wrong = run([sys.executable, "-m", "ftrain.verify", "mytrain"])
    assert wrong.returncode == 2 and "module:function" in wrong.stderr


@pytest.mark.slow
def test_the_demo_verifies_bitwise_at_every_update_and_prints_its_wall_time():
    """`python -m ftrain.verify ftrain.demo:build_short`: the figure docs/verify.md quotes."""
    proc = subprocess.run(
        [sys.executable, "-m", "ftrain.verify", "ftrain.demo:build_short"],
        capture_output=True, text=True, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("bitwise equal at 12/12 resume points"), proc.stdout
    print(proc.stdout)


def test_the_docs_page_snippets_run(tmp_path, monkeypatch):
    page = ROOT / "docs" / "verify.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/verify.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    assert namespace["verdict"].ok


def test_doctests():
    import doctest

    import ftrain.verify as package
    from ftrain.verify import __main__, campaign, core, fingerprint, verdict

    for module in (package, __main__, campaign, core, fingerprint, verdict):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, module.__name__
