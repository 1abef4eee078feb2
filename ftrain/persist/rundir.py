"""One run directory: every file the checkpointer, the manifest, the lock and resume touch.

Names are relative to the directory (``iter_4.pth``, ``manifest.json``, a sharded
``iter_4.dcp``). Everything else in :mod:`ftrain.persist` reads and writes through a
:class:`RunDir`, so the storage a run directory lives on is decided here alone: the local
disk (:mod:`ftrain.persist.files` does the atomic writes and checks), or, for a URL
(``s3://``, ``gs://``, ``memory://``: a :class:`~ftrain.persist.location.StoreURL`), an
object store (:class:`ftrain.persist.store.StoreDir`, chosen by ``RunDir(url)`` itself).

What a storage backend must provide, and how the run-directory rules map onto a store
with atomic puts and no rename of directories (an object store):

- **Atomic whole-object writes**: :meth:`RunDir.save`, :meth:`~RunDir.write_bytes` and a
  :meth:`~RunDir.stage` + :meth:`~RunDir.commit` pair make a name appear complete or not at
  all (here: a temporary file, ``fsync``, rename; on a store: one put, multipart uploads
  completed last). Nothing else needs a rename.
- **Listing, reading, deleting by name**: :meth:`~RunDir.checkpoint_names` (visible names
  only: a store lists a prefix and skips the hidden ``.name.tmp-*`` ones),
  :meth:`~RunDir.read_bytes`, :meth:`~RunDir.peek` (a ranged read of a checkpoint's small
  ``data.pkl``), :meth:`~RunDir.verify`, :meth:`~RunDir.delete`. No decision reads a
  file's modification time: checkpoints are ordered by the steps and generations they record.
- **The manifest is the commit**: a checkpoint exists once ``manifest.json`` names it. Its
  files are written first, the manifest put next, dropped files deleted last; each write
  increments the manifest's ``generation``, which every checkpoint also records in its own
  ``meta`` (with its run, step and the directory's id). A file of a higher generation than
  the manifest is newer than it (taken in: :meth:`Manifest.reconcile
  <ftrain.persist.manifest.Manifest.reconcile>`); an unlisted file of the run, of a
  generation the manifest has seen, is an orphan (deleted: :meth:`Manifest.collect
  <ftrain.persist.manifest.Manifest.collect>`). On a store the manifest put should be
  conditional on the generation read (compare-and-swap: ``If-Match``), so a writer that
  lost the lock fails instead of writing over a newer manifest.
- **Sharded checkpoints without a directory rename**: :meth:`~RunDir.stage_dir` /
  :meth:`~RunDir.commit_dir` put a ``.dcp`` directory in place by renaming it. A store
  writes the shards under a prefix no manifest lists, ``ftrain.pth`` (with the ``meta``)
  last, and commits by the manifest put; it must not write over a listed prefix in place
  (use a fresh prefix, and delete the old one after the manifest drops it).
- **An exclusive lock**: :meth:`~RunDir.lock` keeps a second run out, naming the holder,
  and is released when its process dies (here ``fcntl.flock``). A store needs a
  create-if-absent put of ``.ftrain.lock`` (``If-None-Match: *``) holding the holder and an
  expiry that the holder renews, deleted on release; a lock past its expiry is taken over
  by a conditional put on its version.
- **A writability probe**: :meth:`~RunDir.check_writable` (put and delete a small object).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrain.errors import CheckpointError
from ftrain.persist import files
from ftrain.persist.location import StoreURL, as_location, is_url, location_key
from ftrain.persist.lock import RunLock

__all__ = ["RunDir", "RANK_MARK"]

#: Per-rank files of a checkpoint ``name``: ``name.rank{r}`` (distributed runs).
RANK_MARK = ".rank"


def _glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


class RunDir:
    """A directory checkpoints are written to and read from.

    Example:
        >>> import tempfile
        >>> d = RunDir(tempfile.mkdtemp())
        >>> info = d.save({"x": 1}, "a.pth")
        >>> d.load("a.pth", expected=info)["x"], d.checkpoint_names()
        (1, ['a.pth'])
    """

    #: Whether a sharded checkpoint's directory is put in place whole (a rename); a store
    #: writes it under its prefix, so a listed one is dropped from the manifest first.
    atomic_dirs = True

    def __new__(cls, path: str | os.PathLike | StoreURL) -> RunDir:
        """A URL's directory is an object store's (:class:`ftrain.persist.store.StoreDir`)."""
        if cls is RunDir and is_url(path) and isinstance(as_location(path), StoreURL):
            from ftrain.persist.store import StoreDir

            return super().__new__(StoreDir)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike | StoreURL) -> None:
        self.path = Path(as_location(path))  # (file:// URLs are local paths)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def key(self) -> str:
        """One string per directory, whatever the spelling of its path (a URL: itself)."""
        return location_key(self.path)

    def local(self, name: str) -> Path:
        """The path of ``name`` for a library that writes it itself (DCP), and for messages."""
        return self.path / name

    # ------------------------------------------------------------ reading
    def exists(self, name: str | None = None) -> bool:
        """Whether the directory (or ``name`` in it) exists."""
        return (self.path if name is None else self.path / name).exists()

    def is_dir(self, name: str | None = None) -> bool:
        """Whether the directory (or ``name``: a sharded checkpoint) is a directory."""
        return (self.path if name is None else self.path / name).is_dir()

    def read_bytes(self, name: str) -> bytes | None:
        """The bytes of ``name``, or ``None`` when it does not exist."""
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None

    def checkpoint_names(self) -> list[str]:
        """The names of the checkpoint files and sharded directories here (not hidden ones)."""
        if not self.path.is_dir():
            return []
        found = [*self.path.glob("*.pth"), *self.path.glob("*.dcp")]
        return sorted(p.name for p in found if not p.name.startswith("."))

    def size(self, name: str) -> int:
        """Bytes of ``name`` (a sharded directory: all its files)."""
        p = self.path / name
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        return p.stat().st_size

    def sha256(self, name: str) -> str:
        return files.sha256_of(self.path / name)

    def verify(self, name: str, expected: Mapping[str, Any] | None) -> None:
        """Check ``name`` against its recorded size and SHA-256 (or its CRC-32s)."""
        files.verify_file(self.path / name, expected)

    def peek(self, name: str) -> Any:
        """``name``'s object with every tensor ``None`` (cheap)."""
        return files.peek(self.path / name)

    def load(
        self, name: str, *, expected: Mapping[str, Any] | None = None, map_location: Any = "cpu"
    ) -> Any:
        """Verify, then load ``name``; any failure is a :class:`CheckpointError` naming it."""
        return files.load_file(self.path / name, map_location=map_location, expected=expected)

    # ------------------------------------------------------------ writing
    def make(self) -> None:
        """Create the directory (and its parents)."""
        self.path.mkdir(parents=True, exist_ok=True)

    def check_writable(self) -> None:
        """Raise a :class:`CheckpointError` now (before step 1) if nothing can be written here."""
        directory = self.path
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

    def save(self, obj: Any, name: str) -> dict[str, Any]:
        """``torch.save(obj)`` as ``name`` atomically; returns ``{"size", "sha256"}``."""
        return files.save_atomic(obj, self.path / name)

    def stage(self, obj: Any, name: str) -> tuple[Path, dict[str, Any]]:
        """Write ``obj`` beside ``name`` (not visible yet); returns the staged file and its info."""
        return files.stage_atomic(obj, self.path / name)

    def commit(self, staged: Path, name: str) -> None:
        """Make a :meth:`stage` d file ``name`` (the next :meth:`write_bytes` syncs the directory)."""
        files.commit_atomic(staged, self.path / name, sync_dir=False)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` atomically (the directory synced)."""
        files.write_bytes_atomic(data, self.path / name)

    def stage_dir(self, name: str) -> Path:
        """An empty hidden directory to write the sharded checkpoint ``name`` into."""
        tmp = files.tmp_path(self.path / name)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit_dir(self, staged: Path, name: str) -> None:
        """Put a :meth:`stage_dir` directory in place as ``name`` (replacing an old one)."""
        final = self.path / name
        old = None
        if final.exists():
            old = self.path / f".{name}{files.TMP_MARK}old-{os.getpid()}"
            os.replace(final, old)
        os.replace(staged, final)
        files.fsync_dir(self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name`` (a file or a sharded directory) and its per-rank files
        (those first: a kill in between leaves ``name``, which says whose files they are)."""
        for target in [*self.path.glob(f"{_glob_escape(name)}{RANK_MARK}*"), self.path / name]:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()

    def clean_temporaries(self) -> None:
        """Delete temporary files and directories left by interrupted writes."""
        files.clean_temporaries(self.path)

    def lock(self, holder: str | None = None) -> RunLock:
        """The lock that keeps a second run out of this directory (not taken yet); ``holder``
        describes this run to one it refuses."""
        return RunLock(self.path, holder)

    def write_error(self, exc: BaseException, name: str, good: list[str]) -> CheckpointError:
        """One :class:`CheckpointError` for a failed write of ``name`` (free space, good files)."""
        return files.write_error(exc, self.path, name, good)
