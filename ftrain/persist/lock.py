"""One run per directory: ``.ftrain.lock`` (an ``fcntl.flock``, released when its process dies).

A second live process gets a :class:`CheckpointError` naming the holder
(pid and host). Under ``torch.distributed`` only rank 0 locks.
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

    Example:
        >>> import tempfile
        >>> lock = RunLock(tempfile.mkdtemp()); lock.acquire(); lock.release()
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointError` naming the process that holds it."""
        if self._fd is not None:
            return
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; runs are not guarded there
            return

        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if holder.startswith(f"pid {os.getpid()} "):
                holder += ": another loop of this process; close it with lp.close()"
            raise CheckpointError(
                f"{self.directory} is in use by another run ({holder}): two runs writing one "
                "directory would overwrite each other's checkpoints. Wait for it to end (or "
                "stop it), or use another work_dir."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
