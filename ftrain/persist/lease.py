"""One run per directory on an object store: ``.ftrain.lock``, a lease its holder renews.

A store has no advisory locks, and a process that dies leaves its objects behind, so the
lock is an object that says until when it holds (:class:`StoreLock`):

- it is created only if absent (S3: ``If-None-Match: *``), holding the holder (pid, host,
  work_dir), a token and ``expires``, the end of its lease (:data:`LEASE` seconds, by the
  holder's clock);
- a thread of the holder renews it every third of the lease (a put conditional on the
  version it wrote last), and the holder deletes it when the run ends;
- a second run is refused while the lease runs, naming the holder; once the lease has
  ended without renewal (the holder died, or hung that long), the next run to start takes
  the lock over by a put conditional on the version it read (of two runs starting
  together, one wins);
- a holder that finds the lock taken over (its renewal, or the check before each save)
  has lost the directory: its next save raises (:meth:`StoreLock.check`), and its manifest
  puts fail (they are conditional too).

The clocks of the machines must agree to well within the lease (NTP does).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any

import orjson

from ftrain.errors import CheckpointError
from ftrain.persist.lock import LOCK_FILE

if TYPE_CHECKING:
    from ftrain.persist.store import StoreDir

__all__ = ["StoreLock", "LEASE", "now"]

#: Seconds a lock holds without renewal (renewed every third of it).
LEASE = 60.0


def now() -> float:
    """The time a lease is measured by (``time.time()``; a test may stand in for it)."""
    return time.time()


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    """A lock object's contents, or ``None`` when it is not one ftrain wrote."""
    try:
        data = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("expires"), (int, float)):
        return None
    return data


class StoreLock:
    """An exclusive lease on a run directory on an object store, for this process.

    Example:
        >>> from ftrain.persist.rundir import RunDir
        >>> lock = RunDir("memory://doc/locked").lock(holder="work_dir memory://doc/locked")
        >>> lock.acquire(); lock.check(); lock.release()
    """

    def __init__(self, store: StoreDir, holder: str | None = None, lease: float = LEASE) -> None:
        from ftrain.persist.store import StoreDir

        self.store = StoreDir(store.path)  # its own: the renewing thread uses it alone
        self._reader = StoreDir(store.path)  # the checks before saves (another thread)
        self.directory = store.path
        self.holder, self.lease = holder, lease
        self.token = uuid.uuid4().hex
        #: When this process's lease ends (by its clock), once held.
        self.expires = 0.0
        #: Why the lock was lost (another run took it over), or ``None``.
        self.lost: str | None = None
        self._other: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, expires: float) -> bytes:
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        me += f", {self.holder}" if self.holder else ""
        return orjson.dumps(
            {"holder": me, "token": self.token, "expires": expires, "lease": self.lease}
        )

    def acquire(self) -> None:
        """Take the lock (or a lock whose lease ended), or raise :class:`CheckpointError`
        naming its holder; then keep it renewed until :meth:`release`."""
        if self._thread is not None:
            return
        if not self._take() and not self._outwait():
            raise self._refusal()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="ftrain-lease", daemon=True)
        self._thread.start()

    def _outwait(self) -> bool:
        """A lease its holder stopped renewing (none for over a third of it: a live holder
        renews every third) belongs to a run that died, e.g. a restarted pod's former self:
        wait for it to end (at most two thirds of a lease), then take the lock."""
        other = self._other
        if other is None:
            return False
        lease = float(other.get("lease", LEASE))
        left = other["expires"] - now()
        if left > lease * 2 / 3 + 1.0:  # renewed lately: the holder is alive
            return False
        warnings.warn(
            f"{self.directory}: the lock of {other.get('holder')} has not been renewed for "
            f"{lease - left:.0f} s (its run died?); waiting {max(left, 0):.0f} s for its lease "
            "to end, then taking it over.",
            stacklevel=4,
        )
        while (left := other["expires"] - now()) > 0:
            time.sleep(min(left + 0.05, 1.0))
            current = _parse(self.store.read_bytes(LOCK_FILE))
            if current is None or current.get("token") != other.get("token"):
                break  # released, or taken by another run: try once more
            if current["expires"] != other["expires"]:
                self._other = current
                return False  # renewed after all: the holder lives
        return self._take()

    def _take(self) -> bool:
        d = self.store
        current = d.read_bytes(LOCK_FILE)  # remembered: the put below is conditional on it
        self._other = _parse(current)
        if current is not None and (self._other is None or self._other["expires"] > now()):
            return False
        expires = now() + self.lease
        if not d.put_if(LOCK_FILE, self._body(expires)):
            self._other = _parse(d.read_bytes(LOCK_FILE))  # another run was faster
            return False
        self.expires = expires
        if current is not None:
            ended = time.strftime("%H:%M:%S", time.localtime(self._other["expires"]))
            warnings.warn(
                f"Took over the lock of {self.directory} from {self._other.get('holder')}, "
                f"whose lease ended at {ended} without renewal (the run died or hung).",
                stacklevel=4,
            )
        return True

    def _refusal(self) -> CheckpointError:
        other = self._other
        if other is None:
            return CheckpointError(
                f"{self.directory} holds a lock object ({LOCK_FILE}) that ftrain did not write: "
                "delete it if no run uses the directory, or use another work_dir (or out_dir)."
            )
        holder = str(other.get("holder", "another process"))
        if holder.startswith(f"pid {os.getpid()} on {socket.gethostname()}"):
            holder += "; another loop of this process: close it with lp.close()"
        left = max(0.0, other["expires"] - now())
        return CheckpointError(
            f"{self.directory} is in use by another run ({holder}; its lease ends in "
            f"{left:.0f} s unless it renews it): two runs writing one directory would "
            "overwrite each other's checkpoints. Wait for it to end (or stop it: the lock of a "
            f"run that died is taken over once its lease ends, {other.get('lease', LEASE):.0f} s "
            "after its last renewal), or use another work_dir (or out_dir)."
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.lease / 3) and self.lost is None:
            self.renew()

    def renew(self) -> bool:
        """Extend the lease (the holder's thread does, every third of it); ``False`` if it
        could not: :attr:`lost` says why once the lock is gone."""
        expires = now() + self.lease
        try:
            ok = self.store.put_if(LOCK_FILE, self._body(expires))
        except Exception as exc:  # noqa: BLE001 - a store error: tried again at the next beat
            if now() > self.expires:
                self.lost = f"its lease ended while the store could not be reached ({exc})"
            return False
        if not ok:
            self.lost = (
                "another run took the lock over (this run's lease had ended without renewal: "
                "was the process stopped, or the store out of reach, for longer than "
                f"{self.lease:.0f} s?)"
            )
            return False
        self.expires = expires
        return True

    def check(self) -> None:
        """Raise :class:`CheckpointError` if the lock was lost (before each save: it reads
        the lock object, so a takeover is seen even between two renewals)."""
        if self.lost is None and self._thread is not None:
            mine = _parse(self._reader.read_bytes(LOCK_FILE))
            if mine is None or mine.get("token") != self.token:
                holder = "nobody" if mine is None else mine.get("holder")
                self.lost = f"the lock object now names {holder}"
        if self.lost is not None:
            raise CheckpointError(
                f"This run no longer holds the lock of {self.directory}: {self.lost}. It stops "
                "writing there, so as not to overwrite the other run's files; the checkpoints "
                "written so far are intact."
            )

    def release(self) -> None:
        """Stop renewing and delete the lock object if it is still this run's (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.lost is not None:
            return
        with contextlib.suppress(Exception):  # a lease that ends unrenewed frees it anyway
            mine = _parse(self.store.read_bytes(LOCK_FILE))
            if mine is not None and mine.get("token") == self.token:
                self.store.delete(LOCK_FILE)
