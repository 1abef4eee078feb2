"""Checkpoint files: atomic writes, verified reads, a manifest per directory.

Every write goes to a temporary file in the same directory, is flushed and
``fsync``-ed, then renamed over the target (``os.replace`` is atomic), and the
directory is synced: a crash leaves either the old file or the new one,
never half of one. Each directory keeps ``manifest.json`` (written the same
way) listing the files ftrain wrote there with their size and SHA-256, so a
truncated or corrupt file is detected before use and the newest *good*
checkpoint is chosen on resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import torch

from ftrain.errors import CheckpointError

__all__ = [
    "save_atomic",
    "stage_atomic",
    "commit_atomic",
    "snapshot",
    "write_snapshot",
    "BackgroundWriter",
    "background_writer",
    "wait_for_writes",
    "write_bytes_atomic",
    "load_checkpoint",
    "load_weights",
    "Manifest",
    "find_resumable",
    "MANIFEST",
]

MANIFEST = "manifest.json"


class _HashingWriter:
    """A file wrapper that hashes and counts what ``torch.save`` writes."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets you open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_main() -> bool:
    """Rank 0, or not distributed: the process that writes the manifest."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def save_atomic(obj: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``torch.save(obj, path)`` atomically; returns ``{"size", "sha256"}``.

    Example:
        >>> import tempfile, os, torch
        >>> d = tempfile.mkdtemp()
        >>> info = save_atomic({"x": torch.ones(2)}, os.path.join(d, "a.pth"))
        >>> info["size"] > 0
        True
    """
    tmp, info = stage_atomic(obj, path)
    commit_atomic(tmp, path)
    return info


def stage_atomic(obj: Any, path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """First half of :func:`save_atomic`: serialise ``obj`` to a temporary file beside ``path``.

    Returns the temporary path and ``{"size", "sha256"}``. Nothing is visible
    under ``path`` until :func:`commit_atomic`; a temporary left by a crash
    is removed by :func:`clean_temporaries` when a run starts.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp, {"size": writer.size, "sha256": writer.sha.hexdigest()}


def commit_atomic(tmp: Path, path: str | os.PathLike, *, sync_dir: bool = True) -> None:
    """Second half of :func:`save_atomic`: fsync ``tmp``, rename it to ``path``, sync the directory.

    ``sync_dir=False`` leaves the directory sync to the caller's next write
    in the same directory (the manifest's), saving one ``fsync``.
    """
    path = Path(path)
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        _fsync_dir(path.parent)


#: Checkpoints whose tensors total less than this are serialised in memory.
SNAPSHOT_LIMIT = 64 << 20


def _tensor_bytes(obj: Any, limit: int) -> int:
    """Bytes of the tensors in a nested dict/list (stops counting past ``limit``)."""
    total = 0
    stack = [obj]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, torch.Tensor):  # torch.save writes whole storages (views too)
            try:
                total += x.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass)
                total += x.numel() * x.element_size()
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def snapshot(obj: Any, limit: int = SNAPSHOT_LIMIT) -> bytes | None:
    """``torch.save(obj)`` into memory when its tensors are small, else ``None``.

    The bytes are a consistent snapshot that a background thread can write
    while training changes the tensors: serialising into memory takes about
    half as long as into a file, and nothing touches the disk on the
    training thread. Large checkpoints (over ``limit`` bytes of tensors) are
    written to their file directly instead, not copied in memory.

    Example:
        >>> import torch
        >>> len(snapshot({"w": torch.zeros(4)})) > 0, snapshot({"w": torch.zeros(4)}, limit=8)
        (True, None)
    """
    if _tensor_bytes(obj, limit) > limit:
        return None
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_snapshot(data: bytes, path: str | os.PathLike) -> dict[str, Any]:
    """Write :func:`snapshot` bytes to ``path`` atomically, leaving the directory sync to
    the caller (see :func:`commit_atomic`); returns ``{"size", "sha256"}``."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class BackgroundWriter:
    """Finishes checkpoint writes of one directory on one background thread, in order.

    The training thread serialises a checkpoint (a consistent snapshot) and
    hands the slow part, ``fsync``, rename, manifest update and pruning, to
    this writer, so training goes on while the disk catches up. Jobs run one
    at a time in submission order, so the manifest is never updated twice at
    once. Anything that reads or changes the directory synchronously calls
    :meth:`wait` first. A failed job is raised (as :class:`CheckpointError`)
    by the next :meth:`submit` or :meth:`wait`: a failure is never silent.

    Example:
        >>> import tempfile
        >>> w = background_writer(tempfile.mkdtemp())
        >>> w.submit(lambda: None)
        >>> w.wait()
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pool: Any = None
        self._pending: list[Any] = []

    def submit(self, job: Any) -> None:
        """Run ``job()`` after every job submitted before it."""
        self._raise_failed(done_only=True)
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ftrain-checkpoint")
        self._pending.append(self._pool.submit(job))

    def wait(self) -> None:
        """Block until every submitted job has finished; raise the first failure."""
        self._raise_failed(done_only=False)

    def _raise_failed(self, *, done_only: bool) -> None:
        keep, error = [], None
        for future in self._pending:
            if done_only and not future.done():
                keep.append(future)
                continue
            exc = future.exception()  # waits for it when not done_only
            if exc is not None and error is None:
                error = exc
        self._pending = keep
        if error is not None:
            raise CheckpointError(
                f"A background checkpoint write in {self.directory} failed: {error!r}. The "
                "checkpoints written before it are intact; fix the cause (disk full? "
                "permissions?) and resume from the newest one."
            ) from error


_WRITERS: dict[str, BackgroundWriter] = {}


def background_writer(directory: str | os.PathLike) -> BackgroundWriter:
    """The :class:`BackgroundWriter` of ``directory`` (one per directory per process)."""
    key = os.path.realpath(directory)
    writer = _WRITERS.get(key)
    if writer is None:
        writer = _WRITERS[key] = BackgroundWriter(Path(directory))
    return writer


def wait_for_writes(directory: str | os.PathLike | None = None) -> None:
    """Wait for the background checkpoint writes of ``directory`` (or of every directory).

    Example:
        >>> wait_for_writes()
    """
    if directory is None:
        for writer in list(_WRITERS.values()):
            writer.wait()
        return
    writer = _WRITERS.get(os.path.realpath(directory))
    if writer is not None:
        writer.wait()


def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def load_checkpoint(
    path: str | os.PathLike,
    *,
    map_location: Any = "cpu",
    expected: Mapping[str, Any] | None = None,
) -> Any:
    """Load a checkpoint, checking it against its manifest entry when there is one.

    Raises :class:`~ftrain.errors.CheckpointError` naming the file, what is
    wrong, and the fix (an earlier checkpoint, or ``resume="auto"``, which
    skips bad files).

    Example:
        >>> import tempfile, os, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "a.pth")
        >>> _ = save_atomic({"x": 1}, p)
        >>> load_checkpoint(p)["x"]
        1
    """
    path = Path(path)
    if path.is_dir():
        return _load_sharded_meta(path, map_location, expected)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    if expected is None:
        expected = Manifest(path.parent).entry(path.name)
    if expected is not None:
        size = path.stat().st_size
        if size != expected.get("size", size):
            raise CheckpointError(
                f"Checkpoint {path} is truncated or was overwritten: {size} bytes on disk, "
                f"{expected['size']} written. Resume from an earlier checkpoint "
                "(resume='auto' picks the newest good one)."
            )
        if "sha256" in expected and _sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"Checkpoint {path} is corrupt (SHA-256 differs from the one recorded when it "
                "was written). Resume from an earlier checkpoint (resume='auto' picks the "
                "newest good one)."
            )
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"Checkpoint {path} cannot be read ({type(exc).__name__}: {exc}). The file is "
            "truncated or corrupt; resume from an earlier checkpoint (resume='auto' picks the "
            "newest good one)."
        ) from exc


def _load_sharded_meta(path: Path, map_location: Any, expected: Mapping[str, Any] | None) -> Any:
    """The ``ftrain.pth`` of a sharded (``torch.distributed.checkpoint``) directory.

    The returned dict names the directory in ``"sharded_dir"``: the loop
    loads the model and optimizer shards from it (:func:`ftrain.dist.load_sharded`).
    """
    meta = path / "ftrain.pth"
    if not (path / ".metadata").is_file() or not meta.is_file():
        raise CheckpointError(
            f"Checkpoint directory {path} is incomplete (no .metadata or ftrain.pth): the run "
            "was probably killed while writing it. Resume from an earlier checkpoint "
            "(resume='auto' picks the newest good one)."
        )
    if expected is None:
        expected = Manifest(path.parent).entry(path.name)
    saved = load_checkpoint(meta, map_location=map_location, expected=(expected or {}).get("meta"))
    if isinstance(saved, dict):
        saved["sharded_dir"] = str(path)
    return saved


def load_weights(
    model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = False, prefix: str = ""
) -> tuple[list[str], list[str]]:
    """Load only model weights (fine-tuning), from an ftrain checkpoint or a state dict.

    A sharded (FSDP2, ``.dcp``) checkpoint directory works too, in one
    process or many (see :func:`ftrain.dist.load_sharded_weights`).

    Returns ``(missing_keys, unexpected_keys)``; ``strict=True`` raises on any.
    ``prefix`` strips a leading key prefix (e.g. ``"module."`` from DDP).

    Example:
        >>> import tempfile, os, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "w.pth")
        >>> _ = save_atomic(torch.nn.Linear(2, 1).state_dict(), p)
        >>> load_weights(torch.nn.Linear(2, 1), p)
        ([], [])
    """
    saved = load_checkpoint(path)
    if isinstance(saved, Mapping) and saved.get("sharded_dir"):  # FSDP2: the DCP shards
        from ftrain.dist import load_sharded_weights

        return load_sharded_weights(model, saved["sharded_dir"], strict=strict)
    if isinstance(saved, Mapping) and "state" in saved and "model" in saved["state"]:
        weights = saved["state"]["model"]
    elif isinstance(saved, Mapping) and "model" in saved and isinstance(saved["model"], Mapping):
        weights = saved["model"]
    elif isinstance(saved, Mapping) and "state_dict" in saved:
        weights = saved["state_dict"]
    else:
        weights = saved
    if prefix:
        weights = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()}
    result = model.load_state_dict(weights, strict=strict)
    return list(result.missing_keys), list(result.unexpected_keys)


class Manifest:
    """The list of checkpoint files ftrain wrote in one directory.

    Entries are dicts with ``name``, ``kind`` (``"periodic"``, ``"best"``,
    ``"last"``...), ``step``, ``epoch``, ``size`` and ``sha256``, oldest first.
    Files not in the manifest are never deleted by ftrain.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / MANIFEST
        self.entries: list[dict[str, Any]] = []
        if self.path.is_file():
            try:
                data = orjson.loads(self.path.read_bytes())
                self.entries = list(data.get("files", []))
            except orjson.JSONDecodeError:
                warnings.warn(
                    f"{self.path} is unreadable; rebuilding the checkpoint list from the files "
                    "in the directory.",
                    stacklevel=2,
                )
                self.entries = self._scan()

    def _scan(self) -> list[dict[str, Any]]:
        out = []
        found = [*self.directory.glob("*.pth"), *self.directory.glob("*.dcp")]
        for p in sorted(found, key=lambda p: p.stat().st_mtime):
            m = re.search(r"(iter|epoch)_(\d+)", p.name)
            out.append({"name": p.name, "kind": "unknown", "step": int(m.group(2)) if m else -1})
        return out

    def entry(self, name: str) -> dict[str, Any] | None:
        for e in reversed(self.entries):
            if e["name"] == name:
                return e
        return None

    def add(self, entry: dict[str, Any]) -> None:
        """Record a file just written (replacing an entry of the same name).

        Each entry gets ``seq``, one more than any before it in this
        directory: the order files were written in, whatever their step.
        """
        self.update(entry)

    def remove(self, *names: str) -> None:
        """Forget ``names`` and delete their files (or sharded directories).

        The manifest is written first, so a crash in between leaves a file
        the manifest no longer names, never a name without its file. Under
        ``torch.distributed`` only rank 0 changes the directory.
        """
        self.update(None, names)

    def update(
        self,
        entry: dict[str, Any] | None = None,
        remove: Any = (),
        prune: Any = None,
    ) -> None:
        """:meth:`add` ``entry`` and :meth:`remove` ``remove`` in one manifest write.

        ``prune(manifest)``, called after ``entry`` is added, may name more
        files to remove (``max_keep``).
        """
        if entry is not None:
            seq = max((e.get("seq", -1) for e in self.entries), default=-1) + 1
            self.entries = [e for e in self.entries if e["name"] != entry["name"]]
            self.entries.append({**entry, "seq": seq})
        names = [*remove, *(prune(self) if prune is not None else ())]
        gone = set(names)
        self.entries = [e for e in self.entries if e["name"] not in gone]
        self.write()
        if not names or not _is_main():
            return
        for name in names:
            target = self.directory / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()

    def write(self) -> None:
        """Write the manifest atomically (rank 0 only under ``torch.distributed``)."""
        if not _is_main():
            return
        data = orjson.dumps({"files": self.entries}, option=orjson.OPT_INDENT_2)
        write_bytes_atomic(data, self.path)

    def resumable(self) -> list[dict[str, Any]]:
        """Entries that hold a full training state, the newest written first.

        "Newest" is the order of writing (``seq``), not the step: after a
        resume from an older checkpoint, or a fresh run in a used directory,
        the run that wrote last is the one ``resume="auto"`` continues.
        """
        full = [e for e in self.entries if e.get("resumable", True)]
        return sorted(
            full,
            key=lambda e: (e.get("seq", -1), e.get("time", 0), e.get("micro_step", -1)),
            reverse=True,
        )


def find_resumable(directory: str | os.PathLike) -> tuple[Path, Any] | None:
    """The newest checkpoint in ``directory`` that loads, and its contents.

    Bad files (truncated, corrupt) are skipped with a warning, so a crash
    during a write never prevents a resume.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    manifest = Manifest(directory)
    for entry in manifest.resumable():
        path = directory / entry["name"]
        try:
            return path, load_checkpoint(path, expected=entry)
        except CheckpointError as exc:
            warnings.warn(f"Skipping checkpoint: {exc}", stacklevel=2)
    return None


def clean_temporaries(directory: str | os.PathLike) -> None:
    """Delete temporary files (and sharded directories) left by interrupted writes.

    Under ``torch.distributed`` only rank 0 deletes.
    """
    directory = Path(directory)
    if directory.is_dir() and _is_main():
        for p in directory.glob(".*.tmp-*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                continue
            with contextlib.suppress(OSError):
                p.unlink()
