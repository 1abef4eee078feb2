"""Persistence: how runs are saved and loaded (one home for it).

============================  ==================================================
``persist.files``             atomic writes, checksums, verified reads
``persist.manifest``          ``manifest.json``: the files of a directory
``persist.writer``            the background writer (one save in flight)
``persist.lock``              one run per directory (``.ftrain.lock``)
``persist.rng``               random generator states (CUDA per device)
``persist.state``             a ``TrainState`` as a dict, and back (with checks)
``persist.checkpointer``      the Checkpointer: one process, DDP or FSDP2
``persist.resume``            the run protocol: lock, check, resume
``persist.weights``           weights only (fine-tuning)
============================  ==================================================

Hooks decide *when* to save; the run's :class:`Checkpointer` decides *how*.
Names load on first use, so ``import ftrain`` stays cheap.

Example:
    >>> import ftrain.persist as persist
    >>> persist.Manifest.__name__
    'Manifest'
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "save_atomic": "files",
    "stage_atomic": "files",
    "commit_atomic": "files",
    "write_bytes_atomic": "files",
    "clean_temporaries": "files",
    "load_file": "files",
    "verify_file": "files",
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
    "open_run": "resume",
    "close_run": "resume",
    "load_checkpoint": "checkpointer",
    "find_resumable": "resume",
    "checkpointer_of": "resume",
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
