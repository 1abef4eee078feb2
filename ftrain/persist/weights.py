"""Weights only (fine-tuning): from an ftrain checkpoint, a sharded directory, a state dict,
a ``.safetensors`` file or a Hugging Face directory."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ftrain._checks import flag
from ftrain._tensors import local_tensor
from ftrain.dist import unwrap
from ftrain.errors import CheckpointError
from ftrain.persist.dcp_io import dcp_reader, dcp_storage
from ftrain.persist.location import Location, StoreURL, as_location

__all__ = [
    "load_weights",
    "load_sharded_weights",
    "read_checkpoint_weights",
    "read_sharded_model",
    "view_aliases",
]

_SHOWN = 8  # names listed in an error message


def _names(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{keys[:_SHOWN]}{more}"


def load_weights(
    model: torch.nn.Module,
    path: str | os.PathLike | StoreURL,
    *,
    strict: bool = False,
    prefix: str = "",
) -> tuple[list[str], list[str]]:
    """Load only model weights: an ftrain checkpoint, a state dict, a ``.safetensors`` file or
    a Hugging Face directory (``model.safetensors``, or shards with their index); a local
    path or a URL on an object store (``s3://...``).

    A sharded (FSDP2, ``.dcp``) directory works too, in one process or many. Returns
    ``(missing_keys, unexpected_keys)``; ``strict=True`` raises a
    :class:`~ftrain.errors.CheckpointError` naming them, before anything is loaded. A name
    the file lacks because it is tied to one it has (safetensors stores a tied weight once)
    is not missing. ``prefix`` strips a leading key prefix (e.g. ``"module."``); wrapped
    or compiled models are unwrapped first. A shape that differs is an error naming it.

    Example:
        >>> import tempfile, os, torch
        >>> from ftrain.persist.files import save_atomic
        >>> p = os.path.join(tempfile.mkdtemp(), "w.pth")
        >>> _ = save_atomic(torch.nn.Linear(2, 1).state_dict(), p)
        >>> load_weights(torch.nn.Linear(2, 1), p)
        ([], [])
    """
    flag("load_weights: strict", strict)
    from ftrain.persist.state import strip_wrapper_prefixes

    if _is_safetensors(path):
        weights = _read_safetensors(path)
    else:
        from ftrain.persist.checkpointer import load_checkpoint

        saved = load_checkpoint(path)
        if isinstance(saved, Mapping) and saved.get("sharded_dir"):  # FSDP2: the DCP shards
            return load_sharded_weights(model, saved["sharded_dir"], strict=strict)
        weights = model_weights_of(saved)
    if prefix:
        weights = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in weights.items()}
    inner = unwrap(model)
    weights = strip_wrapper_prefixes(weights, inner.state_dict().keys())
    missing, unexpected = _check_fit(inner, weights, path, strict)
    inner.load_state_dict({k: v for k, v in weights.items() if k not in unexpected}, strict=False)
    return missing, unexpected


def _is_safetensors(path: str | os.PathLike | StoreURL) -> bool:
    """Whether ``path`` (a URL too) is a ``.safetensors`` file or a directory holding one."""
    from ftrain.persist.safetensors_files import INDEX_NAME, WEIGHTS_NAME, is_safetensors

    where = as_location(path)
    if not isinstance(where, StoreURL):
        return is_safetensors(where)
    from ftrain.persist.rundir import RunDir

    if where.name.endswith(".safetensors"):
        return True
    d = RunDir(where)
    return d.exists(WEIGHTS_NAME) or d.exists(INDEX_NAME)


def _read_safetensors(path: str | os.PathLike | StoreURL) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file or directory; on a store, read from a local copy."""
    from ftrain.persist.safetensors_files import read_weights

    where = as_location(path)
    if not isinstance(where, StoreURL):
        return read_weights(where)
    from ftrain.persist.store import fetch

    with fetch(where) as local:
        return read_weights(local)


def _check_fit(
    model: torch.nn.Module, weights: Mapping[str, Any], path: Any, strict: bool
) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` names (a name tied to a loaded one is not missing); raises on
    a shape mismatch, and with ``strict`` on any missing or unexpected name."""
    own = model.state_dict(keep_vars=True)
    aliases = view_aliases(own)  # later name -> the first name of its tensor
    loaded = {aliases.get(k, k) for k in weights}  # the tensors the file gives, by first name
    missing = [k for k in own if k not in weights and aliases.get(k, k) not in loaded]
    unexpected = [k for k in weights if k not in own]
    shapes = [
        f"{k}: saved {tuple(v.shape)}, model {tuple(own[k].shape)}"
        for k, v in weights.items()
        if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape
    ]
    if shapes:
        raise CheckpointError(
            f"{path}: weights of another shape than the model's: {_names(shapes)}. Build the "
            "model with the configuration the weights were trained with."
        )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path} does not match the model: missing {_names(missing)} ({len(missing)}), "
            f"unexpected {_names(unexpected)} ({len(unexpected)}). Nothing was loaded. Pass "
            "prefix= to strip a leading name part (e.g. 'model.'), or strict=False to load "
            "the names that match."
        )
    return missing, unexpected


def model_weights_of(saved: Any) -> dict[str, Any]:
    """The model weights in what a checkpoint file held: a loop checkpoint, a
    ``TrainState`` dict, ``{"model": ...}``, ``{"state_dict": ...}`` or a state dict."""
    if isinstance(saved, Mapping) and "state" in saved and "model" in saved["state"]:
        weights = saved["state"]["model"]
    elif isinstance(saved, Mapping) and "model" in saved and isinstance(saved["model"], Mapping):
        weights = saved["model"]
    elif isinstance(saved, Mapping) and "state_dict" in saved:
        weights = saved["state_dict"]
    else:
        weights = saved
    if not isinstance(weights, Mapping):
        raise CheckpointError(
            f"The checkpoint holds a {type(weights).__name__}, not model weights (a dict of "
            "tensors, or an ftrain checkpoint)."
        )
    return dict(weights)


def view_aliases(weights: Mapping[str, Any]) -> dict[str, str]:
    """``{name: first name}`` for tensors that are the same view of one storage (tied weights).

    Example:
        >>> import torch
        >>> w = torch.ones(2)
        >>> view_aliases({"a": w, "b": w, "c": w.clone()})
        {'b': 'a'}
    """
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = local_tensor(t)  # a DTensor: its shard
        if t.device.type == "meta" or not t.numel():
            continue
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def read_sharded_model(path: str | os.PathLike | Location) -> dict[str, torch.Tensor]:
    """The whole model weights of a sharded (FSDP2, ``.dcp``) directory, read by this one
    process (no collective; under ``torchrun`` any one rank may call it).

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from ftrain.persist.checkpointer import dcp_call
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = dcp_call("save", {"model": {"w": torch.ones(2)}}, d)
        >>> read_sharded_model(d)
        {'w': tensor([1., 1.])}
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = as_location(path)
    entries = dcp_reader(path).read_metadata().state_dict_metadata
    model: dict[str, torch.Tensor] = {}
    for key, meta in entries.items():
        if not key.startswith("model."):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{path}: the model entry {key!r} is not a tensor.")
        model[key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, no_dist=True, **dcp_storage("load", path))
    return model


def read_checkpoint_weights(
    path: str | os.PathLike | StoreURL,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(weights, saved)``: a checkpoint's model weights (read whole, in this process) and
    what its file held (a sharded directory's ``ftrain.pth``), verified on the way."""
    from ftrain.persist.checkpointer import load_checkpoint

    if _is_safetensors(path):
        return _read_safetensors(path), {}
    saved = load_checkpoint(path)
    if isinstance(saved, Mapping) and saved.get("sharded_dir"):
        return read_sharded_model(saved["sharded_dir"]), dict(saved)
    return model_weights_of(saved), dict(saved) if isinstance(saved, Mapping) else {}


def load_sharded_weights(
    model: torch.nn.Module, path: str | os.PathLike | Location, *, strict: bool = False
) -> tuple[list[str], list[str]]:
    """Load only the model weights of a sharded checkpoint directory (plain, DDP or FSDP2 model)."""
    flag("load_sharded_weights: strict", strict)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from ftrain.persist.checkpointer import dcp_call

    path = as_location(path)
    saved_keys = {
        key[len("model.") :]
        for key in dcp_reader(path).read_metadata().state_dict_metadata
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
