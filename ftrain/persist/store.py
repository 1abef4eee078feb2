"""A run directory on an object store (S3, GCS, memory...) through fsspec: :class:`StoreDir`.

``RunDir("s3://bucket/run")`` is one (:class:`~ftrain.persist.rundir.RunDir` chooses it for a
URL); it keeps every rule of a local run directory with the means a store has:

- **Uploads are atomic**: a checkpoint is written to the local staging area first
  (:class:`Staging`: ``torch.save``, its size and SHA-256 taken on the way), then uploaded as
  one object (one put, or a multipart upload the store shows only once completed). A kill
  during an upload leaves nothing visible (an S3 multipart upload it cut short is aborted by
  the next run's :meth:`StoreDir.clean_temporaries`).
- **The manifest is the commit**, written last; its put is conditional on the version this
  process read (S3: ``If-Match`` on its ETag, ``If-None-Match: *`` when there was none): a
  writer that lost the directory to another run fails instead of writing over a newer
  manifest. Stores without conditional puts (``memory://``, and fsspec filesystems other than
  s3fs) get the read-verify-after-write fallback: the manifest is read again just before
  the put and must be the one this process read, and read back after it (a race narrower
  than a round trip remains; the lock is what keeps writers apart).
- **Verified loads**: a checkpoint is downloaded to the staging area, its size and SHA-256
  checked against the manifest (or its CRC-32s), then loaded.
- **Sharded checkpoints** (FSDP2) are written by ``torch.distributed.checkpoint``'s
  ``FsspecWriter`` straight under their prefix (``iter_4.dcp/``), which no manifest lists
  until the manifest put; DCP writes ``.metadata`` last, and a prefix without it is never
  taken for a checkpoint.
- **The lock** is a lease: :class:`ftrain.persist.lease.StoreLock`.

The bound on local disk: one save in flight per run directory (a save first waits for the
previous upload), and each staged file is deleted once uploaded, so the staging area holds
at most one checkpoint per directory (its file, and under DDP this rank's own file) plus the
run's log files (:mod:`ftrain.persist.mirror`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrain.errors import CheckpointError
from ftrain.persist import files
from ftrain.persist.location import StoreURL, as_location
from ftrain.persist.rundir import RANK_MARK, RunDir

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ftrain.persist.lease import StoreLock

__all__ = ["StoreDir", "Staging", "STAGING", "open_store", "fs_options", "require", "fetch",
           "publish", "PART_SIZE", "StoreConflict"]  # fmt: skip

#: Size of the parts of an S3 multipart upload (a file of two parts or more is uploaded in
#: parts; the object appears when the upload completes).
PART_SIZE = 50 * 2**20
_CHUNK = 4 * 2**20
#: ``scheme: (module, ftrain extra)`` of the fsspec filesystems ftrain names an extra for.
_EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"),
           "gcs": ("gcsfs", "gcs")}  # fmt: skip
_S3 = ("s3", "s3a")
_UNSEEN = object()


class StoreConflict(CheckpointError):
    """A conditional put failed: the object changed since this process read it."""


def require(url: StoreURL) -> None:
    """Import the filesystem package of ``url``'s scheme, or raise an ``ImportError`` naming
    the extra that brings it (``pip install 'ftrain[s3]'``).

    Example:
        >>> require(StoreURL("memory://doc"))  # fsspec's own: nothing to install
    """
    module, extra = _EXTRAS.get(url.protocol, (None, None))
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{url} is on {url.protocol}://, which needs the {module} package: "
            f"pip install 'ftrain[{extra}]' (or pip install {module})."
        ) from exc


def fs_options(url: StoreURL) -> dict[str, Any]:
    """The options ftrain opens ``url``'s filesystem with: its ``storage_options``, and no
    cached listings (every decision reads the store), unless they say otherwise.

    Example:
        >>> fs_options(StoreURL("s3://b/run", storage_options={"anon": True}))
        {'use_listings_cache': False, 'anon': True}
    """
    return {"use_listings_cache": False, **url.storage_options}


def open_store(url: StoreURL) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` (:func:`fs_options`) and the path in it.

    Example:
        >>> fs, root = open_store(StoreURL("memory://doc/run"))
        >>> root, type(fs).__name__
        ('/doc/run', 'MemoryFileSystem')
    """
    require(url)
    import fsspec

    try:
        fs, root = fsspec.url_to_fs(url.url, **fs_options(url))
    except ImportError as exc:
        raise ImportError(
            f"{url}: fsspec has no filesystem for {url.protocol}:// here ({exc}). Install the "
            "package that provides it."
        ) from exc
    return fs, root.rstrip("/") or root


class Staging:
    """The local staging area: checkpoints written before their upload, downloaded before
    they are loaded. Counts the bytes it holds (``live``) and their most (``peak``).

    Example:
        >>> s = Staging()
        >>> p = s.new(StoreURL("memory://doc"), "a.pth"); _ = p.write_bytes(b"12"); s.add(p)
        >>> s.live, s.peak, s.remove(p), s.live
        (2, 2, None, 0)
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[Path, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def base(url: StoreURL) -> Path:
        """The staging directory of ``url``: its ``staging_dir``, ``$FTRAIN_STAGING_DIR`` or
        the system's temporary directory, then ``ftrain-staging``."""
        root = url.staging_dir or os.environ.get("FTRAIN_STAGING_DIR") or tempfile.gettempdir()
        out = Path(root) / "ftrain-staging"
        out.mkdir(parents=True, exist_ok=True)
        return out

    def new(self, url: StoreURL, name: str) -> Path:
        """A fresh local path for ``name`` (a checkpoint of ``url``)."""
        return self.base(url) / f"{uuid.uuid4().hex[:12]}-{os.getpid()}-{name}"

    def add(self, path: Path) -> None:
        """Count ``path`` (written) in the area."""
        size = path.stat().st_size
        with self._lock:
            self._sizes[path] = size
            self.live += size
            self.peak = max(self.peak, self.live)

    def remove(self, path: Path) -> None:
        """Delete ``path`` (uploaded or loaded) and stop counting it."""
        with contextlib.suppress(OSError):
            path.unlink()
        with self._lock:
            self.live -= self._sizes.pop(path, 0)


#: This process's staging area (its counters: what the bound is checked against).
STAGING = Staging()


def _precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a store's answer that a conditional put's condition did not hold."""
    if isinstance(exc, FileExistsError):
        return True
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        if "PreconditionFailed" in str(exc) or "pre-conditions" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


class StoreDir(RunDir):
    """A run directory on an object store (see the module's docstring for its rules).

    Example:
        >>> d = RunDir("memory://doc/run")
        >>> info = d.save({"x": 1}, "a.pth")
        >>> d.load("a.pth", expected=info)["x"], d.checkpoint_names(), type(d).__name__
        (1, ['a.pth'], 'StoreDir')
    """

    atomic_dirs = False

    def __init__(self, path: str | os.PathLike | StoreURL) -> None:
        where = as_location(path)
        if not isinstance(where, StoreURL):
            raise TypeError(f"StoreDir: {path!r} is not a URL on an object store.")
        self.path = where
        self.fs, self.root = open_store(where)
        self.s3 = where.protocol in _S3
        #: Per name read or written here: ``(etag, bytes)``, or ``None`` when it was absent:
        #: what a conditional put of it is conditional on.
        self._seen: dict[str, tuple[str | None, bytes] | None] = {}

    def __repr__(self) -> str:
        return f"RunDir({self.path.url!r})"

    @property
    def key(self) -> str:
        """The directory's URL."""
        return self.path.url

    def local(self, name: str) -> StoreURL:  # type: ignore[override]
        """The URL of ``name`` (for DCP's ``FsspecWriter`` and for messages)."""
        return self.path / name

    def _at(self, name: str | None = None) -> str:
        return self.root if name is None else f"{self.root}/{name}"

    # ------------------------------------------------------------ reading
    def exists(self, name: str | None = None) -> bool:
        return self.fs.exists(self._at(name))

    def is_dir(self, name: str | None = None) -> bool:
        return self.fs.isdir(self._at(name))

    def read_bytes(self, name: str) -> bytes | None:
        """The bytes of ``name`` (``None``: absent), remembered for a conditional put of it."""
        path = self._at(name)
        try:
            etag = self.fs.info(path).get("ETag") if self.s3 else None  # before the read
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            self._seen[name] = None
            return None
        self._seen[name] = (etag, data)
        return data

    def _names(self) -> list[str]:
        """The names directly under the directory (a prefix counts once)."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def checkpoint_names(self) -> list[str]:
        return sorted(n for n in self._names()
                      if n.endswith((".pth", ".dcp")) and not n.startswith("."))  # fmt: skip

    def size(self, name: str) -> int:
        path = self._at(name)
        return int(self.fs.du(path)) if self.fs.isdir(path) else int(self.fs.size(path))

    def sha256(self, name: str) -> str:
        sha = hashlib.sha256()
        with self.fs.open(self._at(name), "rb", block_size=_CHUNK) as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                sha.update(chunk)
        return sha.hexdigest()

    def verify(self, name: str, expected: Mapping[str, Any] | None) -> None:
        """Check ``name`` against its recorded size and SHA-256 (or its CRC-32s), read from
        the store; a :class:`CheckpointError` naming its URL if it does not match."""
        files.verify_with(
            lambda: self.size(name), lambda: self.sha256(name),
            lambda: self.fs.open(self._at(name), "rb"), expected, self.local(name),
        )  # fmt: skip

    def peek(self, name: str) -> Any:
        """``name``'s object with every tensor ``None`` (ranged reads of its ``data.pkl``)."""
        with self.fs.open(self._at(name), "rb") as f:
            return files.peek(f)

    def load(
        self, name: str, *, expected: Mapping[str, Any] | None = None, map_location: Any = "cpu"
    ) -> Any:
        """Download ``name`` to the staging area, verify it there, load it."""
        local = self.download(name)
        try:
            return files.load_file(
                local, map_location=map_location, expected=expected, label=str(self.local(name))
            )
        finally:
            STAGING.remove(local)

    def download(self, name: str, target: Path | None = None) -> Path:
        """``name``, copied to ``target`` (default: a new file in the staging area)."""
        local = STAGING.new(self.path, name.replace("/", "-")) if target is None else target
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get_file(self._at(name), str(local))
        except FileNotFoundError:
            raise CheckpointError(f"Checkpoint {self.local(name)} does not exist.") from None
        except OSError as exc:
            raise CheckpointError(
                f"Cannot download {self.local(name)} ({type(exc).__name__}: {exc}). Check the "
                "store and its credentials (storage_options=)."
            ) from exc
        if target is None:
            STAGING.add(local)
        return local

    # ------------------------------------------------------------ writing
    def make(self) -> None:
        """Nothing to create: a store has no directories (the bucket must exist)."""

    def check_writable(self) -> None:
        """Put and delete a small object now (before step 1); a clear error if it fails."""
        probe = self._at(f".ftrain-probe{files.TMP_MARK}{os.getpid()}")
        try:
            self.fs.pipe_file(probe, b"ftrain")
            self.fs.rm_file(probe)
        except Exception as exc:  # noqa: BLE001 - any failure: nothing can be written there
            raise CheckpointError(
                f"Cannot write checkpoints to {self.path} ({type(exc).__name__}: {exc}). Check "
                "that the bucket exists and that the credentials (storage_options=, or the "
                "environment) may write there, or pass another work_dir (or out_dir)."
            ) from exc

    def save(self, obj: Any, name: str) -> dict[str, Any]:
        staged, info = self.stage(obj, name)
        self.commit(staged, name)
        return info

    def stage(self, obj: Any, name: str) -> tuple[Path, dict[str, Any]]:
        """``torch.save(obj)`` into the staging area; returns the file and its info."""
        staged, info = files.stage_atomic(obj, STAGING.new(self.path, name))
        STAGING.add(staged)
        return staged, info

    def commit(self, staged: Path, name: str) -> None:
        """Upload a :meth:`stage` d file as ``name`` (one object), then delete it locally."""
        try:
            self.upload(staged, name)
        finally:
            STAGING.remove(staged)

    def upload(self, local: Path, name: str) -> None:
        """Copy the local file ``local`` to ``name``: whole, or (S3, from two parts on) by a
        multipart upload the store shows once complete."""
        extra = {"chunksize": PART_SIZE} if self.s3 else {}
        self.fs.put_file(str(local), self._at(name), **extra)
        self._seen.pop(name, None)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Put ``name``; conditional on the version read here if it was read (the manifest):
        a :class:`StoreConflict` if another process changed it since."""
        if self._seen.get(name, _UNSEEN) is _UNSEEN:
            self.fs.pipe_file(self._at(name), data)
            return
        if not self.put_if(name, data):
            raise StoreConflict(
                f"{self.local(name)} changed since this run read it: another process writes "
                f"{self.path} (it took the directory over after this run's lock lapsed, or "
                "ignores the lock). Nothing was overwritten; this run stops writing there. "
                "Check which runs use the directory, then resume with resume='auto'."
            )

    def put_if(self, name: str, data: bytes) -> bool:
        """Put ``name`` only if it is as this process last read or wrote it (absent if it was);
        ``False`` (nothing written) if not. S3: a conditional put; elsewhere: read, compare,
        put, read back."""
        seen = self._seen.get(name)
        path = self._at(name)
        if self.s3:
            condition = {"IfNoneMatch": "*"} if seen is None else {"IfMatch": seen[0]}
            try:
                out = self.fs.pipe_file(path, data, **condition)
            except OSError as exc:
                if _precondition_failed(exc):
                    return False
                raise
            self._seen[name] = ((out or {}).get("ETag"), data)
            return True
        now = self._current(path)
        if now != (None if seen is None else seen[1]):
            return False
        self.fs.pipe_file(path, data)
        if self._current(path) != data:
            return False
        self._seen[name] = (None, data)
        return True

    def _current(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def stage_dir(self, name: str) -> StoreURL:  # type: ignore[override]
        """Where a sharded checkpoint ``name`` is written: its own prefix (not listed by the
        manifest until it is committed), emptied of any torn earlier upload first."""
        self._remove(name)
        return self.local(name)

    def commit_dir(self, staged: Any, name: str) -> None:
        """Nothing to move: the shards are in place, the manifest put commits them."""
        if staged != self.local(name):
            raise CheckpointError(f"{staged} is not where {self.local(name)} is written.")

    def _remove(self, name: str) -> None:
        path = self._at(name)
        with contextlib.suppress(FileNotFoundError):
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            elif self.fs.exists(path):
                self.fs.rm_file(path)

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name`` and its per-rank files (those first)."""
        for other in self._names():
            if other.startswith(f"{name}{RANK_MARK}"):
                self._remove(other)
        self._remove(name)

    def clean_temporaries(self) -> None:
        """Delete leftover probes, and (S3) abort the multipart uploads a kill cut short."""
        for name in self._names():
            if name.startswith(".") and files.TMP_MARK in name:
                self._remove(name)
        if self.s3:
            self._abort_uploads()

    def _abort_uploads(self) -> None:
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = f"{key}/" if key else ""
        for upload in self.fs.list_multipart_uploads(bucket):
            if upload["Key"].startswith(prefix):
                with contextlib.suppress(OSError):
                    self.fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])

    def lock(self, holder: str | None = None) -> StoreLock:  # type: ignore[override]
        """The lease that keeps a second run out of this directory (not taken yet)."""
        from ftrain.persist.lease import StoreLock

        return StoreLock(self, holder)

    def write_error(self, exc: BaseException, name: str, good: list[str]) -> CheckpointError:
        """One :class:`CheckpointError` for a failed upload of ``name``."""
        if isinstance(exc, CheckpointError):
            return exc
        kept = ", ".join(good[-5:]) if good else "none"
        where = f"the store ({type(exc).__name__}: {exc})"
        if files.is_disk_full(exc):
            staging = Staging.base(self.path)
            where = (
                f"the local staging area {staging}: its disk is full ({files.free_space(staging)})"
            )
        return CheckpointError(
            f"Cannot write checkpoint {self.local(name)}: {where}. The good checkpoints in "
            f"{self.path} are intact: {kept}. Fix the cause, then resume with resume='auto'."
        )

    # ------------------------------------------------------------ the run's other files
    def other_files(self) -> list[str]:
        """Every file here that is not a checkpoint, the manifest, the lock or hidden (the
        run's logs), relative to the directory."""
        from ftrain.persist.manifest import MANIFEST

        out = []
        for path in self.fs.find(self.root):
            rel = path[len(self.root) :].lstrip("/")
            top = rel.split("/", 1)[0]
            if top.startswith(".") or top == MANIFEST or top.endswith((".pth", ".dcp")):
                continue
            if f".pth{RANK_MARK}" not in top:
                out.append(rel)
        return sorted(out)


@contextlib.contextmanager
def fetch(url: StoreURL) -> Iterator[Path]:
    """A local copy of the file or prefix ``url`` (in the staging area, deleted after).

    Example:
        >>> import fsspec
        >>> fsspec.filesystem("memory").pipe_file("/doc/fetched/a.txt", b"hi")
        >>> with fetch(StoreURL("memory://doc/fetched")) as local:
        ...     (local / "a.txt").read_bytes()
        b'hi'
    """
    fs, root = open_store(url)
    holder = Path(tempfile.mkdtemp(prefix="ftrain-fetch-", dir=Staging.base(url)))
    target = holder / (url.name or "store")
    try:
        if fs.isdir(root):
            for path in fs.find(root):
                local = target / path[len(root) :].lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(path, str(local))
        else:
            fs.get_file(root, str(target))
        yield target
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def publish(written: list[Path], local_root: Path, url: StoreURL) -> list[StoreURL]:
    """Upload the local files ``written`` (under ``local_root``), in their order, to the
    same names under ``url``; their URLs."""
    fs, root = open_store(url)
    out = []
    for path in written:
        rel = path.relative_to(local_root).as_posix()
        fs.put_file(str(path), f"{root}/{rel}")
        out.append(url / rel)
    return out
