"""Saving and loading: the public names (they live in :mod:`ftrain.persist`).

``CheckpointHook(keep=...)`` takes a retention policy: ``keep_latest(k) | keep_every(n) |
keep_best(k, metric)`` (:mod:`ftrain.hooks.keep`); ``save_every=every_minutes(T)`` saves by
wall time. ``export_weights`` writes safetensors files and Hugging Face directories (``safetensors``
is imported when it runs: ``pip install 'ftrain[export]'``); ``load_weights`` reads them.

Example:
    >>> import torch, ftrain
    >>> m = torch.nn.Linear(2, 1)
    >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
    >>> saved = ftrain.checkpoint.state_dict(s)
    >>> ftrain.checkpoint.load_state_dict(s, saved).step
    0
"""

from __future__ import annotations

from ftrain._moved import moved
from ftrain.errors import CheckpointError
from ftrain.hooks.keep import keep_any, keep_best, keep_every, keep_latest
from ftrain.hooks.wallclock import every_minutes
from ftrain.persist.checkpointer import load_checkpoint
from ftrain.persist.export import export_weights
from ftrain.persist.resume import find_resumable
from ftrain.persist.state import load_state_dict, state_dict
from ftrain.persist.weights import load_sharded_weights, load_weights

__all__ = [
    "state_dict",
    "load_state_dict",
    "load_weights",
    "export_weights",
    "load_sharded_weights",
    "load_checkpoint",
    "find_resumable",
    "CheckpointError",
    # which checkpoints a CheckpointHook keeps, and a save trigger by wall time
    "keep_latest",
    "keep_every",
    "keep_best",
    "keep_any",
    "every_minutes",
]

# Names ftrain.checkpoint exported before issue 21: the saver's own parts.
_MOVED = {
    "Manifest": "ftrain.persist.manifest",
    "save_atomic": "ftrain.persist.files",
    "capture_rng": "ftrain.persist.rng",
    "restore_rng": "ftrain.persist.rng",
}


def __getattr__(name: str):
    raise moved("ftrain.checkpoint", name, _MOVED)
