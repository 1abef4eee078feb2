"""Checkpoint hooks: periodic, best-metric, and save-on-stop.

All three write full, resumable checkpoints (:meth:`ftrain.loop.Loop.checkpoint`)
atomically and record them in the directory's manifest
(:class:`ftrain.checkpoint.Manifest`); a new file is always complete on disk
before an old one is deleted, and only files listed in the manifest are ever
deleted.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ftrain import dist as _dist
from ftrain.checkpoint import (
    Manifest,
    background_writer,
    clean_temporaries,
    commit_atomic,
    snapshot,
    stage_atomic,
    write_snapshot,
)
from ftrain.errors import CheckpointError, StaleStateError
from ftrain.events import EpochEnd, Evaluated, Event, RunEnd, StepEnd
from ftrain.hooks.rules import GREATER_KEYS, LESS_KEYS, infer_mode  # noqa: F401 (re-exported)

__all__ = ["CheckpointHook", "BestCheckpointHook", "AutoCheckpointHook", "infer_mode"]

# MMEngine's rule for save_best (case-insensitive key lists): see ftrain.hooks.rules


def _out_dir(hook_dir: str | os.PathLike | None, loop: Any) -> Path | None:
    if hook_dir is not None:
        return Path(hook_dir)
    return loop.work_dir


def write_checkpoint(
    loop: Any,
    directory: Path,
    name: str,
    kind: str,
    *,
    background: bool = False,
    prune: Callable[[Manifest], list[str]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Write ``loop.checkpoint()`` to ``directory/name`` and record it in the manifest.

    ``prune(manifest)`` names files to delete once the new one is recorded
    (``max_keep``): the manifest is written once, then they are deleted.

    ``background=True`` serialises the checkpoint now (a consistent
    snapshot: in memory when small, see :func:`~ftrain.checkpoint.snapshot`)
    and leaves the file write, ``fsync``, the rename, the manifest and the
    pruning to the directory's :class:`~ftrain.checkpoint.BackgroundWriter`;
    a synchronous write first waits for those. Under ``torch.distributed``
    (or for a sharded model) this is a collective that every rank calls, and
    always synchronous: rank 0 writes the file and the manifest, or every
    rank writes its shards of a ``.dcp`` directory (FSDP2); see
    :func:`ftrain.dist.save_checkpoint`.
    """
    run_id = getattr(loop, "run_id", None)
    if run_id is not None:
        extra.setdefault("run", run_id)  # which run wrote it: max_keep prunes its own only
    if _dist.world_size() > 1 or _dist.is_sharded(loop.state.model):
        entry = _dist.save_checkpoint(loop, directory, name, kind, **extra)
        if prune is not None and _dist.is_main():
            manifest = Manifest(directory)
            manifest.update(None, prune(manifest))
        return entry
    writer = background_writer(directory)
    if not background:
        writer.wait()
    path = directory / name
    ckpt = loop.checkpoint()
    data = snapshot(ckpt) if background else None
    tmp, info = (None, {}) if data is not None else stage_atomic(ckpt, path)
    del ckpt
    state = loop.state
    entry = {
        "name": name,
        "kind": kind,
        "step": state.step,
        "micro_step": state.micro_step,
        "epoch": state.epoch,
        "time": time.time(),
        **info,
        **extra,
    }

    def finish() -> None:
        if data is not None:
            entry.update(write_snapshot(data, path))
        else:
            commit_atomic(tmp, path, sync_dir=False)  # the manifest write syncs the directory
        Manifest(directory).update(entry, prune=prune)

    if background:
        writer.submit(finish)
    else:
        finish()
    return entry


class CheckpointHook:
    """Save resumable checkpoints periodically (MMEngine ``CheckpointHook`` semantics).

    A file is written when ``n - save_begin`` is a non-negative multiple of
    ``interval``, where ``n`` counts optimizer updates (``iter_{n}.pth``) or
    completed epochs (``epoch_{n}.pth``, ``by_epoch=True``) from 1; and at
    the end of the run when ``save_last``. Interval 2 over 11 epochs saves
    2, 4, 6, 8, 10 and 11; with ``save_begin=5``: 5, 7, 9, 11.

    ``max_keep`` keeps this run's newest N periodic files; the list is
    rebuilt from the directory's manifest, so a resumed run keeps counting
    correctly and never deletes files it did not write. Writes are atomic,
    and a new file is complete before an old one is deleted.

    ``background=True`` (default): the checkpoint is serialised in the
    training thread (a consistent snapshot), and the ``fsync``, rename,
    manifest update and pruning finish on a background thread while
    training goes on; the run's last save, and the end or interruption of
    the run, wait for them. Under ``torch.distributed`` writes are always
    synchronous collectives.

    Example:
        >>> hook = CheckpointHook(interval=100, max_keep=3)
        >>> hook.should_save(200), hook.should_save(250)
        (True, False)
    """

    priority = "VERY_LOW"
    name = "checkpoint"

    def __init__(
        self,
        interval: int = 1000,
        *,
        by_epoch: bool = False,
        save_begin: int = 0,
        save_last: bool = True,
        out_dir: str | os.PathLike | None = None,
        max_keep: int | None = None,
        optional: bool = False,
        background: bool = True,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"CheckpointHook: interval must be a whole number >= 1, got {interval!r}."
            )
        if not isinstance(save_begin, int) or save_begin < 0:
            raise ValueError(f"CheckpointHook: save_begin must be >= 0, got {save_begin!r}.")
        if max_keep is not None and (not isinstance(max_keep, int) or max_keep < 1):
            raise ValueError(
                f"CheckpointHook: max_keep must be None (keep all) or >= 1, got {max_keep!r}."
            )
        self.interval = interval
        self.by_epoch = by_epoch
        self.save_begin = save_begin
        self.save_last = save_last
        self.out_dir = out_dir
        self.max_keep = max_keep
        self.optional = optional
        self.background = background

    def __repr__(self) -> str:
        unit = "epoch" if self.by_epoch else "step"
        return (
            f"CheckpointHook(every {self.interval} {unit}s from {self.save_begin}, "
            f"save_last={self.save_last}, max_keep={self.max_keep})"
        )

    def next_step(self, step: int) -> int | None:
        """The next update that is saved (none when saving by epoch)."""
        if self.by_epoch:
            return None
        n = max(step + 1, self.save_begin)
        return n + (-(n - self.save_begin)) % self.interval

    def should_save(self, n: int) -> bool:
        """Whether the ``n``-th update (or epoch), counted from 1, is saved."""
        d = n - self.save_begin
        return d >= 0 and d % self.interval == 0

    def _save(
        self, loop: Any, directory: Path, epoch_end: bool = False, *, final: bool = False
    ) -> None:
        s = loop.state
        name = f"epoch_{s.epoch}.pth" if epoch_end else f"iter_{s.step}.pth"
        run = getattr(loop, "run_id", None)
        write_checkpoint(
            loop,
            directory,
            name,
            "periodic",
            background=self.background and not final,
            prune=lambda manifest: self._stale(manifest, run),
        )
        self.saved_at = (s.step, s.micro_step)

    def _stale(self, manifest: Manifest, run: str | None) -> list[str]:
        """This run's oldest periodic files beyond ``max_keep`` (after a write)."""
        if self.max_keep is None:
            return []
        periodic = [
            e for e in manifest.entries if e.get("kind") == "periodic" and e.get("run") == run
        ]  # this run's own files only: another run's are never deleted
        periodic.sort(key=lambda e: (e.get("seq", -1), e.get("time", 0)))
        return [e["name"] for e in periodic[: max(0, len(periodic) - self.max_keep)]]

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        directory = _out_dir(self.out_dir, loop)
        if directory is None and not self.optional:
            raise ValueError(
                "CheckpointHook needs a directory: pass work_dir= to ftrain.loop/fit or "
                "out_dir= to the hook."
            )
        yield first
        if directory is None:
            yield from events
            return
        if _dist.is_main():  # under torch.distributed only rank 0 touches the directory
            directory.mkdir(parents=True, exist_ok=True)
            _warn_foreign_checkpoints(loop, directory)
        background_writer(directory).wait()  # an earlier run's writes, before cleaning up
        clean_temporaries(directory)
        self.saved_at = (-1, -1)
        by_epoch, should_save = self.by_epoch, self.should_save
        try:
            yield from self._watch(events, loop, directory, by_epoch, should_save)
        except BaseException:  # interrupted or failed: finish the writes, then re-raise
            try:
                background_writer(directory).wait()
            except CheckpointError as exc:
                warnings.warn(str(exc), stacklevel=2)
            raise
        background_writer(directory).wait()

    def _watch(
        self,
        events: Iterator[Event],
        loop: Any,
        directory: Path,
        by_epoch: bool,
        should_save: Callable[[int], bool],
    ) -> Iterator[Event]:
        for ev in events:
            kind = type(ev)
            if by_epoch:
                if kind is EpochEnd and should_save(ev.state.epoch):
                    self._save(loop, directory, epoch_end=True)
            elif kind is StepEnd and ev.is_update and should_save(ev.state.step):
                self._save(loop, directory)
            if kind is RunEnd:
                if self.save_last and self.saved_at != (ev.state.step, ev.state.micro_step):
                    # by epoch, a run that ended on an epoch boundary is named by epoch
                    self._save(
                        loop, directory, epoch_end=by_epoch and loop._iter is None, final=True
                    )
                background_writer(directory).wait()  # the run's files are complete at its end
            yield ev


def _warn_foreign_checkpoints(loop: Any, directory: Path) -> None:
    """A fresh run in a directory holding another run's checkpoints: say what happens."""
    if getattr(loop, "resumed_from", None) is not None:
        return
    run = getattr(loop, "run_id", None)
    others = [e["name"] for e in Manifest(directory).entries if e.get("run") != run]
    if others:
        warnings.warn(
            f"{directory} already holds {len(others)} checkpoint(s) of another run "
            f"({', '.join(others[-3:])}). This run started fresh: it keeps them (max_keep "
            "prunes only this run's files), and resume='auto' will continue from the newest "
            "file written, this run's once it saves. Use a new work_dir to keep runs apart, "
            "or resume='auto' to continue the earlier run.",
            stacklevel=3,
        )


class BestCheckpointHook:
    """Keep one checkpoint: the one with the best evaluation ``metric``.

    Listens to :class:`~ftrain.events.Evaluated` events (from an evaluation
    hook of higher priority). ``mode`` is ``"max"`` or ``"min"``, inferred
    from the name when omitted (``acc``, ``mAP``, ``mIoU``... → max; ``loss``
    → min). A new best must be strictly better; NaN is ignored. The file is
    ``best_{metric}_{iter|epoch}_{n}.pth``; the previous best is deleted only
    after the new one is written. The best value survives resume.

    Example:
        >>> hook = BestCheckpointHook("acc")
        >>> hook.mode, hook.is_better(0.9), hook.best
        ('max', True, None)
    """

    priority = "VERY_LOW"

    def __init__(
        self,
        metric: str,
        mode: str | None = None,
        *,
        out_dir: str | os.PathLike | None = None,
        by_epoch: bool | None = None,
    ) -> None:
        if mode is None:
            mode = infer_mode(metric)
        if mode not in ("max", "min"):
            raise ValueError(f"BestCheckpointHook: mode must be 'max' or 'min', got {mode!r}.")
        self.metric = metric
        self.mode = mode
        self.out_dir = out_dir
        self.by_epoch = by_epoch
        self.best: float | None = None
        self.best_file: str | None = None
        self.name = f"best_{metric}".replace("/", "_")

    def __repr__(self) -> str:
        return f"BestCheckpointHook({self.metric!r}, mode={self.mode!r}, best={self.best})"

    def is_better(self, value: float) -> bool:
        if value is None or math.isnan(value):
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_file": self.best_file}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.best = saved.get("best")
        self.best_file = saved.get("best_file")

    def next_step(self, step: int) -> None:
        """None: this hook acts on ``Evaluated`` events only."""
        return None

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        for ev in events:
            if type(ev) is Evaluated and self.metric in ev.metrics:
                value = float(ev.metrics[self.metric])
                if self.is_better(value):
                    self._save(ev, value)
            yield ev

    def _save(self, ev: Evaluated, value: float) -> None:
        loop = ev.loop
        directory = _out_dir(self.out_dir, loop)
        if directory is None:
            raise ValueError(
                "BestCheckpointHook needs a directory: pass work_dir= to ftrain.loop/fit or "
                "out_dir= to the hook."
            )
        by_epoch = ev.by_epoch if self.by_epoch is None else self.by_epoch
        n = ev.state.epoch if by_epoch else ev.state.step
        name = f"best_{self.metric.replace('/', '_')}_{'epoch' if by_epoch else 'iter'}_{n}.pth"
        name = _dist.checkpoint_name(loop.state.model, name)  # a .dcp directory for FSDP2
        old = self.best_file
        self.best, self.best_file = value, name  # saved inside the checkpoint itself
        write_checkpoint(
            loop, directory, name, "best", resumable=False, metric=self.metric, value=value
        )
        if old is not None and old != name:
            Manifest(directory).remove(old)


class AutoCheckpointHook:
    """On Ctrl-C, SIGTERM or an error, save the last consistent state, then re-raise.

    The file ``interrupted.pth`` holds a full checkpoint (including a
    partial accumulation window), so ``resume="auto"`` continues exactly.
    A run that ends normally does not write it (and removes an old one).

    Under ``torch.distributed`` saving is a collective: the ranks first meet
    (through the store, waiting at most ``agree_timeout`` seconds) and save
    only if every rank was interrupted after the same micro-batch (an error
    raised in a hook on every rank, a signal every rank got between the same
    two steps); otherwise it warns and saves nothing, rather than hang. With
    FSDP2 nothing is saved in the middle of an accumulation window.

    Example:
        >>> AutoCheckpointHook().name
        'auto_checkpoint'
    """

    priority = "LOWEST"
    name = "auto_checkpoint"

    def __init__(
        self,
        out_dir: str | os.PathLike | None = None,
        *,
        optional: bool = False,
        agree_timeout: float = 60.0,
    ) -> None:
        self.out_dir = out_dir
        self.optional = optional
        self.agree_timeout = agree_timeout

    def __repr__(self) -> str:
        return "AutoCheckpointHook()"

    def next_step(self, step: int) -> None:
        """None: this hook needs no ``StepEnd`` (it saves ``loop.state`` when stopped)."""
        return None

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)
        loop = first.loop
        directory = _out_dir(self.out_dir, loop)
        if directory is None and not self.optional:
            raise ValueError(
                "AutoCheckpointHook needs a directory: pass work_dir= to ftrain.loop/fit or "
                "out_dir= to the hook."
            )
        if directory is None:
            yield first
            yield from events
            return
        completed = False
        try:
            yield first
            for ev in events:
                if type(ev) is RunEnd:
                    completed = True
                yield ev
        except BaseException as exc:  # KeyboardInterrupt, SIGTERM, errors, close()
            if not completed:
                self._save(loop, directory, exc)
            raise
        if completed and _dist.is_main():
            background_writer(directory).wait()
            for name in ("interrupted.pth", _dist.sharded_name("interrupted.pth")):
                if Manifest(directory).entry(name) is not None:
                    Manifest(directory).remove(name)

    def _save(self, loop: Any, directory: Path, exc: BaseException) -> None:
        import sys

        if sys.is_finalizing():  # a loop left open at exit: Python can no longer write files
            return
        if not _dist.agree_to_save(loop, self.agree_timeout):
            warnings.warn(
                f"Not saving a checkpoint on {type(exc).__name__}: not every rank was "
                "interrupted at the same step, and saving is a collective. Resume from the last "
                "periodic checkpoint.",
                stacklevel=2,
            )
            return
        try:
            write_checkpoint(loop, directory, "interrupted.pth", "interrupted", reason=repr(exc))
        except StaleStateError:
            warnings.warn(
                f"Not saving a checkpoint on {type(exc).__name__}: the step that failed consumed "
                "the state mid accumulation window. Resume from the last periodic checkpoint.",
                stacklevel=2,
            )
        except CheckpointError as err:  # FSDP2 in the middle of an accumulation window
            warnings.warn(f"Not saving a checkpoint on {type(exc).__name__}: {err}", stacklevel=2)
