"""The Checkpointer: how this process writes and reads checkpoints (one process, DDP, FSDP2).

Hooks decide *when* to save; the Checkpointer decides *how*: one process writes
``iter_6.pth``; under DDP rank 0 writes the shared state there and every rank its
own part (RNG, data position, transform state, partial gradients, hooks'
``local_state_keys``) to ``iter_6.pth.rank{r}``; FSDP2 writes a
``torch.distributed.checkpoint`` directory ``iter_6.dcp`` (shards, ``ftrain.pth``,
``rank{r}.pth``). Only names, sizes and checksums travel between ranks.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain import dist as _dist
from ftrain._agreement import gather_object
from ftrain.errors import CheckpointError
from ftrain.persist.dcp_io import dcp_storage
from ftrain.persist.files import interruption, is_disk_full
from ftrain.persist.hostbuffer import HostBuffer
from ftrain.persist.location import Location, StoreURL, as_location
from ftrain.persist.lock import RunLock
from ftrain.persist.manifest import RANK_MARK, Manifest, newest_across
from ftrain.persist.rundir import RunDir
from ftrain.persist.savetime import SaveClock, SaveTime
from ftrain.persist.snapshot import Snapshot
from ftrain.persist.stager import ShardStager, storages
from ftrain.persist.writer import AsyncWriter, copy_to_host
from ftrain.state import add_reader

if TYPE_CHECKING:
    from ftrain.persist.lease import StoreLock
    from ftrain.persist.mirror import LogMirror
    from ftrain.state import TrainState

__all__ = ["Checkpointer", "SHARDED_SUFFIX", "META_FILE", "sharded_name", "load_checkpoint"]

#: Suffix of an FSDP2 (``torch.distributed.checkpoint``) checkpoint directory.
SHARDED_SUFFIX = ".dcp"
#: The file in a sharded checkpoint directory holding everything but the shards.
META_FILE = "ftrain.pth"
#: The ``state`` keys each rank owns (also ``data``, the loop's ``epoch_rng`` and the hooks'
#: ``local_state_keys``).
LOCAL_KEYS = ("rng", "grads", "transforms")
#: The loop's keys each rank owns: the RNG and the loader's generators when its epoch's data
#: was opened, the batches to re-read after restoring its loader, its totals.
LOCAL_LOOP_KEYS = ("epoch_rng", "epoch_generators", "data_skip", "totals")


def sharded_name(name: str) -> str:
    """The directory name of a sharded checkpoint: ``iter_4.pth`` → ``iter_4.dcp``.

    Example:
        >>> sharded_name("iter_4.pth")
        'iter_4.dcp'
    """
    stem = name[: -len(".pth")] if name.endswith(".pth") else name
    return stem if stem.endswith(SHARDED_SUFFIX) else stem + SHARDED_SUFFIX


def _split(
    ckpt: Mapping[str, Any], hook_keys: Mapping[str, tuple[str, ...]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, local): the part every rank has alike, and this rank's own (``None`` in shared)."""
    hook_keys = {name: keys for name, keys in hook_keys.items() if keys}
    state = dict(ckpt["state"])
    local = {k: state.pop(k, None) for k in LOCAL_KEYS}
    local["data"] = ckpt.get("data")
    shared = {**ckpt, "state": {**state, "grads": {}}, "data": None}
    position = ckpt.get("loop")
    if isinstance(position, Mapping):
        local["loop"] = {k: position[k] for k in LOCAL_LOOP_KEYS if k in position}
        shared["loop"] = {**position, **dict.fromkeys(local["loop"])}
    hooks = ckpt.get("hooks")
    if hook_keys and isinstance(hooks, Mapping):  # per-rank hook state (the logger's interval)
        hooks = dict(hooks)
        own: dict[str, dict[str, Any]] = {}
        for name, keys in hook_keys.items():
            saved = hooks.get(name)
            if isinstance(saved, Mapping):
                own[name] = {k: saved[k] for k in keys if k in saved}
                hooks[name] = {**saved, **dict.fromkeys(own[name])}
        local["hooks"] = own
        shared["hooks"] = hooks
    return shared, local


def _put_back(out: dict[str, Any], part: Mapping[str, Any] | None) -> None:
    """A rank's own loop and hook state from ``part`` into ``out``."""
    if not isinstance(part, Mapping):
        return
    mine = part.get("loop")
    if isinstance(mine, Mapping) and isinstance(out.get("loop"), Mapping):
        out["loop"] = {**out["loop"], **mine}
    own = part.get("hooks")
    if isinstance(own, Mapping) and isinstance(out.get("hooks"), Mapping):
        hooks = dict(out["hooks"])
        for name, values in own.items():
            if isinstance(hooks.get(name), Mapping):
                hooks[name] = {**hooks[name], **values}
        out["hooks"] = hooks


def _mean_grads(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for name in dict.fromkeys(n for p in parts for n in p):  # every name, in order
        present = [p[name] for p in parts if name in p]
        total = torch.stack([g.float() for g in present]).sum(0) / len(parts)
        out[name] = total.to(present[0].dtype)
    return out


@attrs.define
class _Job:
    """One save: where, under which name, its manifest entry, and how it is written."""

    dir: RunDir
    name: str
    entry: dict[str, Any]
    background: bool
    prune: Callable[[Manifest], list[str]] | None
    writer: AsyncWriter
    #: The directory's manifest, read once every earlier save ended (the main process).
    manifest: Manifest | None = None
    start: float = 0.0
    time: SaveTime | None = None  # once save() returned


class Checkpointer:
    """Writes and reads this run's checkpoints; one per run and process.

    ``clock``: the seconds :attr:`times` measures saves with.

    Example:
        >>> import torch
        >>> Checkpointer(torch.nn.Linear(2, 1))
        Checkpointer(world_size=1, sharded=False)
    """

    def __init__(
        self, model: torch.nn.Module, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.world_size = _dist.world_size()
        self.rank = _dist.rank()
        self.main = self.rank == 0
        self.sharded = _dist.is_sharded(model)
        self._writers: dict[str, AsyncWriter] = {}
        self._locks: dict[str, RunLock | StoreLock] = {}
        #: A work_dir on a store: the run's log files, uploaded after each commit.
        self._mirror: LogMirror | None = None
        self._dcp_group: Any = None
        #: A failed background save held until every rank raises it (torch.distributed).
        self._held: BaseException | None = None
        #: One host allocation for background snapshots (pinned for GPU tensors), reused by the next.
        self.host_buffer = HostBuffer()
        #: Background FSDP2 saves' stager: one pinned buffer, copies overlapping the next step.
        self.stager = ShardStager()
        #: The training-thread seconds of this run's saves (warned about on rank 0).
        self.times = SaveClock(clock, warn=self.main)
        self._last_name: str | None = None

    def __repr__(self) -> str:
        return f"Checkpointer(world_size={self.world_size}, sharded={self.sharded})"

    def name(self, name: str) -> str:
        """``name`` as written: a ``.dcp`` directory for a sharded model."""
        return sharded_name(name) if self.sharded else name

    @staticmethod
    def dir(directory: str | os.PathLike | StoreURL | RunDir) -> RunDir:
        """``directory`` as the :class:`~ftrain.persist.rundir.RunDir` every access goes through."""
        return directory if isinstance(directory, RunDir) else RunDir(directory)

    def manifest(self, directory: str | os.PathLike | StoreURL | RunDir) -> Manifest:
        """The manifest of ``directory`` (written by rank 0 only)."""
        return Manifest(self.dir(directory), main=self.main)

    def writer(self, directory: str | os.PathLike | StoreURL | RunDir) -> AsyncWriter:
        key = self.dir(directory).key
        if key not in self._writers:
            self._writers[key] = AsyncWriter()
        return self._writers[key]

    def lock(
        self, directory: str | os.PathLike | StoreURL | RunDir, holder: str | None = None
    ) -> None:
        """Check ``directory`` can be written, and keep other runs out of it until :meth:`close`
        (rank 0 only: it alone writes the directory). ``holder``: how the lock describes this
        run to a run it refuses (its work_dir); each directory is locked once.

        Example:
            >>> import tempfile, torch
            >>> ckpt, d = Checkpointer(torch.nn.Linear(2, 1)), tempfile.mkdtemp()
            >>> ckpt.lock(d); ckpt.lock(d + "/"); ckpt.locked == [RunDir(d).key]
            True
            >>> ckpt.close(); ckpt.locked
            []
        """
        d = self.dir(directory)
        if not self.main or d.key in self._locks:
            return
        d.check_writable()  # before step 1, with a clear error
        lock = d.lock(holder)
        lock.acquire()
        self._locks[d.key] = lock

    def attach_mirror(self, mirror: LogMirror) -> None:
        """Upload ``mirror`` (the log files of a run whose work_dir is on a store) after each
        checkpoint commit, and close it (a last upload) when the run's files are closed."""
        self._mirror = mirror

    def _push_logs(self) -> None:
        """A checkpoint's files are in place: its run's logs (at or past its mark) go to the
        store before the manifest commits it, so a resume from it finds its log lines."""
        if self._mirror is None:
            return
        try:
            self._mirror.push()
        except Exception as exc:  # noqa: BLE001 - the logs are sent again at the next commit
            warnings.warn(f"Could not upload the run's log files: {exc}", stacklevel=2)

    def _check_locks(self) -> None:
        """Raise if a lock of this run was lost (a store's lease taken over)."""
        try:
            for lock in self._locks.values():
                lock.check()
        except CheckpointError as exc:
            if self.world_size == 1:
                raise
            self._hold(exc)  # raised on every rank at the save's first agreement

    @property
    def locked(self) -> list[str]:
        """The directories this run holds the lock of (their real paths)."""
        return list(self._locks)

    def check(self) -> None:
        """Raise a finished background save's failure (held, with a warning, when distributed)."""
        for w in self._writers.values():
            try:
                w.check()
            except Exception as exc:
                if self.world_size == 1:
                    raise
                self._hold(exc)

    def _hold(self, exc: BaseException) -> None:
        if self._held is None:
            self._held = exc
            warnings.warn(
                f"{exc} (rank {self.rank}; every rank raises it at the next checkpoint save "
                "or at the end of the run)",
                stacklevel=3,
            )

    def _wait_holding(self) -> None:
        for w in list(self._writers.values()):
            try:
                w.wait()
            except Exception as exc:
                self._hold(exc)

    def _agree(self) -> None:
        """Raise any rank's held failure on every rank together (a collective of short messages):
        one rank raising alone would leave the others waiting in a collective."""
        held, self._held = self._held, None
        if self.world_size == 1:
            if held is not None:
                raise held
            return
        mine = None if held is None else f"rank {self.rank}: {held}"
        failed = [m for m in _all_objects(mine) if m is not None]
        if failed:
            raise CheckpointError(
                "A checkpoint save failed, so every rank stops here: " + " | ".join(failed)
            ) from held

    def wait(self, directory: str | os.PathLike | StoreURL | RunDir | None = None) -> None:
        """Wait for the background saves (of ``directory``); raise this rank's failure."""
        held, self._held = self._held, None
        if held is not None:
            self._wait_holding()
            raise held
        keys = list(self._writers) if directory is None else [self.dir(directory).key]
        for w in [self._writers[k] for k in keys if k in self._writers]:
            w.wait()

    def settle(self) -> None:
        """Wait for every background save; any rank's failure is raised on every rank (a collective).

        Example:
            >>> import torch
            >>> Checkpointer(torch.nn.Linear(2, 1)).settle()
        """
        if self.world_size == 1:
            self.wait()
            return
        self._wait_holding()
        self._agree()

    def close(self) -> None:
        """Wait for every write (the run's threads have ended when this returns); unlock the
        directories :meth:`lock` locked."""
        try:
            self.wait()
        finally:
            self._writers.clear()
            self.stager.close()  # the snapshot buffers go with the run
            self.host_buffer.release()
            mirror, self._mirror = self._mirror, None
            if mirror is not None:
                mirror.close()  # the logs' last upload, under the lock
            locks, self._locks = self._locks, {}
            for lock in locks.values():
                lock.release()

    @staticmethod
    def _good(directory: RunDir) -> list[str]:
        """The recorded checkpoints of ``directory`` that exist, oldest first (for messages)."""
        with contextlib.suppress(Exception):
            return Manifest(directory, main=False, rebuild=False).good()
        return []

    def _error(self, directory: RunDir, name: str) -> Callable[[BaseException], BaseException]:
        def convert(exc: BaseException) -> BaseException:
            return directory.write_error(exc, name, self._good(directory))

        return convert

    def _failure(self, exc: BaseException, directory: RunDir, name: str) -> BaseException:
        """What a failed write of ``name`` raises: an interruption as itself (``torch.save``
        reports a Ctrl-C inside it as a ``RuntimeError``), a file error as a
        :class:`CheckpointError` naming the file, anything else unchanged."""
        if isinstance(exc, CheckpointError):
            return exc
        stop = interruption(exc)
        if stop is not None:
            return self._interrupted(stop, directory, name)
        if isinstance(exc, OSError) or is_disk_full(exc):
            return self._error(directory, name)(exc)
        return exc

    def _interrupted(self, stop: BaseException, directory: RunDir, name: str) -> BaseException:
        """``stop`` (Ctrl-C, SIGTERM) that cut the write of ``name`` short, noting the previous
        good checkpoint: raised as the interruption it is (exit status 130 or 75)."""
        good = self._good(directory)
        previous = good[-1] if good else "none yet"
        report = (
            f"Interrupted while writing checkpoint {directory.local(name)} "
            f"({type(stop).__name__}): it was not written (its partial file is removed). The "
            f"previous good checkpoint there is {previous}; resume='auto' continues from the "
            "newest good one."
        )
        warnings.warn(report, stacklevel=4)
        stop.add_note(report)
        return stop

    def check_writable(self, directory: str | os.PathLike | StoreURL | RunDir) -> None:
        """Raise a :class:`CheckpointError` now (before step 1) if ``directory`` cannot be written."""
        if self.main:
            self.dir(directory).check_writable()

    def save(
        self,
        snapshot: Snapshot,
        directory: str | os.PathLike | StoreURL | RunDir,
        name: str,
        kind: str,
        *,
        background: bool = False,
        prune: Callable[[Manifest], list[str]] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Write ``snapshot`` as ``directory/name``, recorded in the manifest; return the entry.

        A collective when distributed: every rank calls it with its own snapshot. ``kind``:
        ``"periodic"``, ``"best"``, ``"interrupted"``; ``prune(manifest)`` names files to
        delete once the new one is recorded; ``extra`` goes into the manifest entry.
        ``background=True`` returns once the snapshot is in host memory (one in flight).

        Example:
            >>> import tempfile, torch
            >>> snap = Snapshot({"format": "demo"}, step=2, micro_step=2, epoch=0, run_id="r")
            >>> entry = Checkpointer(torch.nn.Linear(2, 1)).save(snap, tempfile.mkdtemp(),
            ...                                                  "iter_2.pth", "periodic")
            >>> entry["name"], entry["step"], entry["run"]
            ('iter_2.pth', 2, 'r')
        """
        d = self.dir(directory)
        start = self.times.start(snapshot.step)
        job = _Job(d, self.name(name), self._entry(snapshot, self.name(name), kind, extra),
                   background, prune, self.writer(d), start=start)  # fmt: skip
        self._check_locks()
        waited = self._wait_previous(job.name)  # one save in flight; a failure raised here
        self._check_owner(job)
        try:
            self._dispatch(self._stamp(snapshot, job), job)
        except (KeyboardInterrupt, SystemExit, OSError, RuntimeError) as exc:
            failure = self._failure(exc, d, job.name)
            if failure is exc:
                raise
            raise failure from (exc if isinstance(failure, CheckpointError) else None)
        if not background:
            job.writer.wait()
        job.time = self.times.finish(job.name, start, waited_s=waited)
        self._last_name = job.name
        return job.entry

    def _check_owner(self, job: _Job) -> None:
        """Refuse to write over a file another run's manifest entry names (a run resumed into
        a directory of another run's checkpoints: its names may collide). Rank 0 decides."""
        problem = None
        if self.main:
            theirs = Manifest(job.dir, main=False, rebuild=False).entry(job.name)
            run, ours = (theirs or {}).get("run"), job.entry.get("run")
            if run is not None and ours is not None and run != ours:
                problem = (
                    f"Not writing {job.dir.local(job.name)}: that file is a checkpoint of "
                    f"another run ({run}; this run is {ours}). A run resumed into a directory "
                    "of another run's checkpoints must not overwrite them. Resume into the "
                    "checkpoint's own directory, or into a new work_dir/out_dir."
                )
        if self.world_size > 1:
            problem = _dist.broadcast_object(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def _stamp(self, snapshot: Snapshot, job: _Job) -> Snapshot:
        """Main process: read the directory's manifest; the checkpoint records its own run,
        directory, generation and step (``meta``: the manifest's check)."""
        if not self.main:
            return snapshot
        job.manifest = self.manifest(job.dir)
        meta = job.manifest.meta(job.entry)
        job.entry["generation"] = meta["generation"]
        return attrs.evolve(snapshot, payload={**snapshot.payload, "meta": meta})

    def _wait_previous(self, name: str) -> float:
        """Wait for the background writes (a failed one is raised here; distributed: held for
        the first collective); the seconds waited, said in a warning, when one was running."""
        busy = any(w.busy for w in self._writers.values())
        start = self.times.clock()
        if self.world_size == 1:
            self.wait()
        else:
            self._wait_holding()
        if not busy:
            return 0.0
        waited = self.times.clock() - start
        self.times.waited(name, self._last_name, waited)
        return waited

    def _dispatch(self, snapshot: Snapshot, job: _Job) -> None:
        if self.sharded:
            self._save_sharded(snapshot, job)
        elif self.world_size > 1:
            self._save_ddp(snapshot, job)
        else:
            self._write(snapshot.payload, job)

    def _entry(self, snap: Snapshot, name: str, kind: str, extra: Mapping[str, Any]) -> dict:
        """The manifest entry of a save (its size and checksum are added once written)."""
        entry: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "step": snap.step,
            "micro_step": snap.micro_step,
            "epoch": snap.epoch,
            "time": time.time(),
            "world_size": self.world_size,
        }
        if snap.run_id is not None:
            entry["run"] = snap.run_id  # max_keep prunes this run's files only
        return {**entry, **extra}

    def _submit(self, job: _Job, work: Callable[[], None]) -> None:
        """Run ``work`` now, or on the directory's writer thread for a background save."""
        if job.background:
            self._stamp_blocked(job)  # what blocked training ends here
            job.writer.submit(work, on_error=self._error(job.dir, job.name))
        else:
            work()

    def _stamp_blocked(self, job: _Job) -> None:
        """The training thread's seconds in this save so far, into its manifest entry."""
        job.entry.setdefault("blocked_s", round(self.times.clock() - job.start, 6))

    def _record(self, job: _Job, manifest: Manifest) -> None:
        self._stamp_blocked(job)
        self._push_logs()  # before the manifest names the checkpoint: its logs are there
        manifest.update(job.entry, prune=job.prune)

    def _write(self, obj: Any, job: _Job) -> None:
        """Write ``obj`` as ``job.name`` and record it (on the writer's thread if background)."""
        host = copy_to_host(obj, self.host_buffer) if job.background else None

        def work() -> None:
            snap = obj if host is None else host.wait()  # the device copies' event
            staged, info = job.dir.stage(snap, job.name)
            job.entry.update(info)
            manifest = job.manifest or self.manifest(job.dir)  # read before the rename
            job.dir.commit(staged, job.name)  # the manifest write syncs the directory
            self._record(job, manifest)

        self._submit(job, work)

    def _write_local(self, local: dict[str, Any], directory: RunDir, name: str) -> dict[str, Any]:
        try:
            info: Any = directory.save(local, name)
        except BaseException as exc:  # every rank must reach the gather, or none hangs
            info = ("__ftrain_error__", repr(exc))
        infos = gather_object(info)
        failed = _dist.broadcast_object(
            next((i[1] for i in infos if isinstance(i, tuple)), None) if infos else None
        )
        if failed is not None:
            raise CheckpointError(f"A rank failed to write its part of {name}: {failed}")
        return {"rank_files": infos} if infos is not None else {}

    def _save_ddp(self, snapshot: Snapshot, job: _Job) -> None:
        shared, local = _split(snapshot.payload, snapshot.local_hook_keys)
        if self.main:
            try:
                job.dir.make()
            except OSError as exc:
                self._hold(self._error(job.dir, job.name)(exc))
        self._agree()  # also the barrier: the directory exists on every rank's return
        own = f"{job.name}{RANK_MARK}{self.rank}"
        job.entry.update(self._write_local(local, job.dir, own))
        if self.main:
            shared["rank_files"] = self.world_size
            self._write(shared, job)

    def _save_sharded(self, snapshot: Snapshot, job: _Job) -> None:
        state = _shardable(snapshot, job.name)
        self._agree()  # a failed earlier save (any rank's) is raised on every rank
        staged = self._stage_sharded(job) if self.main else None
        tmp: Location = _dist.broadcast_object(staged)
        shared, local = _split(snapshot.payload, snapshot.local_hook_keys)
        job.entry.update(self._write_local(local, RunDir(tmp), f"rank{self.rank}.pth"))
        write = self._save_shards(state, tmp, job)
        meta_info = self._save_meta(shared, RunDir(tmp)) if self.main else {}
        self._submit(job, self._commit_sharded(job, tmp, write, meta_info))
        if not job.background:
            _dist.barrier()  # the directory is in place on every rank's return

    def _commit_sharded(
        self, job: _Job, tmp: Location, write: Callable[[], None] | None, meta_info: dict
    ) -> Callable[[], None]:
        """The rest of a sharded save: the shards (background), then rank 0 puts the
        directory in place and records it."""

        def work() -> None:
            if write is not None:
                write()
            if not self.main:
                return
            size = job.dir.size(tmp.name)
            job.entry.update(meta=meta_info, bytes=size, sharded=True)
            manifest = job.manifest or self.manifest(job.dir)
            job.dir.commit_dir(tmp, job.name)
            self._record(job, manifest)

        return work

    @staticmethod
    def _stage_sharded(job: _Job) -> Location:
        """Main process: where the sharded checkpoint is written before its commit. A store
        writes it under its own prefix: a listed one is first dropped from the manifest."""
        if not job.dir.atomic_dirs and job.manifest is not None and job.manifest.entry(job.name):
            job.manifest.remove(job.name)
        return job.dir.stage_dir(job.name)

    def _save_shards(
        self, state: TrainState, tmp: Location, job: _Job
    ) -> Callable[[], None] | None:
        """DCP-save the model's and optimizer's shards into ``tmp`` now; in the background:
        start staging them into the run's pinned buffer (overlapping the next step, whose
        update waits for it) and return the write, for the writer thread."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        if not job.background:
            dcp_call("save", target, tmp)
            return None
        if self._dcp_group is None and _dist.is_distributed():
            self._dcp_group = torch.distributed.new_group(backend="gloo")
        group = self._dcp_group
        staged = self.stager.stage(target, deferred=storages(_updated(state)))
        add_reader(state, self._fence(job))
        return lambda: dcp_call("save", staged.result(), tmp, process_group=group)

    def _fence(self, job: _Job) -> Callable[[], None]:
        """What the next update waits for: this save's copies (the seconds are its own)."""

        def wait() -> None:
            start = self.times.clock()
            self.stager.wait()
            if job.time is not None:
                self.times.add_fence(job.time, self.times.clock() - start)

        return wait

    def _save_meta(self, shared: dict[str, Any], tmp: RunDir) -> dict[str, Any]:
        """Rank 0: everything but the shards, as the sharded checkpoint's ``ftrain.pth``."""
        shared["state"] = {**shared["state"], "model": None, "optimizer": None}
        shared["sharded"] = {
            "format": "torch.distributed.checkpoint",
            "world_size": self.world_size,
        }
        shared["rank_files"] = self.world_size
        return tmp.save(shared, META_FILE)

    def read(
        self, path: str | os.PathLike | StoreURL, *, entry: Mapping[str, Any] | None = None
    ) -> dict:
        """Load and verify the checkpoint at ``path`` (a path or a URL), with this rank's own
        part in place.

        Returns what :meth:`ftrain.loop.Loop.load` takes; with another number
        of processes than wrote it, warns what is approximated.
        """
        path = as_location(path)
        d, name = RunDir(path.parent), path.name
        if entry is None:
            entry = Manifest(d, main=False, rebuild=False).entry(name)
        saved = _load(d, name, "cpu", entry)
        if not isinstance(saved, dict):
            return saved
        n_files = saved.pop("rank_files", None)
        parts = saved.pop("ranks", None)  # ftrain 0.1.0: every rank's part in rank 0's file
        if n_files:
            infos = (entry or {}).get("rank_files") or [None] * n_files
            wanted = [self.rank] if n_files == self.world_size else range(n_files)
            parts = [None] * n_files
            for r in wanted:
                own = f"{name}/rank{r}.pth" if d.is_dir(name) else f"{name}{RANK_MARK}{r}"
                parts[r] = d.load(own, expected=infos[r] if r < len(infos) else None)
        return self.localize(saved, parts, str(path))

    def localize(self, saved: dict[str, Any], parts: list[Any] | None, source: str) -> dict:
        """``saved`` with this rank's part of ``parts`` (every rank's own state) in place;
        written by another number of processes, its state names them (``written_by``, for a
        resharding error)."""
        out = dict(saved)
        state = dict(out["state"]) if isinstance(out.get("state"), Mapping) else None
        saved_n = int((out.get("dist") or {}).get("world_size", 1))
        n, r = self.world_size, self.rank
        if parts is not None and state is not None:
            if saved_n == n:
                mine = parts[r]
                state.update({k: mine[k] for k in LOCAL_KEYS})
                out["data"] = mine["data"]
                _put_back(out, mine)
            else:
                got = [p for p in parts if p is not None]
                state["rng"] = parts[r]["rng"] if r < len(parts) else None
                state["grads"] = _mean_grads([p["grads"] or {} for p in got])
                state["transforms"] = got[0]["transforms"]
                out["data"] = got[0]["data"]
                _put_back(out, parts[r] if r < len(parts) else None)
        if saved_n != n:
            if state is not None:
                state["written_by"] = saved_n
            warnings.warn(
                f"{source} was written by {saved_n} process(es) and is resumed by {n}: model, "
                "optimizer, counters and hook state load exactly; the data position, per-rank "
                "RNG, per-rank hook state (the logger's partial interval) and a partial "
                "accumulation window are approximated (see ftrain.dist docs).",
                stacklevel=4,
            )
        if state is not None:
            out["state"] = state
        return out

    @staticmethod
    def placeholders(saved_state: Mapping[str, Any], state: TrainState) -> dict[str, Any]:
        """``saved_state`` with the live model/optimizer standing in for the shards."""
        model = _dist.unwrap(state.model).state_dict()
        groups = state.optimizer.state_dict()["param_groups"]
        return {**saved_state, "model": model, "optimizer": {"state": {}, "param_groups": groups}}

    def load_sharded(self, state: TrainState, path: str | os.PathLike | StoreURL) -> None:
        """Load model and optimizer from a sharded checkpoint directory into ``state``, in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = state.model, state.optimizer
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        dcp_call("load", target, as_location(path))
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
        )

    def find(
        self, directories: Sequence[str | os.PathLike | StoreURL]
    ) -> tuple[Location, dict] | None:
        """The newest checkpoint in ``directories`` that verifies and loads, read for this rank.

        Bad files are skipped with a warning; rank 0 chooses, every rank reads the same one.
        """
        chosen = None
        if self.main:
            candidates = []
            for d in map(RunDir, directories):
                if d.is_dir():
                    candidates += [{**e, "_dir": d.path} for e in Manifest(d).resumable()]
            if len(directories) > 1:  # across directories: by step (generations are per directory)
                candidates = newest_across(candidates)
            chosen = [(e["_dir"] / e["name"], e) for e in candidates]
            for _, e in chosen:
                del e["_dir"]
        chosen = _dist.broadcast_object(chosen)
        for path, entry in chosen or []:
            ok = True
            try:
                found = self.read(path, entry=entry)
            except (CheckpointError, OSError) as exc:
                ok = False
                if self.main:
                    warnings.warn(f"Skipping checkpoint {path}: {exc}", stacklevel=3)
            if all(_all_objects(ok)):
                return path, found
        return None


def _shardable(snapshot: Snapshot, name: str) -> TrainState:
    """The state a sharded save reads its shards from; a clear error when it cannot."""
    if snapshot.pending:
        raise CheckpointError(
            f"Cannot write the sharded checkpoint {name} in the middle of an accumulation "
            f"window ({snapshot.pending} micro-batches pending): FSDP2 keeps the partial "
            "gradients unsharded inside fully_shard, out of reach of a checkpoint. "
            "Checkpoint at optimizer updates (CheckpointHook does)."
        )
    if snapshot.state is None:
        raise CheckpointError(
            f"Cannot write the sharded checkpoint {name}: the snapshot holds no state to "
            "read the model's shards from. Take it with Run.snapshot() (Loop.snapshot())."
        )
    return snapshot.state


def _updated(state: TrainState) -> list[torch.Tensor]:
    """The tensors only an optimizer update changes: the parameters and the optimizer state."""
    opt = [v for s in state.optimizer.state.values() for v in s.values()]
    return [*state.model.parameters(), *(v for v in opt if isinstance(v, torch.Tensor))]


def _all_objects(obj: Any) -> list[Any]:
    """Every rank's small picklable ``obj`` (no tensors), on every rank."""
    if _dist.world_size() == 1:
        return [obj]
    out: list[Any] = [None] * _dist.world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def load_checkpoint(
    path: str | os.PathLike | StoreURL,
    *,
    map_location: Any = "cpu",
    expected: Mapping[str, Any] | None = None,
) -> Any:
    """Load a checkpoint file, verified against its manifest entry (or its own CRC-32s).

    ``path``: a local path, or a URL on an object store (``"s3://bucket/run/iter_4.pth"``,
    or a :class:`~ftrain.persist.location.StoreURL` with its ``storage_options``).

    A sharded (``.dcp``) directory gives its ``ftrain.pth`` with the
    directory in ``"sharded_dir"``. Raises :class:`~ftrain.errors.CheckpointError`
    naming the file, what is wrong, and the fix.

    Example:
        >>> import tempfile, os
        >>> from ftrain.persist.files import save_atomic
        >>> p = os.path.join(tempfile.mkdtemp(), "a.pth")
        >>> _ = save_atomic({"x": 1}, p)
        >>> load_checkpoint(p)["x"]
        1
    """
    path = as_location(path)
    return _load(RunDir(path.parent), path.name, map_location, expected)


def _load(d: RunDir, name: str, map_location: Any, expected: Mapping[str, Any] | None) -> Any:
    if expected is None:
        expected = Manifest(d, main=False, rebuild=False).entry(name)
    if not d.is_dir(name):
        return d.load(name, map_location=map_location, expected=expected)
    if not (d.exists(f"{name}/.metadata") and d.exists(f"{name}/{META_FILE}")):
        raise CheckpointError(
            f"Checkpoint directory {d.local(name)} is incomplete (no .metadata or {META_FILE}): "
            "the run was probably killed while writing it. Resume from an earlier checkpoint "
            "(resume='auto' picks the newest good one)."
        )
    meta_entry = (expected or {}).get("meta")
    saved = d.load(f"{name}/{META_FILE}", map_location=map_location, expected=meta_entry)
    if isinstance(saved, dict):  # a store's: its URL with the options to reach it
        where = d.local(name)
        saved["sharded_dir"] = where if isinstance(where, StoreURL) else str(where)
    return saved


def dcp_call(op: str, target: dict[str, Any], path: Location, **kwargs: Any) -> Any:
    """``dcp.<op>`` (save, async_save, load) at ``path`` (a directory, or a store's prefix:
    :func:`~ftrain.persist.dcp_io.dcp_storage`); in one process without its warning about it."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return getattr(dcp, op)(
            target, no_dist=not _dist.is_distributed(), **dcp_storage(op, path), **kwargs
        )
