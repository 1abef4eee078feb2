"""Export weights to safetensors: a ``TrainState``, a model or a checkpoint, its own or its EMA.

Public as :func:`ftrain.checkpoint.export_weights`. What is written is the unwrapped model's
``state_dict()`` (no ``module.`` or ``_orig_mod.``), gathered whole under FSDP2, written by
rank 0; with ``ema=True`` the same names hold the average :func:`ftrain.with_ema` keeps.
Files and directories are laid out by :mod:`ftrain.persist.safetensors_files`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from ftrain import dist as _dist
from ftrain._checks import flag
from ftrain.errors import CheckpointError
from ftrain.persist.files import commit_atomic, fsync_dir, write_bytes_atomic
from ftrain.persist.location import Location, StoreURL, as_location
from ftrain.persist.safetensors_files import (
    DEFAULT_MAX_SHARD_SIZE,
    dedupe_shared,
    parse_size,
    write_directory,
    write_file,
)
from ftrain.persist.state import to_saved
from ftrain.state import TrainState

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["export_weights", "tied_names"]

Source = TrainState | torch.nn.Module | str | os.PathLike | StoreURL | Mapping[str, torch.Tensor]


def export_weights(
    source: Source,
    path: str | os.PathLike | StoreURL,
    *,
    ema: bool = False,
    config: PretrainedConfig | Mapping[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write the weights of ``source`` as safetensors; returns the files written (rank 0's).

    ``source`` and ``path`` may be URLs on an object store (``s3://...``; a
    :class:`~ftrain.persist.location.StoreURL` for its ``storage_options``): the files are
    written in the local staging area, then uploaded (the index and config last), and their
    URLs returned.

    ``source``: a ``TrainState`` or a model (plain, compiled, DDP, FSDP2), a checkpoint
    ftrain wrote (``iter_6.pth``, FSDP2's ``iter_6.dcp``), a ``state_dict`` file or a dict of
    tensors. ``ema=True``: the average of :func:`ftrain.with_ema`, under the model's names.

    ``path`` ending in ``.safetensors``: that one file. Otherwise a directory laid out as
    Hugging Face's ``save_pretrained`` does: ``model.safetensors``, or above
    ``max_shard_size`` (``"50GB"``, transformers' default) shards
    ``model-00001-of-00002.safetensors``... and ``model.safetensors.index.json``; plus
    ``config.json`` from ``config`` (a transformers config or a dict) or, for a transformers
    model, from its ``model.config``: ``AutoModelForCausalLM.from_pretrained(path)`` loads it.

    A tied weight (one tensor under several names) is written once, under its first name
    in ``state_dict()`` order. Each file is written atomically, the index last. Under
    ``torchrun`` call it on every rank (a live FSDP2 model is gathered to rank 0's CPU, a
    collective); rank 0 writes, the files exist on every rank's return, and a failure is
    raised on every rank.

    Example:
        >>> import tempfile, os, torch, ftrain, safetensors.torch
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> out = os.path.join(tempfile.mkdtemp(), "export")
        >>> [p.name for p in ftrain.checkpoint.export_weights(state, out)]
        ['model.safetensors']
        >>> safetensors.torch.load_file(f"{out}/model.safetensors")["weight"].shape
        torch.Size([1, 2])
    """
    flag("export_weights: ema", ema)
    target = as_location(path) if isinstance(path, (str, StoreURL)) else path
    if isinstance(target, StoreURL):
        return _export_to_store(source, target, ema, config, max_shard_size, metadata)
    path, single = _target(path, config, max_shard_size)
    live = isinstance(source, (TrainState, torch.nn.Module))
    if live:  # a collective under FSDP2; the others are read by rank 0 only
        weights, aliases, found = _live_weights(source, ema)
        config = config if config is not None else found

    def write() -> list[Path]:
        w, a = (weights, aliases) if live else _saved_weights(source, ema)
        return _write(w, a, path, single, config, max_shard_size, metadata)

    return _on_main(write)


def _export_to_store(
    source: Source,
    url: StoreURL,
    ema: bool,
    config: Any,
    max_shard_size: int | str,
    metadata: Mapping[str, str] | None,
) -> list[StoreURL]:
    """:func:`export_weights` into the local staging area, then uploaded to ``url``."""
    from ftrain.persist.store import Staging, publish

    holder = Path(tempfile.mkdtemp(prefix="ftrain-export-", dir=Staging.base(url)))
    try:
        local = holder / (url.name or "export")
        written = export_weights(source, local, ema=ema, config=config,
                                 max_shard_size=max_shard_size, metadata=metadata)  # fmt: skip
        root = holder if local.suffix == ".safetensors" else local
        where = url.parent if local.suffix == ".safetensors" else url
        return _on_main(lambda: publish(written, root, where))
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def _target(path: str | os.PathLike, config: Any, max_shard_size: int | str) -> tuple[Path, bool]:
    """``(path, single_file)``, with the arguments checked before anything is gathered."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"export_weights: path must be a str or path, got {type(path).__name__}.")
    path = Path(path)
    parse_size(max_shard_size)
    single = path.suffix == ".safetensors"
    if single and config is not None:
        raise ValueError(
            f"export_weights: a config goes into a directory, beside the weights; {path} is "
            "one .safetensors file. Pass a directory path (e.g. 'exported/') to get config.json."
        )
    if not single and path.is_file():
        raise ValueError(
            f"export_weights: {path} is a file; pass a directory (Hugging Face layout) or a "
            "path ending in .safetensors (one file)."
        )
    if config is not None and not (isinstance(config, Mapping) or _is_hf_config(config)):
        raise TypeError(
            f"export_weights: config must be a transformers config or a dict, got "
            f"{type(config).__name__}."
        )
    return path, single


def _on_main(write: Callable[[], list[Path]]) -> list[Path]:
    """``write()`` on rank 0; its failure raised on every rank (none waits forever)."""
    if _dist.world_size() == 1:
        return write()
    written: list[Path] = []
    error: BaseException | None = None
    if _dist.is_main():
        try:
            written = write()
        except Exception as exc:
            error = exc
    failed = _dist.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"export_weights failed on rank 0: {failed}")
    return written


def _write(
    weights: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    path: Path,
    single: bool,
    config: Any,
    max_shard_size: int | str,
    metadata: Mapping[str, str] | None,
) -> list[Path]:
    kept, _ = dedupe_shared(weights, aliases)
    if single:
        return [write_file(kept, path, metadata=metadata)]
    path.mkdir(parents=True, exist_ok=True)
    written = write_directory(kept, path, max_shard_size=max_shard_size, metadata=metadata)
    if config is not None:
        written.append(_write_config(config, path))
    return written


# ------------------------------------------------------------------ live states and models
def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{name: first name}`` for each parameter or buffer ``model`` holds under several names.

    Example:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(4, 2), "out": torch.nn.Linear(2, 4)})
        >>> m["out"].weight = m["emb"].weight
        >>> tied_names(m)
        {'out.weight': 'emb.weight'}
    """
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    named = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, t in named:
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def _live_weights(source: TrainState | torch.nn.Module, ema: bool) -> tuple[dict, dict, Any]:
    """``(weights, aliases, transformers config or None)`` of a live state or model."""
    model = source.model if isinstance(source, TrainState) else source
    inner = _dist.unwrap(model)
    if ema and not isinstance(source, TrainState):
        raise ValueError(
            "export_weights(ema=True): the average lives in the TrainState "
            "(state.transforms['ema']); pass the state, not the model."
        )
    sharded = _dist.is_sharded(model)
    if not sharded and not _dist.is_main():
        return {}, {}, None  # DDP: rank 0 has it all
    aliases = tied_names(inner)
    if ema:
        keys = list(inner.state_dict(keep_vars=True))
        avg, part = _ema_of_state(source)
        if part:  # a bound step's average (a GAN's generator): the rest are the live weights
            avg = {**inner.state_dict(), **avg}
        weights = _onto_keys(avg, keys, aliases, "the state's average")
    elif sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(inner, options=options)  # whole, on rank 0 only
    else:
        weights = inner.state_dict()
    return weights, aliases, _hf_config_of(inner)


def _ema_of_state(state: TrainState) -> tuple[dict[str, torch.Tensor], bool]:
    """The average as ``{name: tensor}`` (FSDP2: gathered whole, a collective), and whether it
    is a bound step's (of the parameters of its optimizers alone)."""
    from ftrain.transforms.ema import ema_key

    key = ema_key(state.transforms)
    saved = state.transforms.get(key)
    if saved is None:
        raise ValueError(
            "export_weights(ema=True): this state has no weight average; build the step with "
            "ftrain.with_ema(step, decay=...) and run it (or step.init(state)) first."
        )
    module = to_saved(saved).get("module")
    if not isinstance(module, Mapping):
        raise CheckpointError(
            "export_weights(ema=True): the state's average was saved without its weights."
        )
    return dict(module), key != "ema"


def _onto_keys(
    avg: Mapping[str, torch.Tensor], keys: list[str], aliases: Mapping[str, str], what: str
) -> dict[str, torch.Tensor]:
    """The average under the model's ``state_dict`` names (a tied name shares its tensor)."""
    out: dict[str, torch.Tensor] = {}
    missing = []
    for key in keys:
        if key in avg:
            out[key] = avg[key]
        elif aliases.get(key) in avg:
            out[key] = avg[aliases[key]]
        else:
            missing.append(key)
    if missing:
        raise CheckpointError(
            f"export_weights(ema=True): {what} has no value for {missing[:5]} "
            f"({len(missing)} name(s) of the model's state_dict); it was made from another "
            "model. Export the weights (ema=False) or train with this model's average."
        )
    return out


def _is_hf_config(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(obj, transformers.PretrainedConfig)


def _hf_config_of(model: torch.nn.Module) -> Any:
    """A transformers model's ``config`` (None for other models)."""
    config = getattr(model, "config", None)
    return config if _is_hf_config(config) else None


def _write_config(config: Any, directory: Path) -> Path:
    """``config.json`` in ``directory``, atomically (written by transformers for its configs)."""
    target = directory / "config.json"
    if isinstance(config, Mapping):
        write_bytes_atomic(orjson.dumps(dict(config), option=orjson.OPT_INDENT_2), target)
        return target
    scratch = Path(tempfile.mkdtemp(prefix=".config.tmp-", dir=directory))
    try:
        config.save_pretrained(scratch)
        commit_atomic(scratch / "config.json", target, sync_dir=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    fsync_dir(directory)
    return target


# ------------------------------------------------------------------------ checkpoints
def _saved_weights(source: Any, ema: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(weights, aliases)`` of a dict of tensors or a checkpoint file or directory."""
    from ftrain.persist.weights import read_checkpoint_weights, view_aliases

    if isinstance(source, Mapping):
        if ema:
            raise ValueError(
                "export_weights(ema=True): a dict of tensors has no average; pass the "
                "TrainState or the checkpoint file."
            )
        weights = dict(source)
        return weights, view_aliases(weights)
    if not isinstance(source, (str, os.PathLike, StoreURL)):
        raise TypeError(
            "export_weights: source must be a TrainState, a model, a checkpoint path or a dict "
            f"of tensors, got {type(source).__name__}."
        )
    weights, saved = read_checkpoint_weights(source)
    aliases = view_aliases(weights)
    if ema:
        avg, part = _ema_of_checkpoint(as_location(source), saved)
        avg = {**weights, **avg} if part else avg  # a bound step's: the rest are the weights
        weights = _onto_keys(avg, list(weights), aliases, f"the average saved in {source}")
    return weights, aliases


def _ema_of_checkpoint(
    path: Location, saved: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], bool]:
    """The EMA saved in a loop checkpoint (DDP and FSDP2: in rank 0's own file), and whether
    it is a bound step's."""
    from ftrain.persist.manifest import RANK_MARK, Manifest
    from ftrain.persist.rundir import RunDir
    from ftrain.transforms.ema import ema_key

    state = saved.get("state") if isinstance(saved.get("state"), Mapping) else saved
    transforms = state.get("transforms") if isinstance(state, Mapping) else None
    if transforms is None and saved.get("rank_files"):
        d = RunDir(path.parent)
        own = f"{path.name}/rank0.pth" if d.is_dir(path.name) else f"{path.name}{RANK_MARK}0"
        entry = Manifest(d, main=False, rebuild=False).entry(path.name) or {}
        infos = entry.get("rank_files") or [None]
        transforms = d.load(own, expected=infos[0]).get("transforms")
    key = ema_key(transforms or {})
    ema = (transforms or {}).get(key)
    module = ema.get("module") if isinstance(ema, Mapping) else None
    if not isinstance(module, Mapping):
        raise CheckpointError(
            f"export_weights(ema=True): {path} holds no weight average (the run had no "
            "ftrain.with_ema in its step). Export its weights with ema=False."
        )
    return dict(module), key != "ema"
