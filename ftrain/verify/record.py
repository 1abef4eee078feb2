"""Running a user's loop in this process: a fingerprint at every update, snapshots where asked.

The verifier iterates the loop (``for ev in loop``): every event has then passed every hook,
so a fingerprint (and a snapshot) at an update's ``StepEnd`` sees the run as a checkpoint
written at the end of that update would.
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import attrs
import torch

from ftrain.events import StepEnd
from ftrain.loop import Loop
from ftrain.verify.fingerprint import END, VOLATILE, Fingerprint, Summary, capture, summarize

__all__ = [
    "Build",
    "Trace",
    "Mismatch",
    "Snapshot",
    "Snapshots",
    "save_snapshot",
    "record",
    "open_loop",
    "check_fresh",
    "fresh_dir",
]

#: The user's run: ``build(work_dir, resume) -> ftrain.Loop`` (see :func:`verify_resume`).
Build = Callable[[Path, "str | Path | None"], Loop]


def save_snapshot(loop: Loop, directory: Path, name: str) -> Path:
    """Write ``loop``'s checkpoint now as ``directory/name``, as a ``CheckpointHook`` writes one.

    The one place the verifier reaches into how a running loop is checkpointed: the same
    call the checkpoint hooks make (``loop.checkpointer.save(loop.snapshot(), ...)``: an
    atomic file recorded in ``directory``'s manifest), synchronously.
    """
    loop.checkpointer.save(loop.snapshot(), directory, name, "periodic")
    return directory / name


@attrs.define
class Trace:
    """One run as the verifier saw it: a :class:`Summary` per update (and at the end).

    ``store``: where each update's full fingerprint is kept (the reference run's), so a
    difference can be explained down to the tensor.
    """

    summaries: dict[int, Summary] = attrs.Factory(dict)
    store: Path | None = None

    @property
    def updates(self) -> list[int]:
        """The updates seen, in order (without the end)."""
        return [k for k in self.summaries if k != END]

    def keep(self, update: int, fp: Fingerprint) -> Summary:
        summary = self.summaries[update] = summarize(fp)
        if self.store is not None:
            torch.save(fp, self.store / f"{update}.pt")
        return summary

    def full(self, update: int) -> Fingerprint:
        """The full fingerprint kept for ``update``."""
        assert self.store is not None, "only the reference run keeps its fingerprints"
        return torch.load(self.store / f"{update}.pt", weights_only=False)


@attrs.frozen
class Mismatch:
    """The first update at which a run differs from the reference, with its fingerprint."""

    update: int
    parts: list[str]
    fingerprint: Fingerprint | None = None
    note: str = ""  # why there is no fingerprint (an update the reference never made...)


@attrs.frozen
class Snapshot:
    """A checkpoint the verifier took at ``update``, with the size of each log file then."""

    update: int
    path: Path
    work_dir: Path
    logs: dict[str, int]

    def prefill(self, work_dir: Path) -> None:
        """Put the logs as they were at the snapshot into ``work_dir`` (a resumed run appends)."""
        for name, size in self.logs.items():
            target = work_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(self.work_dir / name, "rb") as src, open(target, "wb") as dst:
                dst.write(src.read(size))


def _log_sizes(work_dir: Path) -> dict[str, int]:
    return {p.relative_to(work_dir).as_posix(): p.stat().st_size for p in work_dir.rglob("*.jsonl")}


@attrs.define
class Snapshots:
    """The checkpoints to take in a run: at the updates ``at``, into ``directory``."""

    directory: Path
    at: frozenset[int]
    taken: list[Snapshot] = attrs.Factory(list)

    def maybe(self, loop: Loop, update: int) -> None:
        """Take the checkpoint of ``update`` if it is one of ``at``."""
        if update in self.at and loop.work_dir is not None:
            path = save_snapshot(loop, self.directory, f"update_{update}.pth")
            work_dir = Path(loop.work_dir)
            self.taken.append(Snapshot(update, path, work_dir, _log_sizes(work_dir)))


def open_loop(build: Build, work_dir: Path, resume: str | Path | None) -> Loop:
    """``build(work_dir, resume)``, checked to be a Loop that writes into ``work_dir``."""
    loop = build(work_dir, resume)
    if not isinstance(loop, Loop):
        raise TypeError(
            f"verify_resume: build(work_dir, resume) must return an ftrain.Loop, got "
            f"{type(loop).__name__}. End your build function with `return ftrain.Loop(...)`."
        )
    if loop.work_dir is None or Path(loop.work_dir).resolve() != work_dir.resolve():
        raise ValueError(
            f"verify_resume: build(work_dir, resume) made a Loop with work_dir={loop.work_dir!r}, "
            f"not the {str(work_dir)!r} it was given. Pass it on: ftrain.Loop(..., "
            "work_dir=work_dir, resume=resume); the verifier gives every run its own "
            "temporary directory and writes nothing into yours."
        )
    if not _same_resume(loop.resume, resume):
        raise ValueError(
            f"verify_resume: build(work_dir, resume) made a Loop with resume={loop.resume!r}, "
            f"not the {resume!r} it was given. Pass it on: ftrain.Loop(..., resume=resume)."
        )
    return loop


def _parts(loop: Loop) -> dict[str, object]:
    """What a run must not share with another: model, optimizer, a stateful loader, hook
    objects (a hook that is a plain function keeps no state between runs)."""
    state = loop.state
    named = {f"the optimizer {n!r}": opt for n, opt in state.optimizers.items()}
    parts = {"the model": state.model, **(named or {"the optimizer": state.optimizer})}
    if hasattr(loop.data, "state_dict"):
        parts["the data loader"] = loop.data
    for h in loop.hooks:
        if not inspect.isfunction(h.fn):
            parts[f"the hook {h.name!r}"] = h.fn
    return parts


def check_fresh(loop: Loop, previous: Loop | None) -> None:
    """Raise when ``loop`` shares its model, optimizer, loader or a hook object with
    ``previous``: ``build`` must make each run anew, as a restarted script does."""
    if previous is None:
        return
    theirs = {id(o) for o in _parts(previous).values()}
    shared = [name for name, o in _parts(loop).items() if id(o) in theirs]
    if shared:
        raise ValueError(
            f"verify_resume: build(work_dir, resume) returned a Loop sharing {', '.join(shared)} "
            "with the run it built before: each call must make the run anew (create the model, "
            "optimizer, data loader and hooks inside build), as a restarted script does."
        )


def _same_resume(got: object, given: str | Path | None) -> bool:
    if given is None or got is None:
        return got is given
    return isinstance(got, (str, Path)) and (str(got) == str(given) or Path(got) == Path(given))


def _compare(
    summary: Summary, update: int, against: Trace | None, fp: Fingerprint
) -> Mismatch | None:
    if against is None:
        return None
    ref = against.summaries.get(update)
    if ref is None:
        return Mismatch(update, ["data order"], None, "an update the uninterrupted run never made")
    parts = ref.differing(summary)
    return Mismatch(update, parts, fp) if parts else None


def _missing(trace: Trace, against: Trace | None, start: int) -> Mismatch | None:
    """The first update of ``against`` after ``start`` that ``trace`` never reached."""
    if against is None:
        return None
    for update in against.updates:
        if update > start and update not in trace.summaries:
            last = max(trace.updates, default=start)
            return Mismatch(update, ["data order"], None, f"the run ended after update {last}")
    return None


def record(
    loop: Loop,
    *,
    trace: Trace,
    against: Trace | None = None,
    snapshots: Snapshots | None = None,
    volatile: Iterable[str] = VOLATILE,
) -> Mismatch | None:
    """Run ``loop`` to its end, a fingerprint at every update into ``trace`` (and one at the
    end), snapshots where asked; stop at the first update that differs from ``against``."""
    events = iter(loop)
    start: int | None = None
    batches: dict[int, object] = {}
    try:
        for ev in events:
            if start is None:  # RunBegin: the loop has resumed
                start = ev.state.step
            if type(ev) is not StepEnd:
                continue
            if ev.batch is not None:
                batches[ev.state.micro_step] = ev.batch
            if not ev.is_update:
                continue
            found = _note(loop, trace, ev.state.step, batches, against, volatile)
            batches = {}
            if found is not None:
                return found
            if snapshots is not None:
                snapshots.maybe(loop, ev.state.step)
    finally:
        events.close()
    return _missing(trace, against, start or 0) or _note(loop, trace, END, {}, against, volatile)


def _note(
    loop: Loop,
    trace: Trace,
    update: int,
    batches: Mapping[int, object],
    against: Trace | None,
    volatile: Iterable[str],
) -> Mismatch | None:
    fp = capture(loop, batches, volatile)
    return _compare(trace.keep(update, fp), update, against, fp)


def fresh_dir(path: Path) -> Path:
    """``path``, empty."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
