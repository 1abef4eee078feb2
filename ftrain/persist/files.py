"""Atomic files with checksums: write beside, ``fsync``, rename; verify before loading.

A crash leaves the old file or the new one, never half of one. Writes return
``{"size", "sha256"}`` for the manifest; reads check them, or, with no record,
the CRC-32s of the zip archive ``torch.save`` writes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO

import torch

from ftrain.errors import CheckpointError

__all__ = ["save_atomic", "stage_atomic", "commit_atomic", "write_bytes_atomic", "load_file"]

TMP_MARK = ".tmp-"


def tmp_path(path: Path) -> Path:
    """The temporary name of ``path`` while it is written (hidden, per process)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets you open a directory
        _fsync(directory)


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


def _stage(path: Path, write: Any) -> Path:
    """``write(file)`` into ``path``'s temporary (removed if it fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def stage_atomic(obj: Any, path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """``torch.save(obj)`` to a temporary beside ``path``; returns it and ``{"size", "sha256"}``."""
    writer: list[_HashingWriter] = []

    def write(f: Any) -> None:
        writer.append(_HashingWriter(f))
        torch.save(obj, writer[0])

    tmp = _stage(Path(path), write)
    return tmp, {"size": writer[0].size, "sha256": writer[0].sha.hexdigest()}


def commit_atomic(tmp: Path, path: str | os.PathLike, *, sync_dir: bool = True) -> None:
    """``fsync`` ``tmp``, rename it to ``path``, sync the directory (unless ``sync_dir=False``)."""
    path = Path(path)
    try:
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)


def save_atomic(obj: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``torch.save(obj, path)`` atomically; returns ``{"size", "sha256"}``.

    Example:
        >>> import tempfile, os, torch
        >>> info = save_atomic({"x": torch.ones(2)}, os.path.join(tempfile.mkdtemp(), "a.pth"))
        >>> info["size"] > 0
        True
    """
    tmp, info = stage_atomic(obj, path)
    commit_atomic(tmp, path)
    return info


def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, ``fsync``, rename)."""
    commit_atomic(_stage(Path(path), lambda f: f.write(data)), path)


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


#: The fix every message about a bad checkpoint ends with.
FIX = "Resume from an earlier checkpoint (resume='auto' picks the newest good one)."


def check_recorded(
    size: int, sha256: Callable[[], str], expected: Mapping[str, Any], shown: object
) -> None:
    """Raise a :class:`CheckpointError` naming ``shown`` unless a file of ``size`` bytes
    (its SHA-256 computed by ``sha256()`` only if the size matches) is as ``expected``
    records it.

    Example:
        >>> check_recorded(2, lambda: "ab", {"size": 2, "sha256": "ab"}, "x.pth")
    """
    if size != expected.get("size", size):
        raise CheckpointError(
            f"Checkpoint {shown} is truncated or was overwritten: {size} bytes stored, "
            f"{expected['size']} written. {FIX}"
        )
    if sha256() != expected["sha256"]:
        raise CheckpointError(
            f"Checkpoint {shown} is corrupt (SHA-256 differs from the one recorded when "
            f"it was written). {FIX}"
        )


def verify_file(path: Path, expected: Mapping[str, Any] | None, label: str | None = None) -> None:
    """Check ``path``'s recorded size and SHA-256 (or its CRC-32s); a CheckpointError if bad.
    ``label``: the name messages give the file (a downloaded copy: its URL)."""
    shown = path if label is None else label
    verify_with(
        lambda: path.stat().st_size, lambda: sha256_of(path), lambda: open(path, "rb"),
        expected, shown,
    )  # fmt: skip


def verify_with(
    size: Callable[[], int],
    sha256: Callable[[], str],
    open_binary: Callable[[], IO[bytes]],
    expected: Mapping[str, Any] | None,
    shown: Any,
) -> None:
    """Check a checkpoint (wherever it is: ``size``, ``sha256`` and ``open_binary`` read it)
    against its recorded size and SHA-256, or its zip's CRC-32s without a record; a
    :class:`CheckpointError` naming ``shown`` if it does not match or cannot be read."""
    try:
        if expected and "sha256" in expected:
            check_recorded(size(), sha256, expected, shown)
            return
        with open_binary() as f, zipfile.ZipFile(f) as z:
            bad = z.testzip()
    except CheckpointError:
        raise
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"Checkpoint {shown} cannot be read ({type(exc).__name__}: {exc}). {FIX}"
        ) from exc
    if bad is not None:
        raise CheckpointError(f"Checkpoint {shown} is corrupt (CRC-32 of {bad}). {FIX}")


def load_file(
    path: str | os.PathLike,
    *,
    map_location: Any = "cpu",
    expected: Mapping[str, Any] | None = None,
    label: str | None = None,
) -> Any:
    """Verify (:func:`verify_file`), then ``torch.load``; any failure is a :class:`CheckpointError`
    (naming ``label``, else ``path``)."""
    path = Path(path)
    shown = path if label is None else label
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {shown} does not exist.")
    verify_file(path, expected, label)
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"Checkpoint {shown} cannot be read ({type(exc).__name__}: {exc}). The file is "
            f"truncated or corrupt. {FIX}"
        ) from exc


class _NoTensors(pickle.Unpickler):
    """Unpickles a ``torch.save`` archive's ``data.pkl`` without reading any tensor."""

    def persistent_load(self, pid: Any) -> None:
        return None

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch"):
            return lambda *a, **k: None  # tensor rebuilds, dtypes...: not needed to peek
        return super().find_class(module, name)


def peek(path: Path | BinaryIO) -> Any:
    """The object in a ``torch.save`` file (a path, or a seekable binary file: a store's
    object read by ranges), every tensor ``None`` (cheap: rebuilds a manifest)."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        with z.open(name) as f:
            return _NoTensors(f).load()


def clean_temporaries(directory: str | os.PathLike) -> None:
    """Delete temporary files and directories left by interrupted writes."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.glob(f".*{TMP_MARK}*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            continue
        with contextlib.suppress(OSError):
            p.unlink()


_DISK_FULL_TEXT = ("unexpected pos", "failed writing", "No space left")


def _chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (each once)."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def interruption(exc: BaseException) -> BaseException | None:
    """The Ctrl-C (``KeyboardInterrupt``) or stop (``SystemExit``, SIGTERM's
    ``TerminatedError``) behind a failed write, or ``None``: ``torch.save`` reports a
    Ctrl-C that lands inside it as a ``RuntimeError`` ("unexpected pos"), like a full disk.

    Example:
        >>> try:
        ...     try:
        ...         raise KeyboardInterrupt
        ...     except KeyboardInterrupt:
        ...         raise RuntimeError("unexpected pos 64")
        ... except RuntimeError as exc:
        ...     type(interruption(exc)).__name__, is_disk_full(exc)
        ('KeyboardInterrupt', False)
    """
    return next((e for e in _chain(exc) if isinstance(e, (KeyboardInterrupt, SystemExit))), None)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was raised from) a full disk or quota, and not an interruption."""
    if interruption(exc) is not None:
        return False
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, RuntimeError) and any(t in str(e) for t in _DISK_FULL_TEXT):
            return True
    return False


def _failed_file(exc: BaseException, default: Path) -> Path:
    """The file a write failed on: the one its ``OSError`` names (a temporary by the name it
    was written for), else ``default``."""
    named = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    if named is None:
        return default
    path = Path(os.fsdecode(named))
    if path.name.startswith(".") and TMP_MARK in path.name:
        return path.with_name(path.name[1 : path.name.index(TMP_MARK)])
    return path


def free_space(directory: Path) -> str:
    """``"12.5 MiB free"`` on the disk of ``directory`` (or ``"free space unknown"``)."""
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


def write_error(exc: BaseException, directory: Path, name: str, good: list[str]) -> CheckpointError:
    """One :class:`CheckpointError` for a failed write of ``name``: the file, the free space
    on a full disk, the good checkpoints."""
    if isinstance(exc, CheckpointError):
        return exc
    kept = ", ".join(good[-5:]) if good else "none"
    target = _failed_file(exc, directory / name)
    what = f"checkpoint {target}" if target.name == name else f"{target} (saving {name})"
    if is_disk_full(exc):
        return CheckpointError(
            f"Cannot write {what}: the disk of {directory} is full ({free_space(directory)}). "
            f"The good checkpoints there are intact: {kept}. Free some space (or lower "
            "max_keep), then resume with resume='auto'."
        )
    return CheckpointError(
        f"Cannot write {what} ({type(exc).__name__}: {exc}). The good checkpoints in "
        f"{directory} are intact: {kept}. Fix the cause, then resume with resume='auto'."
    )
