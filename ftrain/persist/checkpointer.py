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
import shutil
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ftrain import dist as _dist
from ftrain.errors import CheckpointError
from ftrain.persist.files import (
    commit_atomic,
    fsync_dir,
    is_disk_full,
    load_file,
    save_atomic,
    stage_atomic,
    tmp_path,
    write_error,
)
from ftrain.persist.manifest import RANK_MARK, Manifest
from ftrain.persist.writer import AsyncWriter, to_host

__all__ = ["Checkpointer", "SHARDED_SUFFIX", "META_FILE", "sharded_name", "load_checkpoint"]

#: Suffix of an FSDP2 (``torch.distributed.checkpoint``) checkpoint directory.
SHARDED_SUFFIX = ".dcp"
#: The file in a sharded checkpoint directory holding everything but the shards.
META_FILE = "ftrain.pth"
#: The ``state`` keys each rank owns (also ``data``, the loop's ``epoch_rng`` and the hooks'
#: ``local_state_keys``).
LOCAL_KEYS = ("rng", "grads", "transforms")
#: The loop's keys each rank owns: the RNG when a plain iterable's epoch began, its totals.
LOCAL_LOOP_KEYS = ("epoch_rng", "totals")


def sharded_name(name: str) -> str:
    """The directory name of a sharded checkpoint: ``iter_4.pth`` → ``iter_4.dcp``.

    Example:
        >>> sharded_name("iter_4.pth")
        'iter_4.dcp'
    """
    stem = name[: -len(".pth")] if name.endswith(".pth") else name
    return stem if stem.endswith(SHARDED_SUFFIX) else stem + SHARDED_SUFFIX


def _split(ckpt: Mapping[str, Any], loop: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, local): the part every rank has alike, and this rank's own (``None`` in shared)."""
    hook_keys = {
        h.name: tuple(h.local_state_keys)
        for h in getattr(loop, "hooks", ())
        if getattr(h, "local_state_keys", ())
    }
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


class Checkpointer:
    """Writes and reads this run's checkpoints; one per run and process.

    Example:
        >>> import torch
        >>> Checkpointer(torch.nn.Linear(2, 1))
        Checkpointer(world_size=1, sharded=False)
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.world_size = _dist.world_size()
        self.rank = _dist.rank()
        self.main = self.rank == 0
        self.sharded = _dist.is_sharded(model)
        self._writers: dict[str, AsyncWriter] = {}
        self._dcp_group: Any = None
        #: A failed background save held until every rank raises it (torch.distributed).
        self._held: BaseException | None = None
        #: Host buffers of the last background snapshot, reused by the next (one in flight).
        self._pool: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return f"Checkpointer(world_size={self.world_size}, sharded={self.sharded})"

    def name(self, name: str) -> str:
        """``name`` as written: a ``.dcp`` directory for a sharded model."""
        return sharded_name(name) if self.sharded else name

    def manifest(self, directory: str | os.PathLike) -> Manifest:
        """The manifest of ``directory`` (written by rank 0 only)."""
        return Manifest(directory, main=self.main)

    def writer(self, directory: str | os.PathLike) -> AsyncWriter:
        key = os.path.realpath(directory)
        if key not in self._writers:
            self._writers[key] = AsyncWriter()
        return self._writers[key]

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

    def wait(self, directory: str | os.PathLike | None = None) -> None:
        """Wait for the background saves (of ``directory``); raise this rank's failure."""
        held, self._held = self._held, None
        if held is not None:
            self._wait_holding()
            raise held
        keys = list(self._writers) if directory is None else [os.path.realpath(directory)]
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
        """Wait for every write; the run's threads have ended when this returns."""
        try:
            self.wait()
        finally:
            self._writers.clear()
            self._pool = []  # the snapshot buffers go with the run

    def _error(self, directory: Path, name: str) -> Callable[[BaseException], BaseException]:
        def convert(exc: BaseException) -> BaseException:
            with contextlib.suppress(Exception):
                good = Manifest(directory, main=False).good()
                return write_error(exc, directory, name, good)
            return write_error(exc, directory, name, [])

        return convert

    def check_writable(self, directory: Path) -> None:
        """Raise a :class:`CheckpointError` now (before step 1) if ``directory`` cannot be written."""
        if not self.main:
            return
        blocker = next((p for p in (directory, *directory.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise CheckpointError(
                f"{directory} cannot be a run directory: {blocker} is a file (left "
                "untouched). Pass a directory path as work_dir (or out_dir), or move the file."
            )
        probe = directory / f".ftrain-probe.tmp-{os.getpid()}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ftrain")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(
                f"Cannot write checkpoints to {directory} ({type(exc).__name__}: {exc}). Pass a "
                "work_dir (or out_dir) you can write to, or fix its permissions."
            ) from exc

    def save(
        self,
        loop: Any,
        directory: str | os.PathLike,
        name: str,
        kind: str,
        *,
        background: bool = False,
        prune: Callable[[Manifest], list[str]] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Write ``loop.checkpoint()`` as ``directory/name``, recorded in the manifest.

        A collective when distributed. ``prune(manifest)`` names files to
        delete once the new one is recorded. ``background=True`` returns once
        the state is in host memory. Returns the manifest entry.
        """
        directory = Path(directory)
        name = self.name(name)
        state = loop.state
        entry: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "step": state.step,
            "micro_step": state.micro_step,
            "epoch": state.epoch,
            "time": time.time(),
            "world_size": self.world_size,
            **extra,
        }
        writer = self.writer(directory)
        # one save in flight; a failed one is raised here (distributed: at the first collective)
        if self.world_size == 1:
            self.wait()
        else:
            self._wait_holding()
        try:
            if self.sharded:
                self._save_sharded(loop, directory, name, entry, background, prune, writer)
            elif self.world_size > 1:
                self._save_ddp(loop, directory, name, entry, background, prune, writer)
            else:
                self._write(loop.checkpoint(), directory, name, entry, background, prune, writer)
        except CheckpointError:
            raise
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, OSError) or is_disk_full(exc):
                raise self._error(directory, name)(exc) from exc
            raise
        if not background:
            writer.wait()
        return entry

    def _write(self, obj, directory, name, entry, background, prune, writer) -> None:  # noqa: ANN001
        """Write ``obj`` as ``directory/name`` and record it (on ``writer``'s thread if background)."""
        path = directory / name
        snap = to_host(obj, self._pool) if background else obj

        def job() -> None:
            tmp, info = stage_atomic(snap, path)
            entry.update(info)
            manifest = self.manifest(directory)  # read before the rename
            commit_atomic(tmp, path, sync_dir=False)  # the manifest write syncs the directory
            manifest.update(entry, prune=prune)

        if background:
            writer.submit(job, on_error=self._error(directory, name))
        else:
            job()

    def _write_local(self, local: dict[str, Any], path: Path) -> dict[str, Any]:
        try:
            info: Any = save_atomic(local, path)
        except BaseException as exc:  # every rank must reach the gather, or none hangs
            info = ("__ftrain_error__", repr(exc))
        infos = _dist.gather_object(info)
        failed = _dist.broadcast_object(
            next((i[1] for i in infos if isinstance(i, tuple)), None) if infos else None
        )
        if failed is not None:
            raise CheckpointError(f"A rank failed to write its part of {path.name}: {failed}")
        return {"rank_files": infos} if infos is not None else {}

    def _save_ddp(self, loop, directory, name, *args) -> None:  # noqa: ANN001
        ckpt = loop.checkpoint()
        shared, local = _split(ckpt, loop)
        del ckpt
        entry = args[0]
        if self.main:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._hold(self._error(directory, name)(exc))
        self._agree()  # also the barrier: the directory exists on every rank's return
        entry.update(self._write_local(local, directory / f"{name}{RANK_MARK}{self.rank}"))
        if self.main:
            shared["rank_files"] = self.world_size
            self._write(shared, directory, name, *args)

    def _save_sharded(self, loop, directory, name, entry, background, prune, writer) -> None:  # noqa: ANN001
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state = loop.state
        pending = loop.step.pending(state)
        if pending:
            raise CheckpointError(
                f"Cannot write the sharded checkpoint {name} in the middle of an accumulation "
                f"window ({pending} micro-batches pending): FSDP2 keeps the partial gradients "
                "unsharded inside fully_shard, out of reach of a checkpoint. Checkpoint at "
                "optimizer updates (CheckpointHook does)."
            )
        self._agree()  # a failed earlier save (any rank's) is raised on every rank
        final = directory / name
        tmp: Any = None
        if self.main:
            tmp = tmp_path(final)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        tmp = Path(_dist.broadcast_object(None if tmp is None else str(tmp)))
        ckpt = loop.checkpoint()
        shared, local = _split(ckpt, loop)
        del ckpt
        entry.update(self._write_local(local, tmp / f"rank{self.rank}.pth"))
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        if background:
            if self._dcp_group is None and _dist.is_distributed():
                self._dcp_group = torch.distributed.new_group(backend="gloo")
            future: Any = dcp_call("async_save", target, tmp, process_group=self._dcp_group)
            future = getattr(future, "upload_completion", future)
        else:
            dcp_call("save", target, tmp)
            future = None
        meta_info: dict[str, Any] = {}
        if self.main:
            shared["state"] = {**shared["state"], "model": None, "optimizer": None}
            shared["sharded"] = {
                "format": "torch.distributed.checkpoint",
                "world_size": self.world_size,
            }
            shared["rank_files"] = self.world_size
            meta_info = save_atomic(shared, tmp / META_FILE)

        def job() -> None:
            if future is not None:
                future.result()
            if not self.main:
                return
            entry["meta"] = meta_info
            entry["bytes"] = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
            entry["sharded"] = True
            manifest = self.manifest(directory)
            old = None
            if final.exists():
                old = directory / f".{name}.tmp-old-{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            manifest.update(entry, prune=prune)

        if background:
            writer.submit(job, on_error=self._error(directory, name))
        else:
            job()
            _dist.barrier()  # the directory is in place on every rank's return

    def read(self, path: str | os.PathLike, *, entry: Mapping[str, Any] | None = None) -> dict:
        """Load and verify the checkpoint at ``path``, with this rank's own part in place.

        Returns what :meth:`ftrain.loop.Loop.load` takes; with another number
        of processes than wrote it, warns what is approximated.
        """
        path = Path(path)
        if entry is None:
            entry = Manifest(path.parent, main=False, rebuild=False).entry(path.name)
        saved = load_checkpoint(path, expected=entry)
        if not isinstance(saved, dict):
            return saved
        n_files = saved.pop("rank_files", None)
        parts = saved.pop("ranks", None)  # ftrain 0.1.0: every rank's part in rank 0's file
        if n_files:
            infos = (entry or {}).get("rank_files") or [None] * n_files
            wanted = [self.rank] if n_files == self.world_size else range(n_files)
            parts = [None] * n_files
            for r in wanted:
                own = path / f"rank{r}.pth" if path.is_dir() else Path(f"{path}{RANK_MARK}{r}")
                parts[r] = load_file(own, expected=infos[r] if r < len(infos) else None)
        return self.localize(saved, parts, str(path))

    def localize(self, saved: dict[str, Any], parts: list[Any] | None, source: str) -> dict:
        """``saved`` with this rank's part of ``parts`` (every rank's own state) in place."""
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
    def placeholders(saved_state: Mapping[str, Any], state: Any) -> dict[str, Any]:
        """``saved_state`` with the live model/optimizer standing in for the shards."""
        model = _dist.unwrap(state.model).state_dict()
        groups = state.optimizer.state_dict()["param_groups"]
        return {**saved_state, "model": model, "optimizer": {"state": {}, "param_groups": groups}}

    def load_sharded(self, state: Any, path: str | os.PathLike) -> None:
        """Load model and optimizer from a sharded checkpoint directory into ``state``, in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = state.model, state.optimizer
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        dcp_call("load", target, Path(path))
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
        )

    def find(self, directories: Sequence[str | os.PathLike]) -> tuple[Path, dict] | None:
        """The newest checkpoint in ``directories`` that verifies and loads, read for this rank.

        Bad files are skipped with a warning; rank 0 chooses, every rank reads the same one.
        """
        chosen = None
        if self.main:
            candidates = []
            for d in map(Path, directories):
                if d.is_dir():
                    candidates += [(e, d) for e in Manifest(d).resumable()]
            if len(directories) > 1:  # newest written first across directories
                candidates.sort(key=lambda t: t[0].get("time", 0), reverse=True)
            chosen = [(str(d / e["name"]), e) for e, d in candidates]
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
                return Path(path), found
        return None


def _all_objects(obj: Any) -> list[Any]:
    """Every rank's small picklable ``obj`` (no tensors), on every rank."""
    if _dist.world_size() == 1:
        return [obj]
    out: list[Any] = [None] * _dist.world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def load_checkpoint(
    path: str | os.PathLike, *, map_location: Any = "cpu", expected: Mapping[str, Any] | None = None
) -> Any:
    """Load a checkpoint file, verified against its manifest entry (or its own CRC-32s).

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
    path = Path(path)
    if expected is None:
        expected = Manifest(path.parent, main=False, rebuild=False).entry(path.name)
    if not path.is_dir():
        return load_file(path, map_location=map_location, expected=expected)
    meta = path / META_FILE
    if not (path / ".metadata").is_file() or not meta.is_file():
        raise CheckpointError(
            f"Checkpoint directory {path} is incomplete (no .metadata or {META_FILE}): the run "
            "was probably killed while writing it. Resume from an earlier checkpoint "
            "(resume='auto' picks the newest good one)."
        )
    saved = load_file(meta, map_location=map_location, expected=(expected or {}).get("meta"))
    if isinstance(saved, dict):
        saved["sharded_dir"] = str(path)
    return saved


def dcp_call(op: str, target: dict[str, Any], path: Path, **kwargs: Any) -> Any:
    """``dcp.<op>`` (save, async_save, load); in one process without its warning about it."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return getattr(dcp, op)(
            target, checkpoint_id=path, no_dist=not _dist.is_distributed(), **kwargs
        )
