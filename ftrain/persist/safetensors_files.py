"""safetensors files and Hugging Face weight directories: written atomically, read back whole.

A directory is laid out as ``save_pretrained`` lays it out: ``model.safetensors``, or, above
``max_shard_size``, ``model-00001-of-00003.safetensors``... with ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), split by Hugging Face's
rule (tensors in order; a new shard when the next one would overflow; a tensor larger than
the limit alone in its own). safetensors stores no aliasing: names of one tensor (tied
weights) are written once, under the first name (:func:`dedupe_shared`).

safetensors is an optional dependency (``pip install 'ftrain[export]'``): it is imported
when a file is written or read.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import torch

from ftrain.errors import CheckpointError
from ftrain.persist.files import commit_atomic, tmp_path, write_bytes_atomic

__all__ = [
    "WEIGHTS_NAME",
    "INDEX_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "parse_size",
    "dedupe_shared",
    "plan_shards",
    "write_file",
    "write_directory",
    "read_weights",
    "is_safetensors",
]

#: The single-file name ``from_pretrained`` looks for.
WEIGHTS_NAME = "model.safetensors"
#: The index of a sharded directory.
INDEX_NAME = "model.safetensors.index.json"
#: ``save_pretrained``'s default in transformers 5 (it was "5GB" in transformers 4).
DEFAULT_MAX_SHARD_SIZE = "50GB"
#: safetensors' own header key ``transformers`` checks: ``{"format": "pt"}``.
FORMAT_METADATA = {"format": "pt"}

_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _safetensors_torch() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "Writing and reading .safetensors files needs the safetensors package: "
            "pip install 'ftrain[export]' (or pip install safetensors)."
        ) from exc
    return safetensors.torch


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or Hugging Face's ``"5GB"``, ``"500MB"``, ``"10KB"`` (10**n).

    Example:
        >>> parse_size("5GB"), parse_size("1.5MB"), parse_size(1000)
        (5000000000, 1500000, 1000)
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str) and size.strip()[-2:].upper() in _UNITS:
        with contextlib.suppress(ValueError):
            value = int(float(size.strip()[:-2]) * _UNITS[size.strip()[-2:].upper()])
            if value > 0:
                return value
    raise ValueError(
        f"max_shard_size must be a number of bytes > 0 or a size like '5GB', '500MB' "
        f"(TB, GB, MB, KB: powers of 10, as Hugging Face), got {size!r}."
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def dedupe_shared(
    weights: Mapping[str, torch.Tensor], aliases: Mapping[str, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``weights`` as safetensors can store them, and ``{dropped name: kept name}``.

    A tensor reachable under several names (tied weights: the same storage, offset, shape,
    stride and dtype, or a name in ``aliases``, ``{alias: name}``) is kept once, under its
    first name in ``weights``' order; other views of a storage another tensor uses are
    copied, and non-contiguous tensors made contiguous.

    Example:
        >>> import torch
        >>> emb = torch.nn.Embedding(4, 2)
        >>> kept, dropped = dedupe_shared({"emb.weight": emb.weight, "head.weight": emb.weight})
        >>> sorted(kept), dropped
        (['emb.weight'], {'head.weight': 'emb.weight'})
    """
    aliases = dict(aliases or {})
    first_of_view: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[Any, ...]] = set()
    kept: dict[str, torch.Tensor] = {}
    dropped: dict[str, str] = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights[{name!r}] is a {type(t).__name__}, not a tensor.")
        if aliases.get(name) in weights and aliases[name] != name:
            dropped[name] = aliases[name]
            continue
        t = t.detach()
        view = _view_key(t) if t.device.type != "meta" and t.numel() else None
        if view is not None and view in first_of_view:
            dropped[name] = first_of_view[view]
            continue
        storage = (t.device, t.untyped_storage().data_ptr()) if view is not None else None
        shares = storage in storages or (
            view is not None and t.untyped_storage().nbytes() != _nbytes(t)
        )
        if shares or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        if view is not None:
            first_of_view[view] = name
            storages.add(storage)
        kept[name] = t
    return kept, dropped


def plan_shards(weights: Mapping[str, torch.Tensor], max_shard_size: int | str) -> list[list[str]]:
    """The names in each shard, by Hugging Face's rule (``split_torch_state_dict_into_shards``).

    Example:
        >>> import torch
        >>> w = {"a": torch.zeros(2), "b": torch.zeros(8), "c": torch.zeros(2)}  # 8, 32, 8 bytes
        >>> plan_shards(w, 20)
        [['b'], ['a', 'c']]
    """
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in weights.items():
        n = _nbytes(t)
        if n > limit:  # alone, in a shard of its own, placed now
            shards.append([name])
            continue
        if size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def _commit_file(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``save_file`` to a temporary beside ``path``, ``fsync``, rename."""
    st = _safetensors_torch()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        st.save_file(dict(tensors), str(tmp), metadata=metadata)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    commit_atomic(tmp, path)


def _metadata(extra: Mapping[str, str] | None) -> dict[str, str]:
    out = {**FORMAT_METADATA, **dict(extra or {})}
    bad = {k: v for k, v in out.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"safetensors metadata must map str to str, got {bad!r}.")
    return out


def write_file(
    weights: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``weights`` (:func:`dedupe_shared`) to one ``.safetensors`` file, atomically.

    Example:
        >>> import tempfile, os, torch, safetensors.torch
        >>> p = write_file({"w": torch.ones(2)}, os.path.join(tempfile.mkdtemp(), "w.safetensors"))
        >>> safetensors.torch.load_file(p)["w"]
        tensor([1., 1.])
    """
    kept, _ = dedupe_shared(weights)
    path = Path(path)
    _commit_file(kept, path, _metadata(metadata))
    return path


def _stale(directory: Path, written: set[str]) -> list[Path]:
    """Weight files of an earlier export in ``directory`` that this one did not write."""
    names = [WEIGHTS_NAME, INDEX_NAME]
    found = [p for p in directory.iterdir() if p.name in names or _SHARD_RE.fullmatch(p.name)]
    return [p for p in found if p.name not in written and p.is_file()]


def write_directory(
    weights: Mapping[str, torch.Tensor],
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``weights`` as ``save_pretrained`` does: one file or shards with their index.

    Each file is written atomically; the index (the commit point of a sharded export) last.
    Then the weight files of an earlier export there that this one did not write (an old
    ``model.safetensors``, shards of another count) are deleted; nothing else is.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> files = write_directory({"a": torch.ones(4), "b": torch.ones(4)}, d, max_shard_size=16)
        >>> [p.name for p in files]  # doctest: +NORMALIZE_WHITESPACE
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors',
         'model.safetensors.index.json']
    """
    kept, _ = dedupe_shared(weights)
    meta = _metadata(metadata)
    directory = Path(directory)
    shards = plan_shards(kept, max_shard_size)
    if len(shards) == 1:
        _commit_file(kept, directory / WEIGHTS_NAME, meta)
        written = [directory / WEIGHTS_NAME]
    else:
        written, weight_map = [], {}
        for i, names in enumerate(shards):
            path = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _commit_file({n: kept[n] for n in names}, path, meta)
            weight_map.update(dict.fromkeys(names, path.name))
            written.append(path)
        total = sum(_nbytes(t) for t in kept.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_bytes_atomic(orjson.dumps(index, option=orjson.OPT_INDENT_2), directory / INDEX_NAME)
        written.append(directory / INDEX_NAME)
    for old in _stale(directory, {p.name for p in written}):
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    return written


def is_safetensors(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``.safetensors`` file or a directory holding one (or an index).

    Example:
        >>> is_safetensors("model.safetensors"), is_safetensors("iter_4.pth")
        (True, False)
    """
    path = Path(path)
    if path.is_dir():
        return (path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()
    return path.suffix == ".safetensors"


def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"Weights file {path} does not exist.")
    try:
        return _safetensors_torch().load_file(str(path))
    except ImportError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{path} cannot be read as a safetensors file ({type(exc).__name__}: {exc}): it is "
            "truncated, corrupt or of another format. Export it again."
        ) from exc


def _read_index(directory: Path) -> dict[str, str]:
    index_path = directory / INDEX_NAME
    try:
        weight_map = orjson.loads(index_path.read_bytes())["weight_map"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index_path} is not a readable index ({type(exc).__name__}: {exc}); it should be "
            '{"metadata": {...}, "weight_map": {name: file}}. Export the weights again.'
        ) from exc
    missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
    if missing:
        raise CheckpointError(
            f"{index_path} lists shard(s) {missing} that are not in {directory}: the export was "
            "interrupted or files were removed. Export the weights again."
        )
    return weight_map


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file or a Hugging Face directory (sharded or not).

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> _ = write_directory({"a": torch.ones(4), "b": torch.zeros(4)}, d, max_shard_size=16)
        >>> sorted(read_weights(d))
        ['a', 'b']
    """
    path = Path(path)
    if not path.is_dir():
        return _load(path)
    if (path / INDEX_NAME).is_file():
        weight_map = _read_index(path)
        out: dict[str, torch.Tensor] = {}
        for file in dict.fromkeys(weight_map.values()):
            shard = _load(path / file)
            out.update({k: v for k, v in shard.items() if weight_map.get(k) == file})
        absent = sorted(k for k, f in weight_map.items() if k not in out)
        if absent:
            raise CheckpointError(
                f"{path / INDEX_NAME} maps {absent[:5]} ({len(absent)} name(s)) to shards that "
                "do not hold them. Export the weights again."
            )
        return out
    if (path / WEIGHTS_NAME).is_file():
        return _load(path / WEIGHTS_NAME)
    raise CheckpointError(
        f"{path} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}: not a Hugging Face weights "
        "directory. Pass the .safetensors file, or the directory export_weights wrote."
    )
