"""The run protocol (:func:`open_run`, before step 1): lock ``work_dir``; a fresh run
refuses a directory holding another run's checkpoints; ``resume="auto"`` takes the
newest checkpoint that verifies in ``work_dir`` and the checkpoint hooks' ``out_dir``
(bad files skipped with a warning; files but none loading is an error, never a silent
restart); the checkpoint is checked to fit the run, then loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrain import dist as _dist
from ftrain.errors import CheckpointError
from ftrain.persist.checkpointer import Checkpointer
from ftrain.persist.lock import RunLock
from ftrain.persist.manifest import Manifest

__all__ = ["open_run", "close_run", "run_dirs", "resume_mode", "find_resumable", "checkpointer_of"]


def run_dirs(loop: Any) -> list[Path]:
    """``work_dir`` and the ``out_dir`` of the loop's checkpoint hooks (no duplicates)."""
    dirs = [] if loop.work_dir is None else [Path(loop.work_dir)]
    for h in getattr(loop, "hooks", ()):
        fn = getattr(h, "fn", h)
        if getattr(fn, "out_dir", None) is not None and getattr(fn, "writes_checkpoints", False):
            dirs.append(Path(fn.out_dir))
    unique: dict[str, Path] = {}
    for d in dirs:
        unique.setdefault(os.path.realpath(d), d)
    return list(unique.values())


def checkpointer_of(loop: Any) -> Checkpointer:
    """The loop's :class:`Checkpointer` (made on first use for a loop built by hand)."""
    ckpt = getattr(loop, "checkpointer", None)
    if ckpt is None:
        ckpt = Checkpointer(loop.state.model)
        with contextlib.suppress(AttributeError):
            loop.checkpointer = ckpt
    return ckpt


def open_run(loop: Any, *, first: bool) -> Checkpointer:
    """Lock the run directory and, on the run's first start, resume. Returns the Checkpointer."""
    ckpt = checkpointer_of(loop)
    lock = None
    if loop.work_dir is not None and ckpt.main:
        ckpt.check_writable(Path(loop.work_dir))  # before step 1, with a clear error
        lock = RunLock(loop.work_dir)
        lock.acquire()
    ckpt.lock = lock
    if not first:
        return ckpt
    try:
        _resume(loop, ckpt)
    except BaseException:
        close_run(loop)
        raise
    return ckpt


def close_run(loop: Any) -> None:
    """Wait for the run's writes (their threads end) and unlock its directory."""
    ckpt = getattr(loop, "checkpointer", None)
    if ckpt is None:
        return
    try:
        ckpt.close()
    finally:
        lock = getattr(ckpt, "lock", None)
        if lock is not None:
            lock.release()
            ckpt.lock = None


def _others(loop: Any, dirs: list[Path]) -> list[str]:
    out = []
    for d in dirs:
        if d.is_dir():
            m = Manifest(d, main=False)
            out += [str(d / e["name"]) for e in m.entries if (d / e["name"]).exists()]
    return out


def resume_mode(resume: Any, work_dir: Any) -> str | Path | None:
    """``resume=`` as ``None`` (fresh run), ``"auto"`` (any case, or ``True``) or a path.

    Example:
        >>> resume_mode("Auto", "runs/a"), resume_mode(None, None)
        ('auto', None)
    """
    valid = (
        "resume takes 'auto' (continue from the newest good checkpoint in work_dir, or start "
        "fresh if there is none), the path of a checkpoint file or .dcp directory, or None "
        "(a fresh run)"
    )
    if resume is None or resume is False:
        return None
    if resume is True or (isinstance(resume, str) and resume.strip().lower() == "auto"):
        if work_dir is None:
            raise ValueError("resume='auto' needs work_dir= (where the checkpoints are).")
        return "auto"
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume={resume!r} is not understood: {valid}.")
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"resume={str(resume)!r}: no checkpoint at {path.resolve()}; {valid}."
        )
    return path


def _resume(loop: Any, ckpt: Checkpointer) -> None:
    dirs = run_dirs(loop)
    mode = resume_mode(loop.resume, loop.work_dir)
    if mode is None:
        others = _others(loop, dirs)  # every rank sees the same directory: all raise, or none
        if others:
            raise CheckpointError(
                f"{others[0].rsplit('/', 1)[0]} holds checkpoints of another run "
                f"({', '.join(Path(o).name for o in others[-3:])}); a fresh run (resume=None) "
                "would overwrite files of the same names. Pass resume='auto' to continue that "
                "run, or a new work_dir for a new one (or delete those files first)."
            )
        return
    if mode == "auto":
        found = ckpt.find(dirs)
        if found is None:
            resumable = [n for n in _others(loop, dirs) if not Path(n).name.startswith("best_")]
            if resumable:
                raise CheckpointError(
                    f"resume='auto' found checkpoints, but none loads ({', '.join(resumable[-3:])}"
                    "; see the warnings above). Starting from step 0 would overwrite them: "
                    "restore a good file, delete the bad ones, or use a new work_dir."
                )
            return  # nothing to resume: a fresh run
        path, saved = found
    else:
        path, saved = mode, ckpt.read(mode)
    check_fits(loop, saved, str(path))
    loop.load(saved, source=str(path))
    loop.resumed_from = path


def check_fits(loop: Any, saved: Any, source: str) -> None:
    """Raise before step 1 when ``saved`` does not fit the run: data size, optimizer, model."""
    from ftrain.persist.state import check_compatible

    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        return
    position = saved.get("loop") or {}
    want = position.get("data_len")
    try:
        have = len(loop.data)
    except TypeError:
        have = None
    same_world = int((saved.get("dist") or {}).get("world_size", 1)) == _dist.world_size()
    if want is not None and have and same_world and want != have:
        raise CheckpointError(
            f"{source} was written for data of {want} batches per epoch, and this run's data "
            f"has {have}: its data position and epoch count cannot continue. Resume with the "
            "same data, or start a new run in a new work_dir and load only the weights with "
            "ftrain.checkpoint.load_weights(model, path)."
        )
    state = saved["state"]
    sharded = saved.get("sharded_dir") is not None  # the model is in the shards
    check_compatible(loop.state, {**state, "model": None} if sharded else state, source)


def find_resumable(directory: str | os.PathLike) -> tuple[Path, Any] | None:
    """The newest checkpoint in ``directory`` that verifies and loads, and its contents.

    Example:
        >>> import tempfile
        >>> find_resumable(tempfile.mkdtemp()) is None
        True
    """
    import torch

    return Checkpointer(torch.nn.Module()).find([Path(directory)])
