"""Persistence: how runs are saved and loaded (one home for it).

``files`` (atomic writes, checksums), ``manifest`` (a directory's files),
``writer`` (background writes), ``lock`` (one run per directory), ``rng``,
``state`` (a ``TrainState`` as a dict, and back), ``checkpointer`` (one
process, DDP or FSDP2), ``resume`` (the run protocol), ``weights`` (weights
only). Hooks decide *when* to save, the :class:`Checkpointer` *how*. Names
load on first use, so ``import ftrain`` stays cheap.

Example:
    >>> import ftrain.persist as persist
    >>> persist.Manifest.__name__
    'Manifest'
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    **dict.fromkeys(
        ["save_atomic", "stage_atomic", "commit_atomic", "write_bytes_atomic"], "files"
    ),
    **dict.fromkeys(["clean_temporaries", "load_file", "verify_file"], "files"),
    "Manifest": "manifest",
    "MANIFEST": "manifest",
    "AsyncWriter": "writer",
    "to_host": "writer",
    "wait_for_writes": "writer",
    "RunLock": "lock",
    "capture_rng": "rng",
    "restore_rng": "rng",
    "Checkpointer": "checkpointer",
    "sharded_name": "checkpointer",
    "SHARDED_SUFFIX": "checkpointer",
    "META_FILE": "checkpointer",
    **dict.fromkeys(["open_run", "close_run", "find_resumable", "checkpointer_of"], "resume"),
    "resume_mode": "resume",
    "load_checkpoint": "checkpointer",
    "state_dict": "state",
    "load_state_dict": "state",
    "agree_to_save": "agree",
    "load_weights": "weights",
    "load_sharded_weights": "weights",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'ftrain.persist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ftrain.persist.{_NAMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
