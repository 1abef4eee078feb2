"""Checkpoint hooks: periodic, best-metric, and save-on-stop. They decide *when*; the run's
:class:`ftrain.persist.checkpointer.Checkpointer` decides *how* (atomic files, recorded in the manifest;
an old file is deleted only after the new one is complete, and only if the manifest lists it).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ftrain._checks import directory_arg, flag, nonempty, number, whole
from ftrain.errors import CheckpointError, StaleStateError
from ftrain.events import EpochEnd, Evaluated, Event, RunEnd, StepEnd
from ftrain.hooks.base import OutputDir
from ftrain.hooks.cadence import EVERY_MICRO_BATCH, Every
from ftrain.hooks.keep import COUNTS, Policy, keep_latest, stale, with_metrics
from ftrain.hooks.rules import infer_mode, missing_metric
from ftrain.hooks.wallclock import WallClock
from ftrain.persist.agree import agree_to_save
from ftrain.persist.checkpointer import sharded_name
from ftrain.persist.location import Location, location_key
from ftrain.persist.manifest import Manifest

if TYPE_CHECKING:
    from ftrain.run import Run
    from ftrain.state import TrainState

__all__ = ["CheckpointHook", "BestCheckpointHook", "AutoCheckpointHook", "infer_mode"]

# more saves in one run: a failed background write surfaces at the next save
_MAX_AFTER_SAVES = 1000


def _out_dir(hook: str, out_dir: Path | None, run: Run, optional: bool) -> Path | None:
    directory = out_dir if out_dir is not None else run.work_dir
    if directory is None and not optional:
        raise ValueError(
            f"{hook} needs a directory: pass work_dir= to ftrain.Loop or out_dir= to the hook."
        )
    return directory


def _checkpoint_dirs(out_dir: Path | None, work_dir: Path | None) -> list[OutputDir]:
    """A checkpoint hook's directory (``out_dir``, else ``work_dir``), if it has one."""
    directory = out_dir if out_dir is not None else work_dir
    return [] if directory is None else [OutputDir(directory, checkpoints=True)]


def write_checkpoint(run: Run, directory: Path, name: str, kind: str, **kw: Any) -> None:
    """Save ``run`` now as ``directory/name`` (:meth:`Checkpointer.save
    <ftrain.persist.checkpointer.Checkpointer.save>` of ``run.snapshot()``); every rank calls it.
    The manifest records the run's id: ``max_keep`` prunes this run's files only."""
    run.checkpointer.save(run.snapshot(), directory, name, kind, **kw)


class CheckpointHook:
    """Save resumable checkpoints periodically (MMEngine ``CheckpointHook`` semantics).

    A file is written when ``n - save_begin`` is a non-negative multiple of ``interval``,
    ``n`` counting updates (``iter_{n}.pth``) or epochs (``epoch_{n}.pth``, ``by_epoch``)
    from 1, and at the run's end when ``save_last``: interval 2 over 11 epochs saves 2, 4,
    6, 8, 10 and 11; with ``save_begin=5``: 5, 7, 9, 11. ``max_keep`` keeps this run's
    newest N periodic files (from the manifest; other runs' files are never deleted);
    ``keep`` takes any retention policy of :mod:`ftrain.hooks.keep` (``max_keep=k`` is
    ``keep=keep_latest(k)``). ``count="micro_batches"`` counts ``interval``, ``save_begin`` and
    the file names in micro-batches, as MMEngine's ``CheckpointHook`` does under
    ``accumulative_counts`` (a save may then fall inside an accumulation window: the
    checkpoint holds the window). ``save_every=every_minutes(T)``
    (:mod:`ftrain.hooks.wallclock`) also saves after an update when ``T`` minutes of wall
    time passed since the last save (one process only).

    ``background=True``: training blocks only while the state is copied to host memory; the
    write finishes on a thread, one at a time. A failed write is raised at the next update
    when the run's length is known (``max_steps`` or a sized loader), else at the next save,
    an epoch's end or the run's end (under ``torch.distributed``: on every rank at the next save or the
    end). The last save and the end or interruption of the run wait for writes.

    Example:
        >>> hook = CheckpointHook(interval=100, max_keep=3)
        >>> hook.should_save(200), hook.should_save(250), hook.cadence
        (True, False, Every(steps=100, start=0, at=frozenset(), epochs=None, micro_batches=False))
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
        keep: Policy | None = None,
        count: str = "updates",
        save_every: WallClock | None = None,
    ) -> None:
        whole("CheckpointHook: interval", interval, 1)
        whole("CheckpointHook: save_begin", save_begin, 0)
        if max_keep is not None:
            whole("CheckpointHook: max_keep (or None: keep all)", max_keep, 1)
        self.keep = _keep_arg(max_keep, keep)
        self.count, self.save_every = _count_arg(count, by_epoch), _save_every_arg(save_every)
        for what, value in (("by_epoch", by_epoch), ("save_last", save_last),
                            ("optional", optional), ("background", background)):  # fmt: skip
            flag(f"CheckpointHook: {what}", value)
        self.interval, self.by_epoch, self.save_begin = interval, by_epoch, save_begin
        self.save_last, self.max_keep = save_last, max_keep
        self.out_dir = directory_arg("CheckpointHook: out_dir", out_dir)
        self.optional, self.background = optional, background
        # the updates saved at, exactly (by epoch: EpochEnd reaches every hook, no StepEnd needed)
        self.cadence = (
            Every(epochs=interval) if by_epoch
            else EVERY_MICRO_BATCH if count == "micro_batches"
            else Every(steps=1) if save_every is not None
            else Every(steps=interval, start=save_begin)
        )  # fmt: skip
        self._since = 0.0  # the wall clock at the last save (save_every)

    def __repr__(self) -> str:
        unit = "epoch" if self.by_epoch else "step"
        kept = f"keep={self.keep}" if self.max_keep is None and self.keep else "max_keep="
        kept += "" if kept.startswith("keep") else str(self.max_keep)
        return (
            f"CheckpointHook(every {self.interval} {unit}s from {self.save_begin}, "
            f"save_last={self.save_last}, {kept})"
        )

    def output_dirs(self, work_dir: Path | None) -> list[OutputDir]:
        """Where it writes (resume="auto" looks there too): ``out_dir``, else ``work_dir``."""
        return _checkpoint_dirs(self.out_dir, work_dir)

    def should_save(self, n: int) -> bool:
        """Whether the ``n``-th update (or epoch), counted from 1, is saved."""
        d = n - self.save_begin
        return d >= 0 and d % self.interval == 0

    def _cadence(self, loop: Run) -> Every:
        """The save points; in the background, when the run's length is known, also the update
        after each save (a failed write then surfaces there)."""
        exact = self.cadence
        if self.by_epoch or not self.background or exact.steps != self.interval:
            return exact
        end = loop.max_steps
        if end is None and loop.batches_per_epoch is not None:
            end = loop.state.step + loop.batches_per_epoch * (loop.epochs or 1)
        if end is None:
            return exact
        k = max(0, -(-(loop.state.step + 1 - self.save_begin) // self.interval))  # first save ahead
        saves = range(max(self.save_begin + k * self.interval, 1), end, self.interval)
        if len(saves) > _MAX_AFTER_SAVES:
            return exact
        return attrs.evolve(exact, at=[n + 1 for n in saves])

    def _check_alone(self, run: Run, directory: Location) -> None:
        """Refuse another CheckpointHook of the run saving into ``directory`` (before any
        save): their files' names collide and each one's ``max_keep`` deletes the other's."""
        here = location_key(directory)
        for other in run.hooks.of_type(CheckpointHook):
            theirs = other.out_dir if other.out_dir is not None else run.work_dir
            if other is not self and theirs is not None and location_key(theirs) == here:
                raise ValueError(
                    f"Two CheckpointHooks save into {str(directory)!r}: {self!r} and {other!r}. "
                    "Their files share names (iter_N.pth, epoch_N.pth) and the max_keep of one "
                    "would delete the other's. Give one a directory of its own, e.g. "
                    f"CheckpointHook(..., out_dir={str(directory).rstrip('/') + '/keep'!r}), or keep "
                    "one hook."
                )

    def _save(self, loop: Run, directory: Path, by_epoch: bool, final: bool = False) -> None:
        s = loop.state
        name = f"epoch_{s.epoch}.pth" if by_epoch else f"iter_{self._n(s)}.pth"
        run = loop.run_id
        write_checkpoint(
            loop, directory, name, "periodic", background=self.background and not final,
            prune=lambda manifest: self._stale(manifest, run),
        )  # fmt: skip
        self.saved_at = (s.step, s.micro_step)
        if self.save_every is not None:
            self._since = self.save_every.clock()

    def _n(self, state: TrainState) -> int:
        """The update (``count="micro_batches"``: micro-batch) count of ``state``."""
        return state.micro_step if self.count == "micro_batches" else state.step

    def _due(self, ev: StepEnd) -> bool:
        """Whether the update (or micro-batch) ending with ``ev`` is saved."""
        if self.count == "micro_batches" and self.should_save(ev.state.micro_step):
            return True
        if not ev.is_update:
            return False
        if self.save_every is not None and self.save_every.due(self._since):
            return True
        return self.count == "updates" and self.should_save(ev.state.step)

    def _stale(self, manifest: Manifest, run: str | None, upto: int | None = None) -> list[str]:
        """What ``keep`` drops: this run's periodic files only (another run's, best and
        interrupted ones: never), never its newest (:func:`ftrain.hooks.keep.stale`)."""
        return [] if self.keep is None else stale(manifest.entries, run, self.keep, upto=upto)

    def _record_metrics(self, loop: Run, directory: Path, ev: Evaluated) -> None:
        """Record ``ev``'s metrics in the manifest entry of this run's periodic checkpoint of
        the evaluated state, if there is one, then prune by ``keep`` again."""
        ckpt = loop.checkpointer
        ckpt.wait(directory)  # its entry is recorded once its write is done
        if not ckpt.main:
            return
        manifest, s, run = ckpt.manifest(directory), ev.state, loop.run_id
        point = (s.step, s.micro_step)
        hit = [i for i, e in enumerate(manifest.entries) if e.get("kind") == "periodic"
               and e.get("run") == run and (e.get("step"), e.get("micro_step")) == point]  # fmt: skip
        if not hit:
            return
        manifest.entries[hit[-1]] = with_metrics(manifest.entries[hit[-1]], ev.metrics)
        manifest.update(None, prune=lambda m: self._stale(m, run))

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        directory = _out_dir("CheckpointHook", self.out_dir, loop, self.optional)
        if directory is None:
            yield first
            yield from events
            return
        self._check_alone(loop, directory)
        if self.save_every is not None and loop.checkpointer.world_size > 1:
            raise ValueError(
                "CheckpointHook: save_every (wall time) is for one process: each rank's clock "
                "would decide alone and a save is a collective. Use interval= under "
                "torch.distributed."
            )
        self.cadence = self._cadence(loop)  # before RunBegin passes on: the loop reads it then
        yield first
        ckpt = loop.checkpointer
        ckpt.wait(directory)
        if ckpt.main:  # under torch.distributed only rank 0 touches the directory
            ckpt.check_writable(directory)
            ckpt.dir(directory).clean_temporaries()
            if self.keep is not None:  # files a kill left beyond what keep keeps
                manifest = ckpt.manifest(directory)
                # up to where the run starts: the checkpoint it resumed from stays
                stale = self._stale(manifest, loop.run_id, upto=loop.state.step)
                if stale:
                    manifest.remove(*stale)
        self.saved_at = (-1, -1)
        if self.save_every is not None:
            self._since = self.save_every.clock()
        try:
            for ev in events:
                self._on(ev, loop, directory)
                yield ev
        except BaseException:  # interrupted or failed: finish the writes, then re-raise
            try:
                ckpt.wait(directory)
            except CheckpointError as exc:
                warnings.warn(str(exc), stacklevel=2)
            raise
        ckpt.wait(directory)

    def _on(self, ev: Event, loop: Run, directory: Path) -> None:
        """Save (or record metrics) on one event."""
        kind, ckpt = type(ev), loop.checkpointer
        if kind is StepEnd:
            ckpt.check()  # a failed background save surfaces here (one process)
            if not self.by_epoch and self._due(ev):
                self._save(loop, directory, False)
        elif kind is EpochEnd:
            ckpt.check()  # a failed background save surfaces here (one process)
            if self.by_epoch and self.should_save(ev.state.epoch):
                self._save(loop, directory, True)
        elif kind is Evaluated:
            if self.keep is not None and self.keep.needs_metrics:
                self._record_metrics(loop, directory, ev)
        elif kind is RunEnd:
            s = ev.state
            if self.save_last and self.saved_at != (s.step, s.micro_step):
                # by epoch, a run that ended on an epoch boundary is named by epoch
                epoch_end = self.by_epoch and not loop.in_epoch
                self._save(loop, directory, epoch_end, final=True)
            # the run's files are complete at its end; under torch.distributed a
            # failed save (any rank's) is raised on every rank here (a collective)
            ckpt.settle()


def _keep_arg(max_keep: int | None, keep: Policy | None) -> Policy | None:
    if keep is not None and not isinstance(keep, Policy):
        raise TypeError(
            f"CheckpointHook: keep must be a retention policy of ftrain.hooks.keep (e.g. "
            f"keep_latest(3) | keep_every(10_000)), got {keep!r}."
        )
    if keep is not None and max_keep is not None:
        raise ValueError(
            f"CheckpointHook: pass max_keep={max_keep} or keep={keep!r}, not both (max_keep=k "
            "is keep=keep_latest(k); combine them: keep=keep_latest(k) | ...)."
        )
    return keep_latest(max_keep) if max_keep is not None else keep


def _count_arg(count: str, by_epoch: bool, hook: str = "CheckpointHook") -> str:
    if count not in COUNTS:
        raise ValueError(
            f"{hook}: count must be one of {COUNTS}, got {count!r} ('micro_batches' "
            "counts interval as MMEngine's iterations under accumulative_counts)."
        )
    if count == "micro_batches" and by_epoch:
        raise ValueError(
            "CheckpointHook: count='micro_batches' counts iterations; with by_epoch=True the "
            "interval counts epochs. Pass one of them."
        )
    return count


def _save_every_arg(save_every: WallClock | None) -> WallClock | None:
    if save_every is not None and not isinstance(save_every, WallClock):
        raise TypeError(
            "CheckpointHook: save_every must be ftrain.hooks.wallclock.every_minutes(T), got "
            f"{save_every!r}."
        )
    return save_every


class BestCheckpointHook:
    """Keep one checkpoint: the one with the best evaluation ``metric``.

    Acts on ``Evaluated`` events; ``mode`` is inferred from the name when omitted. ``metric``
    is either name of it (:mod:`ftrain.metric_names`): the key the evaluation returns
    (``"val_loss"``) or the one the logs show (``"val/loss"``). A new best (strictly better;
    NaN never is) is written as ``best_{metric}_{iter|epoch}_{n}.pth`` (``/`` as ``_``) before
    the previous one is deleted. An evaluation without ``metric`` warns once.
    ``count="micro_batches"``: ``iter_{n}`` counts micro-batches (MMEngine's iterations under
    ``accumulative_counts``).

    Example:
        >>> hook = BestCheckpointHook("acc")
        >>> hook.mode, hook.is_better(0.9), hook.best
        ('max', True, None)
    """

    priority = "VERY_LOW"
    cadence = Every()  # Evaluated events only

    def __init__(
        self,
        metric: str,
        mode: str | None = None,
        *,
        out_dir: str | os.PathLike | None = None,
        by_epoch: bool | None = None,
        count: str = "updates",
    ) -> None:
        nonempty("BestCheckpointHook: metric", metric)
        self.count = _count_arg(count, False, "BestCheckpointHook")
        mode = infer_mode(metric) if mode is None else mode
        if mode not in ("max", "min"):
            raise ValueError(f"BestCheckpointHook: mode must be 'max' or 'min', got {mode!r}.")
        flag("BestCheckpointHook: by_epoch (None: as the evaluation ran)", by_epoch, none=True)
        self.metric, self.mode, self.by_epoch = metric, mode, by_epoch
        self.out_dir = directory_arg("BestCheckpointHook: out_dir", out_dir)
        self.best: float | None = None
        self.best_file: str | None = None
        self.name = f"best_{metric}".replace("/", "_")
        self._found = False  # an evaluation had the metric (or it warned it had not)

    def __repr__(self) -> str:
        return f"BestCheckpointHook({self.metric!r}, mode={self.mode!r}, best={self.best})"

    def output_dirs(self, work_dir: Path | None) -> list[OutputDir]:
        """Where it writes: ``out_dir``, else ``work_dir`` (its files are not resumed from)."""
        return _checkpoint_dirs(self.out_dir, work_dir)

    def is_better(self, value: float) -> bool:
        if value is None or math.isnan(value):
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_file": self.best_file}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.best, self.best_file = saved.get("best"), saved.get("best_file")

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        from ftrain.metric_names import find_metric, same_metric

        first = next(events)  # RunBegin
        directory = self.out_dir if self.out_dir is not None else first.loop.work_dir
        ckpt = first.loop.checkpointer
        if directory is not None and ckpt.dir(directory).is_dir() and ckpt.main:
            # this run's other best files of this metric (left by a kill); never another run's
            manifest, run = ckpt.manifest(directory), first.loop.run_id
            stale = [
                e["name"] for e in manifest.entries
                if e.get("kind") == "best" and same_metric(str(e.get("metric")), self.metric)
                and e["name"] != self.best_file and e.get("run") == run
            ]  # fmt: skip
            if stale:
                manifest.remove(*stale)
        yield first
        for ev in events:
            if type(ev) is Evaluated:
                key = find_metric(ev.metrics, self.metric)
                if key is not None:
                    self._found = True
                    value = float(ev.metrics[key])
                    if self.is_better(value):
                        self._save(ev, value)
                elif not self._found:
                    self._found = True
                    msg = missing_metric("BestCheckpointHook", self.metric, ev.metrics)
                    warnings.warn(msg + " No best checkpoint is saved without it.", stacklevel=2)
            yield ev

    def _save(self, ev: Evaluated, value: float) -> None:
        loop = ev.loop
        directory = _out_dir("BestCheckpointHook", self.out_dir, loop, optional=False)
        by_epoch = ev.by_epoch if self.by_epoch is None else self.by_epoch
        n = ev.state.epoch if by_epoch else ev.state.step
        if not by_epoch and self.count == "micro_batches":
            n = ev.state.micro_step
        ckpt = loop.checkpointer  # .name(): a .dcp directory for FSDP2
        name = ckpt.name(f"{self.name}_{'epoch' if by_epoch else 'iter'}_{n}.pth")
        old_best, old = self.best, self.best_file
        self.best, self.best_file = value, name  # saved inside the checkpoint itself

        kw = {"resumable": False, "metric": self.metric, "value": value}
        stop: BaseException | None = None
        try:
            try:
                write_checkpoint(loop, directory, name, "best", **kw)
            except BaseException as exc:  # Ctrl-C/SIGTERM mid-write: finish it (keep the best)
                if isinstance(exc, Exception):
                    raise
                stop = exc
                write_checkpoint(loop, directory, name, "best", **kw)
        except BaseException:  # not written: the best is still the old one
            self.best, self.best_file = old_best, old
            if stop is not None:
                raise stop from None
            raise
        if ckpt.main and old is not None and old != name:
            ckpt.manifest(directory).remove(old)
        if stop is not None:
            raise stop


class AutoCheckpointHook:
    """On Ctrl-C, SIGTERM or an error, save the last consistent state, then re-raise.

    ``interrupted.pth`` is a full checkpoint, so ``resume="auto"`` continues exactly; a run
    that ends normally removes it. Under ``torch.distributed`` it saves only if every rank
    stopped after the same micro-batch (agreed within ``agree_timeout`` seconds); otherwise it
    warns rather than hang.

    Example:
        >>> AutoCheckpointHook().name
        'auto_checkpoint'
    """

    priority = "LOWEST"
    name = "auto_checkpoint"
    cadence = Every()  # no StepEnd: it saves loop.state when stopped

    def __init__(
        self,
        out_dir: str | os.PathLike | None = None,
        *,
        optional: bool = False,
        agree_timeout: float = 10.0,
    ) -> None:
        flag("AutoCheckpointHook: optional", optional)
        number("AutoCheckpointHook: agree_timeout", agree_timeout, 0, low_open=True,
               why="seconds the ranks wait for each other before an interrupted save")  # fmt: skip
        self.optional, self.agree_timeout = optional, float(agree_timeout)
        self.out_dir = directory_arg("AutoCheckpointHook: out_dir", out_dir)

    def __repr__(self) -> str:
        return "AutoCheckpointHook()"

    def output_dirs(self, work_dir: Path | None) -> list[OutputDir]:
        """Where it writes (resume="auto" looks there too): ``out_dir``, else ``work_dir``."""
        return _checkpoint_dirs(self.out_dir, work_dir)

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)
        loop = first.loop
        directory = _out_dir("AutoCheckpointHook", self.out_dir, loop, self.optional)
        if directory is None:
            yield first
            yield from events
            return
        completed = False
        try:
            yield first
            for ev in events:
                completed = completed or type(ev) is RunEnd
                yield ev
        except BaseException as exc:  # KeyboardInterrupt, SIGTERM, errors, close()
            if not completed:
                self._save(loop, directory, exc)
            raise
        ckpt = loop.checkpointer
        if completed and ckpt.main:
            ckpt.wait(directory)
            manifest = ckpt.manifest(directory)
            names = ("interrupted.pth", sharded_name("interrupted.pth"))
            gone = [n for n in names if (manifest.entry(n) or {}).get("run") == loop.run_id]
            if gone:
                manifest.remove(*gone)

    @staticmethod
    def _write(loop: Run, directory: Path, exc: BaseException) -> None:
        """Write ``interrupted.pth``. In one process a second interrupt while it is written
        finishes it (a third abandons it): the next run resumes from it, and the logger cuts
        its lines back to it, even before the first update (a step-0 checkpoint)."""
        try:
            write_checkpoint(loop, directory, "interrupted.pth", "interrupted", reason=repr(exc))
        except (KeyboardInterrupt, SystemExit):
            if loop.checkpointer.world_size > 1:  # a collective: the other ranks are not retrying
                raise
            warnings.warn(
                f"Interrupted again while saving interrupted.pth (step {loop.state.step}): "
                "finishing it, so the run resumes from here. Interrupt once more to abandon it.",
                stacklevel=3,
            )
            write_checkpoint(loop, directory, "interrupted.pth", "interrupted", reason=repr(exc))

    def _save(self, loop: Run, directory: Path, exc: BaseException) -> None:
        if sys.is_finalizing():  # a loop left open at exit: Python can no longer write files
            return
        why = "not every rank was interrupted at the same step, and saving is a collective"
        try:
            if agree_to_save(loop.state, self.agree_timeout):
                why = None
                self._write(loop, directory, exc)
        except StaleStateError:
            why = "the step that failed consumed the state mid accumulation window"
        except CheckpointError as err:  # disk full, FSDP2 mid accumulation window...
            why = str(err)
        if why is not None:
            warnings.warn(
                f"Not saving a checkpoint on {type(exc).__name__}: {why}. Resume from the last "
                "periodic checkpoint.",
                stacklevel=2,
            )
