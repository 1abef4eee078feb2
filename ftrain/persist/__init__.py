"""Persistence: how runs are saved and loaded (one home for it; names load on first use).

``files`` (atomic writes, checksums), ``manifest``, ``writer`` (background writes),
``lock``, ``rng``, ``state`` (a ``TrainState`` as a dict, and back), ``checkpointer``
(one process, DDP or FSDP2), ``resume`` (the run protocol), ``weights``.

Example:
    >>> import ftrain.persist as persist
    >>> persist.Manifest.__name__
    'Manifest'
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "files": "save_atomic stage_atomic commit_atomic write_bytes_atomic clean_temporaries "
    "load_file verify_file",
    "manifest": "Manifest MANIFEST",
    "writer": "AsyncWriter to_host wait_for_writes",
    "lock": "RunLock",
    "rng": "capture_rng restore_rng",
    "checkpointer": "Checkpointer sharded_name SHARDED_SUFFIX META_FILE load_checkpoint",
    "resume": "open_run close_run find_resumable checkpointer_of resume_mode",
    "state": "state_dict load_state_dict",
    "agree": "agree_to_save",
    "weights": "load_weights load_sharded_weights",
}
_NAMES = {name: module for module, names in _MODULES.items() for name in names.split()}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'ftrain.persist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ftrain.persist.{_NAMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
