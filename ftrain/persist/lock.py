"""One run per directory: ``.ftrain.lock`` (an ``fcntl.flock``, released when its process dies).

A second live process gets a :class:`CheckpointError` naming the directory and the holder
(pid, host, and the holder's work_dir when it has one). Under ``torch.distributed`` only
rank 0 locks. On an object store, without advisory locks, the same rule is a lease its
holder renews (:mod:`ftrain.persist.lease`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from ftrain.errors import CheckpointError

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = ".ftrain.lock"


class RunLock:
    """An exclusive lock on a run directory for this process.

    ``holder``: what a refused run is told of this one besides its pid and host (its
    work_dir).

    Example:
        >>> import tempfile
        >>> lock = RunLock(tempfile.mkdtemp(), holder="work_dir runs/a")
        >>> lock.acquire(); lock.release()
    """

    def __init__(self, directory: str | os.PathLike, holder: str | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.holder = holder
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointError` naming the process that holds it."""
        if self._fd is not None:
            return
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; runs are not guarded there
            return

        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if holder.startswith(f"pid {os.getpid()} "):
                holder += "; another loop of this process: close it with lp.close()"
            raise CheckpointError(
                f"{self.directory} is in use by another run ({holder}): two runs writing one "
                "directory would overwrite each other's checkpoints. Wait for it to end (or "
                "stop it), or use another work_dir (or out_dir)."
            ) from None
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, (me + (f", {self.holder}" if self.holder else "")).encode(), 0)
        self._fd = fd

    def _open(self) -> int:
        """The lock file's descriptor (created); an error naming it when it cannot be."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except IsADirectoryError:
            raise CheckpointError(
                f"Cannot lock the run directory {self.directory}: its lock file {self.path} is "
                "a directory (left untouched). ftrain keeps the lock there: remove or rename "
                "that directory, or use another work_dir (or out_dir)."
            ) from None
        except OSError as exc:
            raise CheckpointError(
                f"Cannot lock the run directory {self.directory}: {self.path} cannot be opened "
                f"({type(exc).__name__}: {exc}). Fix its permissions, or use another work_dir "
                "(or out_dir)."
            ) from exc

    def check(self) -> None:
        """Nothing to check: the lock lasts as long as this process (a store's lease can be
        lost: :meth:`ftrain.persist.lease.StoreLock.check`)."""

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
