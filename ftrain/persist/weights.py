"""Weights only (fine-tuning): from an ftrain checkpoint, a sharded directory or a state dict."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ftrain.dist import unwrap
from ftrain.errors import CheckpointError

__all__ = ["load_weights", "load_sharded_weights"]


def load_weights(
    model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = False, prefix: str = ""
) -> tuple[list[str], list[str]]:
    """Load only model weights, from an ftrain checkpoint or a state dict.

    A sharded (FSDP2, ``.dcp``) directory works too, in one process or
    many. Returns ``(missing_keys, unexpected_keys)``; ``strict=True``
    raises on any. ``prefix`` strips a leading key prefix (e.g.
    ``"module."``); wrapped or compiled models are unwrapped first.

    Example:
        >>> import tempfile, os, torch
        >>> from ftrain.persist.files import save_atomic
        >>> p = os.path.join(tempfile.mkdtemp(), "w.pth")
        >>> _ = save_atomic(torch.nn.Linear(2, 1).state_dict(), p)
        >>> load_weights(torch.nn.Linear(2, 1), p)
        ([], [])
    """
    from ftrain.persist.checkpointer import load_checkpoint
    from ftrain.persist.state import strip_wrapper_prefixes

    saved = load_checkpoint(path)
    if isinstance(saved, Mapping) and saved.get("sharded_dir"):  # FSDP2: the DCP shards
        return load_sharded_weights(model, saved["sharded_dir"], strict=strict)
    if isinstance(saved, Mapping) and "state" in saved and "model" in saved["state"]:
        weights = saved["state"]["model"]
    elif isinstance(saved, Mapping) and "model" in saved and isinstance(saved["model"], Mapping):
        weights = saved["model"]
    elif isinstance(saved, Mapping) and "state_dict" in saved:
        weights = saved["state_dict"]
    else:
        weights = saved
    if prefix:
        weights = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()}
    inner = unwrap(model)
    weights = strip_wrapper_prefixes(weights, inner.state_dict().keys())
    result = inner.load_state_dict(weights, strict=strict)
    return list(result.missing_keys), list(result.unexpected_keys)


def load_sharded_weights(
    model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = False
) -> tuple[list[str], list[str]]:
    """Load only the model weights of a sharded checkpoint directory (plain, DDP or FSDP2 model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from ftrain.persist.checkpointer import dcp_call

    path = Path(path)
    saved_keys = {
        key[len("model.") :]
        for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if key.startswith("model.")
    }
    current = get_model_state_dict(model)
    missing = [k for k in current if k not in saved_keys]
    unexpected = sorted(saved_keys - set(current))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path}: the model's weights do not match (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); pass strict=False to load the ones that do."
        )
    target = {"model": {k: v for k, v in current.items() if k in saved_keys}}
    dcp_call("load", target, path)
    set_model_state_dict(model, target["model"], options=StateDictOptions(strict=False))
    return missing, unexpected
