"""Checkpoint hooks: periodic, best-metric, and save-on-stop.

The hooks decide *when* to save; the run's Checkpointer
(:class:`ftrain.persist.Checkpointer`, one per run for one process, DDP or
FSDP2) decides *how*. Every file is a full, resumable checkpoint
(:meth:`ftrain.loop.Loop.checkpoint`) written atomically and recorded in
the directory's manifest (:class:`ftrain.persist.Manifest`); a new file is
always complete on disk before an old one is deleted, and only files listed
in the manifest are ever deleted.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ftrain.errors import CheckpointError, StaleStateError
from ftrain.events import EpochEnd, Evaluated, Event, RunEnd, StepEnd
from ftrain.hooks.rules import GREATER_KEYS, LESS_KEYS, infer_mode  # noqa: F401 (re-exported)
from ftrain.persist.agree import agree_to_save
from ftrain.persist.checkpointer import sharded_name
from ftrain.persist.files import clean_temporaries
from ftrain.persist.manifest import Manifest
from ftrain.persist.resume import checkpointer_of

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
    """Save ``loop`` as ``directory/name`` with the run's Checkpointer (see
    :meth:`ftrain.persist.Checkpointer.save`); every rank calls it."""
    run_id = getattr(loop, "run_id", None)
    if run_id is not None:
        extra.setdefault("run", run_id)  # which run wrote it: max_keep prunes its own only
    return checkpointer_of(loop).save(
        loop, directory, name, kind, background=background, prune=prune, **extra
    )


def _prepare_dir(loop: Any, directory: Path) -> None:
    """Before step 1: the directory exists and is writable; temporaries of a kill are gone."""
    ckpt = checkpointer_of(loop)
    ckpt.wait(directory)
    if ckpt.main:  # under torch.distributed only rank 0 touches the directory
        ckpt.check_writable(directory)
        clean_temporaries(directory)


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

    ``background=True`` (default): training blocks only while the state is
    copied to host memory; serialising, ``fsync``, rename, manifest update
    and pruning finish on a background thread (FSDP2: ``async_save``), one
    save in flight at a time (host memory holds at most one copy of the
    state). A failed background write is raised at the next step; under
    ``torch.distributed`` every rank raises it together at the next save or
    at the end of the run (the rank that saw it warns at once: one rank
    raising alone would leave the others waiting in a collective). The run's
    last save, and the end or interruption of the run, wait for the writes.

    At the start of a run the hook checks that the directory is writable,
    and collects what a kill left behind: temporary files, and this run's
    periodic files beyond ``max_keep``.

    Example:
        >>> hook = CheckpointHook(interval=100, max_keep=3)
        >>> hook.should_save(200), hook.should_save(250)
        (True, False)
    """

    priority = "VERY_LOW"
    name = "checkpoint"
    writes_checkpoints = True  # resume="auto" also looks in out_dir

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
        self._watching = False  # a background save is in flight: look at every step

    def __repr__(self) -> str:
        unit = "epoch" if self.by_epoch else "step"
        return (
            f"CheckpointHook(every {self.interval} {unit}s from {self.save_begin}, "
            f"save_last={self.save_last}, max_keep={self.max_keep})"
        )

    def next_step(self, step: int) -> int | None:
        """The next update that is saved (none when saving by epoch)."""
        if self._watching:
            return step + 1
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
        background = self.background and not final
        write_checkpoint(
            loop,
            directory,
            name,
            "periodic",
            background=background,
            prune=lambda manifest: self._stale(manifest, run),
        )
        self.saved_at = (s.step, s.micro_step)
        self._watching = background

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
        _prepare_dir(loop, directory)
        ckpt = checkpointer_of(loop)
        if ckpt.main and self.max_keep is not None:  # files a kill left beyond max_keep
            run = getattr(loop, "run_id", None)
            manifest = ckpt.manifest(directory)
            stale = self._stale(manifest, run)
            if stale:
                manifest.remove(*stale)
        self.saved_at = (-1, -1)
        self._watching = False
        by_epoch, should_save = self.by_epoch, self.should_save
        try:
            yield from self._watch(events, loop, directory, by_epoch, should_save)
        except BaseException:  # interrupted or failed: finish the writes, then re-raise
            self._watching = False
            try:
                ckpt.wait(directory)
            except CheckpointError as exc:
                warnings.warn(str(exc), stacklevel=2)
            raise
        self._watching = False
        ckpt.wait(directory)

    def _watch(
        self,
        events: Iterator[Event],
        loop: Any,
        directory: Path,
        by_epoch: bool,
        should_save: Callable[[int], bool],
    ) -> Iterator[Event]:
        ckpt = checkpointer_of(loop)
        for ev in events:
            kind = type(ev)
            if self._watching and kind is StepEnd:
                ckpt.check()  # a failed background save surfaces at the next step (one process)
                self._watching = ckpt.busy
            if by_epoch:
                if kind is EpochEnd and should_save(ev.state.epoch):
                    self._save(loop, directory, epoch_end=True)
            elif kind is StepEnd and ev.is_update and should_save(ev.state.step):
                self._save(loop, directory)
            if kind is RunEnd:
                if self.save_last and self.saved_at != (ev.state.step, ev.state.micro_step):
                    # by epoch, a run that ended on an epoch boundary is named by epoch
                    self._save(
                        loop, directory, epoch_end=by_epoch and not loop.in_epoch, final=True
                    )
                # the run's files are complete at its end; under torch.distributed a
                # failed save (any rank's) is raised on every rank here (a collective)
                ckpt.settle()
                self._watching = False
            yield ev




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
    writes_checkpoints = True  # resume="auto" also looks in out_dir

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
        first = next(events)  # RunBegin
        directory = _out_dir(self.out_dir, first.loop)
        if directory is not None and directory.is_dir():
            self._collect(first.loop, directory)
        yield first
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
        ckpt = checkpointer_of(loop)
        name = ckpt.name(name)  # a .dcp directory for FSDP2
        old_best, old = self.best, self.best_file
        self.best, self.best_file = value, name  # saved inside the checkpoint itself

        def write() -> None:
            write_checkpoint(
                loop, directory, name, "best", resumable=False, metric=self.metric, value=value
            )

        def drop_old() -> None:
            if ckpt.main and old is not None and old != name:
                ckpt.manifest(directory).remove(old)

        try:
            write()
        except Exception:  # not written: the best is still the old one
            self.best, self.best_file = old_best, old
            raise
        except BaseException:  # Ctrl-C/SIGTERM mid-write: finish it, so the best is not lost
            try:
                write()
            except BaseException:
                self.best, self.best_file = old_best, old
            else:
                drop_old()
            raise
        drop_old()

    def _collect(self, loop: Any, directory: Path) -> None:
        """Delete this metric's best files other than the recorded one (left by a kill)."""
        ckpt = checkpointer_of(loop)
        if not ckpt.main:
            return
        manifest = ckpt.manifest(directory)
        stale = [
            e["name"]
            for e in manifest.entries
            if e.get("kind") == "best"
            and e.get("metric") == self.metric
            and e["name"] != self.best_file
        ]
        if stale:
            manifest.remove(*stale)


class AutoCheckpointHook:
    """On Ctrl-C, SIGTERM or an error, save the last consistent state, then re-raise.

    The file ``interrupted.pth`` holds a full checkpoint (including a
    partial accumulation window), so ``resume="auto"`` continues exactly.
    A run that ends normally does not write it (and removes an old one).

    Under ``torch.distributed`` saving is a collective: the ranks first meet
    (through the store, waiting at most ``agree_timeout`` seconds, 10 by
    default: well inside Slurm's 30 s ``KillWait``) and save only if every
    rank was interrupted after the same micro-batch (an error raised in a
    hook on every rank; a signal that reached any rank: the loop stops every
    rank at the same update); otherwise it warns and saves nothing, rather
    than hang. With FSDP2 nothing is saved in the middle of an accumulation
    window.

    Example:
        >>> AutoCheckpointHook().name
        'auto_checkpoint'
    """

    priority = "LOWEST"
    name = "auto_checkpoint"
    writes_checkpoints = True  # resume="auto" also looks in out_dir

    def __init__(
        self,
        out_dir: str | os.PathLike | None = None,
        *,
        optional: bool = False,
        agree_timeout: float = 10.0,
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
        ckpt = checkpointer_of(loop)
        if completed and ckpt.main:
            ckpt.wait(directory)
            manifest = ckpt.manifest(directory)
            gone = [n for n in ("interrupted.pth", sharded_name("interrupted.pth")) if manifest.entry(n)]
            if gone:
                manifest.remove(*gone)

    def _save(self, loop: Any, directory: Path, exc: BaseException) -> None:
        import sys

        if sys.is_finalizing():  # a loop left open at exit: Python can no longer write files
            return
        if not agree_to_save(loop, self.agree_timeout):
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
        except CheckpointError as err:  # disk full, FSDP2 mid accumulation window...
            warnings.warn(f"Not saving a checkpoint on {type(exc).__name__}: {err}", stacklevel=2)
