"""``manifest.json``: the checkpoint files ftrain wrote in one directory, oldest first.

ftrain never deletes a file the manifest does not name. A missing, unreadable or
malformed manifest is rebuilt, with a warning, from the files whose checksums verify.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Any

import orjson

from ftrain.persist.rundir import RANK_MARK, RunDir

__all__ = ["Manifest", "MANIFEST", "RANK_MARK"]

MANIFEST = "manifest.json"
_NAME = re.compile(r"(iter|epoch)_(\d+)")
_INDENT = orjson.OPT_INDENT_2


def _kind(name: str) -> str:
    if name.startswith("best_"):
        return "best"
    if name.startswith("interrupted"):
        return "interrupted"
    return "periodic"


def _valid(data: Any) -> list[dict[str, Any]] | None:
    """The entries of a parsed manifest, or ``None`` when it is malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        return None
    entries = data["files"]
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            return None
        if "/" in e["name"] or e["name"] in ("", ".", ".."):
            return None
        for key in ("step", "seq", "size", "micro_step", "epoch"):
            if key in e and not isinstance(e[key], int):
                return None
    return entries


class Manifest:
    """The list of checkpoint files ftrain wrote in one directory.

    Example:
        >>> import tempfile
        >>> Manifest(tempfile.mkdtemp()).entries
        []
    """

    def __init__(
        self, directory: str | os.PathLike | RunDir, *, main: bool = True, rebuild: bool = True
    ) -> None:
        self.dir = directory if isinstance(directory, RunDir) else RunDir(directory)
        self.directory = self.dir.path
        self.path = self.dir.local(MANIFEST)
        self.main = main  # only the main process (rank 0) writes
        self.entries: list[dict[str, Any]] = []
        problem = None
        try:
            raw = self.dir.read_bytes(MANIFEST)
        except OSError as exc:
            raw, problem = None, f"unreadable ({type(exc).__name__}: {exc})"
        if raw is not None:
            try:
                entries = _valid(orjson.loads(raw))
            except orjson.JSONDecodeError:
                entries = None
            if entries is None:
                problem = "malformed"
            else:
                self.entries = list(entries)
                return
        if not rebuild or (problem is None and not self.dir.checkpoint_names()):
            return  # a new directory (or a lookup that needs no rebuild)
        self.entries = self._scan()
        what = problem or "missing"
        if self.entries or problem:
            names = ", ".join(e["name"] for e in self.entries[-3:]) or "none"
            warnings.warn(
                f"{self.path} is {what}: rebuilt it from the {len(self.entries)} checkpoint "
                f"file(s) whose checksums verify (newest: {names}).",
                stacklevel=3,
            )
        if self.entries and self.main:
            with contextlib.suppress(OSError):
                self.write()

    def _scan(self) -> list[dict[str, Any]]:
        """Entries for the files that verify, oldest first (by modification time)."""
        d = self.dir
        found = []
        for name in d.checkpoint_names():
            meta = f"{name}/ftrain.pth" if d.is_dir(name) else name
            try:
                d.verify(meta, None)
                saved = d.peek(meta)
                mtime = d.mtime(name)
                info = {"size": d.size(meta), "sha256": d.sha256(meta)}
            except Exception:  # noqa: BLE001 - a file that does not verify is left out
                continue
            if isinstance(saved, dict):
                found.append((mtime, name, meta, saved, info))
        found.sort(key=lambda t: t[0])
        return [self._rebuilt(seq, *f) for seq, f in enumerate(found)]

    @staticmethod
    def _rebuilt(seq: int, mtime: float, name: str, meta: str, saved: dict, info: dict) -> dict:
        """The entry of a checkpoint file found on disk (no manifest named it)."""
        state = saved.get("state") if isinstance(saved.get("state"), dict) else {}
        m = _NAME.search(name)
        entry: dict[str, Any] = {
            "name": name,
            "kind": _kind(name),
            "step": int(state.get("step", m.group(2) if m else -1)),
            "micro_step": int(state.get("micro_step", -1)),
            "epoch": int(state.get("epoch", -1)),
            "time": mtime,
            "seq": seq,
            "resumable": "format" in saved and _kind(name) != "best",
            "run": (saved.get("loop") or {}).get("run_id"),
        }
        if meta != name:
            entry.update(sharded=True, meta=info)
        else:
            entry.update(info)
        return entry

    def entry(self, name: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.entries) if e["name"] == name), None)

    def remove(self, *names: str) -> None:
        """Forget ``names`` and delete their files (and per-rank files)."""
        self.update(None, names)

    def update(
        self, entry: dict[str, Any] | None = None, remove: Any = (), prune: Any = None
    ) -> None:
        """Add ``entry`` and remove ``remove`` (and what ``prune(manifest)`` names) in one write.

        The manifest is written before files are deleted: a crash leaves an
        unnamed file, never a name without its file.
        """
        if entry is not None:
            seq = max((e.get("seq", -1) for e in self.entries), default=-1) + 1
            self.entries = [e for e in self.entries if e["name"] != entry["name"]]
            self.entries.append({**entry, "seq": seq})
        names = [*remove, *(prune(self) if prune is not None else ())]
        gone = set(names)
        self.entries = [e for e in self.entries if e["name"] not in gone]
        self.write()
        if self.main:
            for name in names:
                self.dir.delete(name)

    def write(self) -> None:
        """Write the manifest atomically (the main process only)."""
        if not self.main:
            return
        self.dir.write_bytes(MANIFEST, orjson.dumps({"files": self.entries}, option=_INDENT))

    def resumable(self) -> list[dict[str, Any]]:
        """Entries holding a full training state, the newest written first."""
        full = [e for e in self.entries if e.get("resumable", True)]
        return sorted(
            full,
            key=lambda e: (e.get("seq", -1), e.get("time", 0), e.get("micro_step", -1)),
            reverse=True,
        )

    def good(self) -> list[str]:
        """The names of the recorded files that exist, oldest first."""
        return [e["name"] for e in self.entries if self.dir.exists(e["name"])]
