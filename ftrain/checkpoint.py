"""Checkpoint files (kept for existing code): the names now live in :mod:`ftrain.persist`.

Example:
    >>> import ftrain.checkpoint, ftrain.persist.weights
    >>> ftrain.checkpoint.load_weights is ftrain.persist.weights.load_weights
    True
"""

from __future__ import annotations

from ftrain.errors import CheckpointError
from ftrain.persist.checkpointer import sharded_name
from ftrain.persist.files import (
    clean_temporaries,
    commit_atomic,
    save_atomic,
    stage_atomic,
    write_bytes_atomic,
)
from ftrain.persist.manifest import MANIFEST, Manifest
from ftrain.persist.resume import find_resumable, load_checkpoint
from ftrain.persist.weights import load_sharded_weights, load_weights
from ftrain.persist.writer import AsyncWriter, wait_for_writes

#: The old name of :class:`~ftrain.persist.writer.AsyncWriter`.
BackgroundWriter = AsyncWriter

__all__ = [
    "CheckpointError",
    "save_atomic",
    "stage_atomic",
    "commit_atomic",
    "write_bytes_atomic",
    "clean_temporaries",
    "AsyncWriter",
    "BackgroundWriter",
    "sharded_name",
    "load_sharded_weights",
    "wait_for_writes",
    "load_checkpoint",
    "load_weights",
    "Manifest",
    "find_resumable",
    "MANIFEST",
]
