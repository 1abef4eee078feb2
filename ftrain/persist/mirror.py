"""The files a run's hooks write (logs, TensorBoard, traces) when its work_dir is on a store.

Hooks write local files. For a ``work_dir`` on an object store they write into a local
copy of it (``Run.log_dir``: a directory in the staging area, named like the run), which
:class:`LogMirror` uploads into the store under the same names: after each checkpoint is
committed (the logs up to a checkpoint are in the store with it) and when the run ends or
stops. A run that starts (or resumes) first downloads the files already there, so the
logger continues its files, and cuts them back to the checkpoint it resumes from, as on a
local disk. A path the hook is given outside ``log_dir`` (an absolute ``jsonl=`` path)
stays local.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import warnings
from pathlib import Path

from ftrain.persist.store import Staging, StoreDir

__all__ = ["LogMirror"]


def _stamp(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns


class LogMirror:
    """A local directory mirrored into a run directory on a store.

    ``main``: this process downloads what is there (rank 0; every process uploads what it
    wrote).

    Example:
        >>> from ftrain.persist.rundir import RunDir
        >>> m = LogMirror(RunDir("memory://doc/logged"))
        >>> _ = (m.local / "metrics.jsonl").write_text('{"step": 1}\\n')
        >>> m.push(), RunDir("memory://doc/logged").other_files()
        (['metrics.jsonl'], ['metrics.jsonl'])
        >>> m.close(); m.local.exists()
        False
    """

    def __init__(self, store: StoreDir, *, main: bool = True) -> None:
        self.store, self.main = store, main
        holder = Path(tempfile.mkdtemp(prefix="ftrain-logs-", dir=Staging.base(store.path)))
        #: Where the run's hooks write (named like the run's directory).
        self.local = holder / (store.path.name or "run")
        self.local.mkdir()
        self._sent: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def pull(self) -> list[str]:
        """Download the run's files already in the store (the main process); their names."""
        if not self.main:
            return []
        names = self.store.other_files()
        with self._lock:
            for rel in names:
                target = self.local / rel
                self.store.download(rel, target)
                self._sent[rel] = _stamp(target)
        return names

    def push(self) -> list[str]:
        """Upload the files new or changed since the last push; their names."""
        sent = []
        with self._lock:
            for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
                rel = path.relative_to(self.local).as_posix()
                stamp = _stamp(path)  # before the upload: a later append is sent next time
                if self._sent.get(rel) != stamp:
                    self.store.upload(path, rel)
                    self._sent[rel] = stamp
                    sent.append(rel)
        return sent

    def close(self) -> None:
        """Upload what changed, then delete the local copy (kept, with a warning, if the
        upload fails)."""
        try:
            self.push()
        except Exception as exc:  # noqa: BLE001 - the run ends either way: keep the files
            warnings.warn(
                f"Could not upload the run's log files to {self.store.path} "
                f"({type(exc).__name__}: {exc}); they are kept in {self.local}.",
                stacklevel=2,
            )
            return
        shutil.rmtree(self.local.parent, ignore_errors=True)
