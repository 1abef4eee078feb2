"""``verify_resume``: the uninterrupted run, its resume points, the comparison."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs

from ftrain.loop import Loop
from ftrain.persist.rng import capture_rng, restore_rng
from ftrain.verify.campaign import EXIT_CODES, Campaigns, plan, portable
from ftrain.verify.fingerprint import END, VOLATILE, difference
from ftrain.verify.record import (
    Build,
    Mismatch,
    Snapshot,
    Snapshots,
    Trace,
    check_fresh,
    fresh_dir,
    open_loop,
    record,
)
from ftrain.verify.verdict import Divergence, Verdict

__all__ = ["verify_resume", "KINDS"]

#: The signals a campaign picks from by default.
KINDS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


@attrs.define
class _Session:
    """One verification: the user's ``build``, a scratch directory, the starting RNG."""

    build: Build
    root: Path
    rng: dict
    volatile: tuple[str, ...]
    say: Callable[[str], None] = print
    last: Loop | None = None

    def open(self, work_dir: Path, resume: str | Path | None) -> Loop:
        """``build`` a run from the starting global RNG state (every run starts alike)."""
        restore_rng(self.rng)
        loop = open_loop(self.build, work_dir, resume)
        check_fresh(loop, self.last)
        self.last = loop
        return loop

    def run(self, name: str, resume: str | Path | None = None, **kw: object) -> Mismatch | None:
        """``build`` a run in ``root/name`` and record it."""
        loop = self.open(fresh_dir(self.root / name), resume)
        return record(loop, volatile=self.volatile, **kw)  # type: ignore[arg-type]

    def reference(self) -> Trace:
        trace = Trace(store=fresh_dir(self.root / "reference-fingerprints"))
        self.run("reference", trace=trace)
        self.say(f"the uninterrupted run: {len(trace.updates)} updates")
        return trace

    def resume(self, snap: Snapshot, ref: Trace) -> Divergence | None:
        """Resume ``snap`` in a new Loop; its first difference from ``ref``, if any."""
        source = f"resumed from the snapshot at update {snap.update}"
        work_dir = fresh_dir(self.root / f"resumed-{snap.update}")
        snap.prefill(work_dir)
        loop = self.open(work_dir, snap.path)
        try:
            found = record(loop, trace=Trace(), against=ref, volatile=self.volatile)
        except Exception as exc:
            raise RuntimeError(
                f"verify_resume: the run {source} failed ({type(exc).__name__}: {exc}); its "
                "traceback is above."
            ) from exc
        if found is None:
            self.say(f"{source}: bitwise equal")
            return None
        self.say(f"{source}: differs at update {found.update} ({found.parts[0]})")
        return explain(found, ref, source)


def explain(found: Mismatch, ref: Trace, source: str) -> Divergence:
    """The :class:`Divergence` a :class:`Mismatch` with the reference ``ref`` shows."""
    part, also = found.parts[0], tuple(found.parts[1:])
    if found.fingerprint is None:
        return Divergence(source, found.update, part, "updates", found.note, None, also)
    key, detail, diff = difference(part, ref.full(found.update), found.fingerprint)
    return Divergence(source, found.update, part, key, detail, diff, also)


def choose_points(points: int | Sequence[int] | None, updates: list[int], seed: int) -> list[int]:
    """The updates to resume from: all (``None``), ``points`` of them drawn with ``seed``, or
    those listed.

    Example:
        >>> choose_points(None, [1, 2, 3], 0), choose_points([3, 1], [1, 2, 3], 0)
        ([1, 2, 3], [1, 3])
    """
    if points is None or isinstance(points, int) and points >= len(updates):
        return list(updates)
    if isinstance(points, int):
        return sorted(random.Random(f"ftrain.verify-points-{seed}").sample(updates, points))
    bad = sorted({p for p in points if p not in updates})
    if bad:
        raise ValueError(
            f"verify_resume(points=...): the run has no update {bad[0]}; it made updates "
            f"{updates[0]}..{updates[-1]}. Pass updates of that range, a count, or None (all)."
        )
    return sorted(set(points))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check(build: Build, points: object, signals: object, kinds: Sequence[int]) -> None:
    """Bad arguments fail here, before any training."""
    if not callable(build):
        raise TypeError(
            "verify_resume: build must be a function (work_dir, resume) -> ftrain.Loop, "
            f"got {build!r}."
        )
    listed = isinstance(points, Sequence) and all(_is_count(p) and p for p in points)
    if not (points is None or _is_count(points) or listed):
        raise ValueError(
            "verify_resume: points must be None (every update), a count >= 0 or a list of "
            f"updates >= 1, got {points!r}."
        )
    if not _is_count(signals):
        raise ValueError(f"verify_resume: signals must be a whole number >= 0, got {signals!r}.")
    if not kinds or any(k not in EXIT_CODES for k in kinds):
        raise ValueError(
            f"verify_resume: kinds must be signals of {[s.name for s in EXIT_CODES]}, "
            f"got {list(kinds)!r}."
        )


@contextlib.contextmanager
def _workspace(directory: str | os.PathLike | None) -> Iterator[Path]:
    if directory is not None:
        yield Path(directory)
        return
    with tempfile.TemporaryDirectory(prefix="ftrain-verify-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def verify_resume(
    build: Build,
    *,
    points: int | Sequence[int] | None = None,
    signals: int = 0,
    kinds: Sequence[int] = KINDS,
    seed: int = 0,
    directory: str | os.PathLike | None = None,
    volatile: Sequence[str] = VOLATILE,
    quiet: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Verdict:
    """Check that your run resumes bitwise: from a checkpoint at every update, and after signals.

    ``build(work_dir, resume)`` makes your run: the :class:`ftrain.Loop` your script makes,
    with ``work_dir=work_dir, resume=resume`` passed on (``None``: a fresh run; a checkpoint
    path; ``"auto"``). Each run gets its own temporary directory (``directory``: keep them
    there); nothing is written into yours. The uninterrupted run is recorded (weights,
    optimizer, transform state, RNG, each update's batches, hook state, log lines after
    every update), run again saving a checkpoint (as ``CheckpointHook`` does) at ``points``
    (``None``: every update; a count, drawn with ``seed``; or a list), and each checkpoint is
    resumed in a new Loop from ``build`` and compared update by update. ``signals=N``: also N
    signals of ``kinds`` raised in the forward of seeded micro-batches in subprocesses that
    resume with ``resume="auto"``. ``volatile``: log and hook-state keys not compared
    (times, throughput). ``quiet``: the runs' printing is discarded. ``progress``: called
    with a line as each run ends. docs/verify.md explains the report.

    Example:
        >>> import torch, ftrain
        >>> from ftrain.verify import verify_resume
        >>> def build(work_dir, resume):
        ...     torch.manual_seed(0)
        ...     model = torch.nn.Linear(4, 1)
        ...     state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters()))
        ...     step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        ...     data = [torch.randn(8, 4) for _ in range(6)]
        ...     return ftrain.Loop(step, state, data, ftrain.default_hooks(progress=False),
        ...                        work_dir=work_dir, resume=resume)
        >>> print(verify_resume(build))  # doctest: +ELLIPSIS
        bitwise equal at 6/6 resume points (6 snapshots, 0 signals; 6 updates; ... s)
    """
    _check(build, points, signals, kinds)
    remote = portable(build) if signals else build  # what the subprocesses load
    start = time.perf_counter()
    with _workspace(directory) as root, _quiet(quiet):
        say = progress or (lambda line: None)
        session = _Session(build, root, capture_rng(), tuple(volatile), say)
        verdict = _verify(session, remote, points, signals, kinds, seed, quiet)
    return attrs.evolve(verdict, seconds=time.perf_counter() - start)


def _saving(
    session: _Session, ref: Trace, at: list[int]
) -> tuple[list[Snapshot], list[Divergence], bool]:
    """The run saving checkpoints at ``at``: its snapshots from before any divergence; the
    divergence (``True``: the uninterrupted run differs from itself: nondeterminism)."""
    snapshots = Snapshots(fresh_dir(session.root / "snapshots"), frozenset(at))
    saving = session.run("saving", trace=Trace(), against=ref, snapshots=snapshots)
    session.say(f"the run saving {len(at)} checkpoints: {'equal' if saving is None else 'differs'}")
    if saving is None:
        return snapshots.taken, [], False
    again = session.run("again", trace=Trace(), against=ref) if at else saving
    if again is not None:
        return [], [explain(again, ref, "a second uninterrupted run")], True
    taken = [s for s in snapshots.taken if s.update < saving.update]
    last = max((s.update for s in taken), default=0)
    source = f"an uninterrupted run saving checkpoints (the last before it: update {last})"
    return taken, [explain(saving, ref, source)], False


def _verify(
    session: _Session,
    remote: Build,
    points: int | Sequence[int] | None,
    signals: int,
    kinds: Sequence[int],
    seed: int,
    quiet: bool,
) -> Verdict:
    ref = session.reference()
    n = len(ref.updates)
    if not n:
        raise ValueError(
            "verify_resume: the uninterrupted run made no optimizer update, so there is "
            "nothing to resume from: build a run of a few updates at least."
        )
    taken, found, nondeterministic = _saving(session, ref, choose_points(points, ref.updates, seed))
    if nondeterministic:
        return Verdict(n, (), (), 0, tuple(found), nondeterministic=True)
    resumed = [d for s in taken if (d := session.resume(s, ref)) is not None]
    micro_batches = int(ref.summaries[END].data["micro_step"])  # type: ignore[call-overload]
    campaigns = Campaigns(
        remote, session.root, ref, session.rng, session.volatile, quiet, session.say
    )
    outcome = campaigns.run(plan(signals, kinds, micro_batches, seed))
    if outcome.nondeterministic is not None:
        return Verdict(n, (), (), 0, (outcome.nondeterministic,), nondeterministic=True)
    equal = len(taken) - len(resumed) + outcome.equal
    snaps = tuple(s.update for s in taken)
    divergences = tuple(found + resumed + outcome.divergences)
    return Verdict(n, snaps, tuple(outcome.signalled), equal, divergences)
