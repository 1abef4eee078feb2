"""The resume protocol (before step 1): each checkpoint directory's manifest first takes in
the files newer than it (a restored older copy, a save cut off before it was recorded); a
fresh run refuses a directory holding another run's checkpoints; ``resume="auto"`` takes
the newest checkpoint (by step) that verifies in the run's checkpoint directories
(``work_dir`` and the checkpoint hooks' ``out_dir``; bad files skipped with a warning;
files but none loading is an error, never a silent restart); the checkpoint is checked to
fit the run before the loop loads it; then the run's orphans (files a kill left that no
manifest lists) are deleted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrain import dist as _dist
from ftrain.errors import CheckpointError
from ftrain.persist.checkpointer import Checkpointer
from ftrain.persist.location import Location, StoreURL, as_location
from ftrain.persist.manifest import Manifest
from ftrain.persist.rundir import RunDir
from ftrain.state import TrainState

__all__ = ["find_start", "check_fits", "resume_mode", "find_resumable", "collect_orphans"]


def _files(dirs: Sequence[Location]) -> list[str]:
    """The checkpoint files the manifests of ``dirs`` name that exist, with the files newer
    than a manifest taken in (every rank sees the same, whether rank 0 wrote it yet or not)."""
    out = []
    for d in map(RunDir, dirs):
        if d.is_dir():
            m = Manifest(d, main=False)
            m.reconcile(warn=False)
            out += [str(d.local(e["name"])) for e in m.entries if d.exists(e["name"])]
    return out


def resume_mode(resume: Any, work_dir: Any) -> str | Location | None:
    """``resume=`` as ``None`` (fresh run), ``"auto"`` (any case, or ``True``) or a path (or
    a URL on an object store).

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
    if not isinstance(resume, (str, os.PathLike, StoreURL)):
        raise TypeError(f"resume={resume!r} is not understood: {valid}.")
    path = as_location(resume)
    if not RunDir(path.parent).exists(path.name):
        shown = path.resolve() if isinstance(path, Path) else path
        raise CheckpointError(f"resume={str(resume)!r}: no checkpoint at {shown}; {valid}.")
    if RunDir(path.parent).is_dir(path.name) and not _is_sharded(path):
        raise CheckpointError(f"resume={str(resume)!r} is a directory, not a checkpoint: "
                              + _run_dir_hint(path))  # fmt: skip
    return path


def _is_sharded(path: Location) -> bool:
    """Whether the directory ``path`` is a sharded (``.dcp``) checkpoint, even a torn one."""
    from ftrain.persist.checkpointer import META_FILE, SHARDED_SUFFIX

    d = RunDir(path)
    return path.name.endswith(SHARDED_SUFFIX) or d.exists(META_FILE) or d.exists(".metadata")


def _run_dir_hint(path: Location) -> str:
    """How to resume from the run directory ``path`` (or that it holds no checkpoint)."""
    d = RunDir(path)
    names = [e["name"] for e in Manifest(d, main=False, rebuild=False).resumable()]
    names = names or [n for n in d.checkpoint_names() if not n.startswith("best_")]
    if not names:
        return f"{path} holds no ftrain checkpoint. Pass a checkpoint file's path, or None."
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"{path} is a run directory ({shown}). To continue its newest good "
        f"checkpoint, pass work_dir={str(path)!r} and resume='auto'; to start from one "
        f"file, pass its path (resume={str(path / names[0])!r})."
    )


def reconcile(dirs: Sequence[Location]) -> None:
    """Rank 0: each directory's manifest takes in the checkpoints newer than it, with a
    warning, and is written (no collective: the other ranks take them in as they read)."""
    if _dist.rank() == 0:
        for d in map(RunDir, dirs):
            if d.is_dir():
                Manifest(d, rebuild=False).reconcile()


def collect_orphans(dirs: Sequence[Location], run_id: str) -> list[str]:
    """Rank 0: delete the checkpoints of run ``run_id`` in ``dirs`` that no manifest lists
    (a kill between a manifest write and its deletes); returns their paths.

    Example:
        >>> import tempfile
        >>> collect_orphans([Path(tempfile.mkdtemp())], "r1")
        []
    """
    gone: list[str] = []
    if _dist.rank() == 0:
        for d in map(RunDir, dirs):
            if d.is_dir():
                gone += [str(d.local(n)) for n in Manifest(d, rebuild=False).collect(run_id)]
    return gone


def find_start(
    ckpt: Checkpointer, dirs: Sequence[Location], mode: str | Location | None
) -> tuple[Location, dict[str, Any]] | None:
    """The checkpoint a run starts from (``mode``: :func:`resume_mode`'s), read for this rank;
    ``None``: a fresh start. ``dirs``: the run's checkpoint directories."""
    reconcile(dirs)
    if mode is None:
        others = _files(dirs)  # every rank sees the same directory: all raise, or none
        if others:
            raise CheckpointError(
                f"{others[0].rsplit('/', 1)[0]} holds checkpoints of another run "
                f"({', '.join(Path(o).name for o in others[-3:])}); a fresh run (resume=None) "
                "would overwrite files of the same names. Pass resume='auto' to continue that "
                "run, or a new work_dir for a new one (or delete those files first)."
            )
        return None
    if mode != "auto":
        return as_location(mode), ckpt.read(mode)
    found = ckpt.find(dirs)
    if found is None:
        resumable = [n for n in _files(dirs) if not Path(n).name.startswith("best_")]
        if resumable:
            raise CheckpointError(
                f"resume='auto' found checkpoints, but none loads ({', '.join(resumable[-3:])}"
                "; see the warnings above). Starting from step 0 would overwrite them: "
                "restore a good file, delete the bad ones, or use a new work_dir."
            )
    return found  # None: nothing to resume, a fresh run


def check_fits(state: TrainState, batches_per_epoch: int | None, saved: Any, source: str) -> None:
    """Raise before step 1 when ``saved`` does not fit the run: data size, optimizer, model."""
    from ftrain.persist.state import check_compatible

    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        return
    position = saved.get("loop") or {}
    want, have = position.get("data_len"), batches_per_epoch
    same_world = int((saved.get("dist") or {}).get("world_size", 1)) == _dist.world_size()
    if want is not None and have and same_world and want != have:
        raise CheckpointError(
            f"{source} was written for data of {want} batches per epoch, and this run's data "
            f"has {have}: its data position and epoch count cannot continue. Resume with the "
            "same data, or start a new run in a new work_dir and load only the weights with "
            "ftrain.checkpoint.load_weights(model, path)."
        )
    sharded = saved.get("sharded_dir") is not None  # the model is in the shards
    check_compatible(
        state, {**saved["state"], "model": None} if sharded else saved["state"], source
    )


def find_resumable(directory: str | os.PathLike | StoreURL) -> tuple[Location, Any] | None:
    """The newest checkpoint in ``directory`` (a path, or a URL on an object store) that
    verifies and loads, and its contents.

    Example:
        >>> import tempfile
        >>> find_resumable(tempfile.mkdtemp()) is None
        True
    """
    import torch

    return Checkpointer(torch.nn.Module()).find([as_location(directory)])
