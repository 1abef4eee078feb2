"""``manifest.json``: the checkpoint files ftrain wrote in one directory; the commit record.

A checkpoint exists once the manifest names it: its file is complete before the manifest
is written, and a file the manifest drops is deleted after. The manifest records the
directory's id (``dir``), the run that wrote it last (``run``) and its ``generation``,
incremented on every write; each checkpoint file carries the same facts in its own
``meta`` (run, directory, generation, step, micro-step), so the files can check the
manifest:

- missing, unreadable or malformed: rebuilt, with a warning, from the files whose checksums
  verify, ordered by the step in their metadata;
- stale (a file of this directory carries a higher generation than the manifest: an older
  copy was restored over it, or a save was cut off between writing the file and recording
  it): the newer files that verify are added, with a warning (:meth:`Manifest.reconcile`);
- orphans (a run killed between writing the manifest and deleting the files it dropped):
  files of the run, of this directory, of a generation the manifest has seen and not listed,
  are deleted (:meth:`Manifest.collect`); a file of another run or an unknown file never is.

"Newest" is the step, then the micro-step, then the generation; a checkpoint a later save
of its run went back behind (``resume=`` an older file: an abandoned branch) comes last.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from ftrain.persist.rundir import RANK_MARK, RunDir

__all__ = ["Manifest", "MANIFEST", "RANK_MARK", "newest_first", "newest_across", "file_meta"]

MANIFEST = "manifest.json"
#: The file of a sharded (``.dcp``) checkpoint holding everything but the shards.
SHARDED_META = "ftrain.pth"
_NAME = re.compile(r"(iter|epoch)_(\d+)")
_INDENT = orjson.OPT_INDENT_2
_INTS = ("step", "seq", "size", "micro_step", "epoch", "generation")


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
    if not isinstance(data.get("generation", 0), int):
        return None
    entries = data["files"]
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            return None
        if "/" in e["name"] or e["name"] in ("", ".", ".."):
            return None
        if any(key in e and not isinstance(e[key], int) for key in _INTS):
            return None
    return entries


def _point(e: dict[str, Any]) -> tuple[int, int]:
    return (e.get("step", -1), e.get("micro_step", -1))


def _generation(e: dict[str, Any]) -> int:
    """The manifest write that recorded ``e`` (manifests before generations: its ``seq``)."""
    return e.get("generation", e.get("seq", -1))


def _abandoned(entries: list[dict[str, Any]]) -> set[int]:
    """Indices of checkpoints a later save of the same run went back behind (a run resumed
    from an older file wrote them again from there: they are an abandoned branch)."""
    out: set[int] = set()
    by_generation: dict[int, list[int]] = {}
    for i, e in enumerate(entries):
        by_generation.setdefault(_generation(e), []).append(i)
    earliest: dict[Any, tuple[int, int]] = {}  # per run: the earliest point of later writes
    for generation in sorted(by_generation, reverse=True):
        group = by_generation[generation]
        for i in group:
            later = earliest.get(entries[i].get("run"))
            if later is not None and later < _point(entries[i]):
                out.add(i)
        for i in group:
            run, point = entries[i].get("run"), _point(entries[i])
            earliest[run] = min(point, earliest.get(run, point))
    return out


def newest_first(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` newest first: by step, micro-step, then generation (never by file
    time); an abandoned branch's checkpoints after the others.

    Example:
        >>> es = [{"name": "a", "step": 6, "generation": 1}, {"name": "b", "step": 4,
        ...       "generation": 2}, {"name": "c", "step": 2, "generation": 0}]
        >>> [e["name"] for e in newest_first(es)]  # b was written after a, from step 2 on
        ['b', 'c', 'a']
    """
    entries = list(entries)
    gone = _abandoned(entries)
    order = sorted(
        range(len(entries)),
        key=lambda i: (i not in gone, _point(entries[i]), _generation(entries[i])),
        reverse=True,
    )
    return [entries[i] for i in order]


def newest_across(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """:meth:`Manifest.resumable` entries of several directories, newest first: by step and
    micro-step (generations count per directory); an abandoned branch's last.

    Example:
        >>> es = [{"name": "a", "step": 2}, {"name": "b", "step": 6, "abandoned": True},
        ...       {"name": "c", "step": 4}]
        >>> [e["name"] for e in newest_across(es)]
        ['c', 'a', 'b']
    """
    return sorted(entries, key=lambda e: (not e.get("abandoned"), _point(e)), reverse=True)


def file_meta(saved: Any) -> dict[str, Any] | None:
    """What a checkpoint says of itself (``meta``: run, directory, generation, step,
    micro-step); from its state for files written before ``meta``; ``None``: not a checkpoint.

    Example:
        >>> file_meta({"meta": {"run": "r", "step": 4}})["run"], file_meta([1])
        ('r', None)
    """
    if not isinstance(saved, dict):
        return None
    if isinstance(saved.get("meta"), dict):
        return saved["meta"]
    state = saved.get("state") if isinstance(saved.get("state"), dict) else {}
    loop = saved.get("loop") if isinstance(saved.get("loop"), dict) else {}
    return {"run": loop.get("run_id"), "step": state.get("step"), "micro_step":
            state.get("micro_step"), "epoch": state.get("epoch")}  # fmt: skip


class Manifest:
    """The list of checkpoint files ftrain wrote in one directory.

    Example:
        >>> import tempfile
        >>> m = Manifest(tempfile.mkdtemp())
        >>> m.entries, m.generation
        ([], 0)
    """

    def __init__(
        self, directory: str | os.PathLike | RunDir, *, main: bool = True, rebuild: bool = True
    ) -> None:
        self.dir = directory if isinstance(directory, RunDir) else RunDir(directory)
        self.directory = self.dir.path
        self.path = self.dir.local(MANIFEST)
        self.main = main  # only the main process (rank 0) writes
        self.entries: list[dict[str, Any]] = []
        #: Writes so far; each checkpoint file records the one that lists it.
        self.generation = 0
        #: The run that wrote the manifest last, and the directory's id (``None``: none yet).
        self.run: str | None = None
        self.dir_id: str | None = None
        self.rebuilt = False  # from the files (it took in every one that verifies)
        problem = self._read()
        if problem == "" or not rebuild:
            return
        if problem is None and not self.dir.checkpoint_names():
            return  # a new directory
        self._rebuild(problem or "missing")

    def _read(self) -> str | None:
        """Read the manifest: ``""`` when valid, else what is wrong (``None``: no manifest)."""
        try:
            raw = self.dir.read_bytes(MANIFEST)
        except OSError as exc:
            return f"unreadable ({type(exc).__name__}: {exc})"
        if raw is None:
            return None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return "malformed"
        entries = _valid(data)
        if entries is None:
            return "malformed"
        self.entries = list(entries)
        seqs = [e.get("seq", -1) for e in self.entries]
        self.generation = data.get("generation", max(seqs, default=-1) + 1)
        self.run, self.dir_id = data.get("run"), data.get("dir")
        return ""

    def _rebuild(self, what: str) -> None:
        self.rebuilt = True
        self.entries = self._scan()
        self.generation = max([len(self.entries), *(_generation(e) for e in self.entries)])
        ids = [e["dir"] for e in newest_first(self.entries) if e.get("dir")]
        self.dir_id = ids[0] if ids else None
        if self.entries or what != "missing":
            names = ", ".join(e["name"] for e in newest_first(self.entries)[:3]) or "none"
            warnings.warn(
                f"{self.path} is {what}: rebuilt it from the {len(self.entries)} checkpoint "
                f"file(s) whose checksums verify, ordered by their steps (newest: {names}).",
                stacklevel=4,
            )
        if self.entries and self.main:
            with contextlib.suppress(OSError):
                self.write()

    def _scan(self) -> list[dict[str, Any]]:
        """Entries for the files that verify, oldest first (by the steps they record)."""
        found = [e for e in map(self._found, self.dir.checkpoint_names()) if e is not None]
        ordered = newest_first(found)[::-1]
        return [{**e, "seq": seq} for seq, e in enumerate(ordered)]

    def _found(self, name: str) -> dict[str, Any] | None:
        """The entry of checkpoint ``name`` found on disk (no manifest names it), if it
        verifies against its own checksums."""
        d = self.dir
        meta = f"{name}/{SHARDED_META}" if d.is_dir(name) else name
        if meta != name and not d.exists(f"{name}/.metadata"):
            return None  # a torn sharded write (DCP writes .metadata last): not a checkpoint
        try:
            d.verify(meta, None)
            saved = d.peek(meta)
            info = {"size": d.size(meta), "sha256": d.sha256(meta)}
        except Exception:  # noqa: BLE001 - a file that does not verify is left out
            return None
        facts = file_meta(saved)
        if facts is None:
            return None
        m = _NAME.search(name)
        kind = facts.get("kind") or _kind(name)
        entry: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "step": _int(facts.get("step"), int(m.group(2)) if m else -1),
            "micro_step": _int(facts.get("micro_step"), -1),
            "epoch": _int(facts.get("epoch"), -1),
            "resumable": "format" in saved and kind != "best",
            "run": facts.get("run"),
        }
        if facts.get("generation") is not None:
            entry.update(generation=int(facts["generation"]), dir=facts.get("dir"))
        entry.update({"sharded": True, "meta": info} if meta != name else info)
        return entry

    def _meta_of(self, name: str) -> dict[str, Any] | None:
        """``name``'s own metadata (cheap: no tensor is read); ``None``: unreadable."""
        target = f"{name}/{SHARDED_META}" if self.dir.is_dir(name) else name
        try:
            return file_meta(self.dir.peek(target))
        except Exception:  # noqa: BLE001 - not a checkpoint ftrain can read: unknown
            return None

    # ------------------------------------------------------------------ reading
    def entry(self, name: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.entries) if e["name"] == name), None)

    def resumable(self) -> list[dict[str, Any]]:
        """Entries holding a full training state, the newest first (:func:`newest_first`); an
        abandoned branch's marked ``"abandoned"``."""
        gone = {id(self.entries[i]) for i in _abandoned(self.entries)}
        return [
            {**e, "abandoned": True} if id(e) in gone else e
            for e in newest_first(self.entries) if e.get("resumable", True)
        ]  # fmt: skip

    def good(self) -> list[str]:
        """The names of the recorded files that exist, oldest first."""
        return [e["name"] for e in newest_first(self.entries)[::-1] if self.dir.exists(e["name"])]

    def identity(self) -> str:
        """The directory's id, recorded in every checkpoint written here (made on first use)."""
        if self.dir_id is None:
            self.dir_id = uuid.uuid4().hex[:12]
        return self.dir_id

    def meta(self, entry: dict[str, Any]) -> dict[str, Any]:
        """What the checkpoint of manifest entry ``entry``, written next, records of itself."""
        facts = {k: entry.get(k) for k in ("name", "kind", "run", "step", "micro_step", "epoch")}
        return {**facts, "dir": self.identity(), "generation": self.generation + 1}

    # ------------------------------------------------------------------ writing
    def remove(self, *names: str) -> None:
        """Forget ``names`` and delete their files (and per-rank files)."""
        self.update(None, names)

    def update(
        self,
        entry: dict[str, Any] | None = None,
        remove: Iterable[str] = (),
        prune: Callable[[Manifest], list[str]] | None = None,
    ) -> None:
        """Add ``entry`` and remove ``remove`` (and what ``prune(manifest)`` names) in one write,
        the next generation; then delete their files and this run's orphans.

        The manifest is written before files are deleted: a crash leaves an
        unnamed file (collected on the next start), never a name without its file.
        """
        self.generation += 1
        if entry is not None:
            self.generation = max(self.generation, entry.get("generation", 0))
            seq = max((e.get("seq", -1) for e in self.entries), default=-1) + 1
            self.entries = [e for e in self.entries if e["name"] != entry["name"]]
            self.entries.append({**entry, "seq": seq, "generation": self.generation})
            self.run = entry.get("run", self.run)
        names = [*remove, *(prune(self) if prune is not None else ())]
        gone = set(names)
        self.entries = [e for e in self.entries if e["name"] not in gone]
        self.write()
        if not self.main:
            return
        for name in names:
            self.dir.delete(name)
        if entry is not None and entry.get("run") is not None:
            self.collect(entry["run"])

    def write(self) -> None:
        """Write the manifest atomically (the main process only)."""
        if not self.main:
            return
        data = {"run": self.run, "dir": self.identity(), "generation": self.generation,
                "files": self.entries}  # fmt: skip
        self.dir.write_bytes(MANIFEST, orjson.dumps(data, option=_INDENT))

    # ------------------------------------------------------------ the files' view
    def _own(self, listed: bool) -> list[tuple[str, dict[str, Any]]]:
        """Checkpoints here of this directory (another directory's copy or an unknown file
        is left out) with their own metadata: the unlisted ones, or all (``listed``)."""
        if self.dir_id is None:
            return []
        names = {e["name"] for e in self.entries}
        out = []
        for name in self.dir.checkpoint_names():
            meta = self._meta_of(name) if listed or name not in names else None
            if meta is not None and meta.get("dir") == self.dir_id:
                out.append((name, meta))
        return out

    def reconcile(self, *, warn: bool = True) -> list[str]:
        """Take in the checkpoints of this directory newer than the manifest (a higher
        generation: an older manifest was restored over a newer one, or a save was cut off
        before it was recorded) that verify, with a warning naming them (``warn``), and write
        it (``main``); returns their names."""
        if self.rebuilt:
            return []
        newer = [(n, m) for n, m in self._own(listed=True) if _gen_of(m) > self.generation]
        if not newer:
            return []
        added, bad = [], []
        gone = [e["name"] for e in self.entries if not self.dir.exists(e["name"])]
        self.entries = [e for e in self.entries if e["name"] not in gone]
        for name, _ in newer:
            entry = self._found(name)
            (bad if entry is None else added).append(name)
            if entry is not None:
                self.entries = [e for e in self.entries if e["name"] != name]
                self.entries.append({**entry, "seq": len(self.entries)})
        was = self.generation
        self.generation = max([was, *(_gen_of(m) for n, m in newer if n in added)])
        if added and self.main:
            self.write()
        if warn:
            warnings.warn(self._stale_message(was, newer, added, bad, gone), stacklevel=3)
        return added

    def _stale_message(
        self, was: int, newer: list, added: list[str], bad: list[str], gone: list[str]
    ) -> str:
        found = ", ".join(f"{n} (step {m.get('step')}, generation {m.get('generation')})"
                          for n, m in newer)  # fmt: skip
        msg = (
            f"{self.path} (generation {was}) is older than checkpoints of this directory: "
            f"{found}. An older copy of it was restored, or a save was cut off between "
            "writing a file and recording it."
        )
        if added:
            newest = newest_first(e for e in self.entries if e["name"] in added)[0]["name"]
            msg += f" Recorded {', '.join(added)} (newest: {newest}); nothing is overwritten."
        if bad:
            msg += f" Left alone, as they do not verify: {', '.join(bad)}."
        if gone:
            msg += f" Dropped the entries of files no longer there: {', '.join(gone)}."
        return msg

    def collect(self, run: str) -> list[str]:
        """Delete this run's orphans: its checkpoints here of a generation the manifest has
        seen and does not list (dropped by a write whose deletes a kill cut short)."""
        if not self.main:
            return []
        orphans = [
            name for name, m in self._own(listed=False)
            if m.get("run") == run and 0 < _gen_of(m) <= self.generation
        ]  # fmt: skip
        for name in orphans:
            self.dir.delete(name)
        return orphans


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int) else default


def _gen_of(meta: dict[str, Any]) -> int:
    """The generation a checkpoint file records (0: none, a file of an earlier ftrain)."""
    g = meta.get("generation")
    return g if isinstance(g, int) else 0
