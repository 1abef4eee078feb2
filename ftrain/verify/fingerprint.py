"""A run's fingerprint at one update: what an exact resume must reproduce, part by part.

Each part is a flat mapping from a key (a tensor's name, ``state.0.exp_avg``, ``metrics.jsonl
line 7``) to a value: a tensor, a number, a string or bytes. Parts are compared by digest
(BLAKE2b of every key and every value's bytes: bitwise), and a differing part is explained by
its first differing key and the largest difference there.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import orjson
import torch

from ftrain.checkpoint import state_dict
from ftrain.loop import Loop

__all__ = [
    "PARTS",
    "END",
    "VOLATILE",
    "Flat",
    "Fingerprint",
    "Summary",
    "capture",
    "summarize",
    "flatten",
    "digest",
    "difference",
]

#: The parts, in the order a divergence is blamed on: a cause before its consequences.
PARTS = (
    "data order",
    "RNG",
    "hook state",
    "transform state",
    "optimizer state",
    "weights",
    "log lines",
)
DATA, RNG, HOOKS, TRANSFORMS, OPTIMIZER, WEIGHTS, LOGS = PARTS
#: Not compared: the batches' values, kept to measure a data-order difference.
BATCHES = "batches"
#: The key of the fingerprint taken when the run has ended (after every update).
END = sys.maxsize
#: Keys (or key prefixes ending in ``/``) of log lines and hook state that measure the
#: machine, not training: wall-clock times, throughput, memory, and the logger's file size
#: (its lines hold times).
VOLATILE = (
    "time", "data_time", "compute_time", "iter_time", "elapsed", "eta", "perf/", "memory/",
    "jsonl_end",
)  # fmt: skip

Leaf = torch.Tensor | str | bytes | int | float | bool | None
Flat = dict[str, Leaf]
Fingerprint = dict[str, Flat]
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def flatten(obj: object, prefix: str = "") -> Flat:
    """``obj`` (nested mappings, lists, tensors, numbers) as one level, keys joined with ``.``.

    Example:
        >>> flatten({"state": {0: {"step": 3}}, "groups": [{"lr": 0.1}]})
        {'state.0.step': 3, 'groups.0.lr': 0.1}
    """
    out: Flat = {}
    _flatten(obj, prefix, out)
    return out


def _flatten(obj: object, key: str, out: Flat) -> None:
    if isinstance(obj, Mapping) or isinstance(obj, (list, tuple)):
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        empty = True
        for k, v in items:
            empty = False
            _flatten(v, f"{key}.{k}" if key else str(k), out)
        if empty and key:
            out[key] = repr(obj)
    elif isinstance(obj, torch.Tensor):
        out[key] = obj.detach()
    elif obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        out[key] = obj
    else:  # an object (a numpy array, a callable in a param group): by its repr
        out[key] = _ADDRESS.sub("", repr(obj))


def _leaf_bytes(value: Leaf) -> Iterable[bytes | memoryview]:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        yield f"tensor {t.dtype} {tuple(t.shape)}|".encode()
        yield memoryview(t.reshape(-1).view(torch.uint8).numpy())
    else:
        yield f"{type(value).__name__} {value!r}".encode()


def digest(flat: Flat) -> str:
    """A bitwise digest of ``flat``: every key and every value's bytes.

    Example:
        >>> import torch
        >>> digest({"w": torch.ones(2)}) == digest({"w": torch.ones(2)})
        True
        >>> digest({"w": torch.ones(2)}) == digest({"w": torch.ones(2).double()})
        False
    """
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(flat):
        h.update(key.encode() + b"\0")
        for chunk in _leaf_bytes(flat[key]):
            h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def _volatile(key: str, volatile: Iterable[str]) -> bool:
    last = key.rsplit(".", 1)[-1]
    return any(key.startswith(v) or last.startswith(v) if v.endswith("/") else last == v
               for v in volatile)  # fmt: skip


def _stable(flat: Flat, volatile: Iterable[str]) -> Flat:
    return {k: v for k, v in flat.items() if not _volatile(k, volatile)}


def read_logs(work_dir: Path | None, volatile: Iterable[str] = VOLATILE) -> Flat:
    """Every line of every ``*.jsonl`` file under ``work_dir``, without its volatile keys."""
    out: Flat = {}
    if work_dir is None or not Path(work_dir).is_dir():
        return out
    for path in sorted(Path(work_dir).rglob("*.jsonl")):
        name = path.relative_to(work_dir).as_posix()
        for i, raw in enumerate(path.read_bytes().splitlines(), 1):
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                out[f"{name} line {i}"] = raw.decode("utf-8", "replace")
                continue
            if isinstance(line, dict):
                line = {k: v for k, v in line.items() if not _volatile(k, volatile)}
            out[f"{name} line {i}"] = orjson.dumps(line, option=orjson.OPT_SORT_KEYS).decode()
    return out


def _hooks(loop: Loop, volatile: Iterable[str]) -> Flat:
    """Every stateful hook's ``state_dict()`` and the loop's running metric sums."""
    saved = {h.name: h.state_dict() for h in loop.hooks if h.stateful}
    totals = loop.totals
    saved["loop.totals"] = {
        "micro_batches": totals.micro_batches,
        "updates": totals.updates,
        "metric_sums": totals.metric_sums(),
    }
    return _stable(flatten(saved), volatile)


def _data(loop: Loop, batches: Mapping[int, object]) -> tuple[Flat, Flat]:
    """The position in the data and a digest of each micro-batch; and the batches' values."""
    s = loop.state
    position: Flat = {"epoch": s.epoch, "micro_step": s.micro_step}
    position["batch_in_epoch"] = loop.batch_in_epoch
    values: Flat = {}
    for micro, batch in batches.items():
        flat = flatten(batch, f"micro-batch {micro}")
        position[f"micro-batch {micro}"] = digest(flat)
        values.update(flat)
    return position, values


def capture(
    loop: Loop, batches: Mapping[int, object], volatile: Iterable[str] = VOLATILE
) -> Fingerprint:
    """The fingerprint of ``loop`` now (after an update): every part, and the update's batches.

    ``batches``: each micro-batch the update trained on, by micro-step. Reads only (the
    data loader's ``state_dict`` is not called: taking it can change a loader's order).
    """
    saved = state_dict(loop.state)
    weights = flatten(saved["model"])
    weights.update(flatten(saved["grads"], "grad"))
    data, values = _data(loop, batches)
    return {
        DATA: data,
        RNG: flatten(saved["rng"]),
        HOOKS: _hooks(loop, volatile),
        TRANSFORMS: flatten(saved["transforms"]),
        OPTIMIZER: flatten(saved["optimizer"] if "optimizer" in saved else saved["optimizers"]),
        WEIGHTS: weights,
        LOGS: read_logs(loop.work_dir, volatile),
        BATCHES: values,
    }


@attrs.frozen
class Summary:
    """One update of a run, small: each part's digest, and the data-order part itself."""

    digests: dict[str, str]
    data: dict[str, object]

    def differing(self, other: Summary, *, data_keys: Iterable[str] | None = None) -> list[str]:
        """The parts that differ from ``other``'s, cause first (``data_keys``: compare the data
        order on these keys only, what a process resumed in an accumulation window saw)."""
        parts = [p for p in PARTS if p != DATA and self.digests.get(p) != other.digests.get(p)]
        keys = self.data.keys() | other.data.keys() if data_keys is None else data_keys
        if any(self.data.get(k) != other.data.get(k) for k in keys):
            parts.insert(0, DATA)
        return parts


def summarize(fp: Fingerprint) -> Summary:
    """The :class:`Summary` of a full fingerprint."""
    return Summary({p: digest(fp[p]) for p in PARTS}, dict(fp[DATA]))


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[str, float | None]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}", None
    if a.dtype == torch.bool:
        n = int((a.cpu() != b.cpu()).sum())
        return f"{n} of {a.numel()} elements differ", float(n)
    x, y = a.detach().cpu().double(), b.detach().cpu().double()
    gap = torch.where(x.isnan() & y.isnan(), 0.0, (x - y).abs())
    m = float(gap.max()) if gap.numel() else 0.0
    return ("NaN in one run only" if math.isnan(m) else f"max difference {m:.3g}"), m


def _json_difference(a: str, b: str) -> tuple[str, float | None] | None:
    try:
        x, y = orjson.loads(a), orjson.loads(b)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(x, dict) and isinstance(y, dict)):
        return None
    for k in [*x, *(k for k in y if k not in x)]:
        if x.get(k) != y.get(k):
            u, v = x.get(k), y.get(k)
            if isinstance(u, (int, float)) and isinstance(v, (int, float)):
                return f"{k!r}: {u!r} vs {v!r} (max difference {abs(u - v):.3g})", abs(u - v)
            return f"{k!r}: {u!r} vs {v!r}", None
    return None


def _value_difference(a: Leaf, b: Leaf) -> tuple[str, float | None]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensor_difference(a, b)
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool):
        return f"{a!r} vs {b!r} (max difference {abs(a - b):.3g})", float(abs(a - b))
    if isinstance(a, str) and isinstance(b, str):
        found = _json_difference(a, b)
        if found is not None:
            return found
    text = f"{_short(a)} vs {_short(b)}"
    return text, None


def _short(value: Leaf) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def difference(part: str, ref: Fingerprint, got: Fingerprint) -> tuple[str, str, float | None]:
    """``(key, what differs, max difference)`` at the first differing key of ``part``.

    ``ref``: the uninterrupted run's fingerprint, ``got``: the other run's. For the data
    order, the max difference is over the values of the first batch that differs.

    Example:
        >>> import torch
        >>> a = {"weights": {"w": torch.zeros(3), "b": torch.zeros(1)}}
        >>> b = {"weights": {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.zeros(1)}}
        >>> difference("weights", a, b)
        ('w', 'max difference 0.5', 0.5)
    """
    x, y = ref.get(part, {}), got.get(part, {})
    for key in [*x, *(k for k in y if k not in x)]:
        if key not in y:
            return key, "only in the uninterrupted run", None
        if key not in x:
            return key, "only in the other run", None
        if digest({key: x[key]}) == digest({key: y[key]}):
            continue
        if part == DATA and key.startswith("micro-batch "):
            return _batch_difference(key, ref, got)
        return (key, *_value_difference(x[key], y[key]))
    return "", "equal", None


def _batch_difference(
    key: str, ref: Fingerprint, got: Fingerprint
) -> tuple[str, str, float | None]:
    """The first differing value of a micro-batch (what the step saw there)."""
    x, y = ref.get(BATCHES, {}), got.get(BATCHES, {})
    for name in [k for k in x if k == key or k.startswith(key + ".")]:
        if name not in y:
            return name, "not in the other run's batch", None
        if digest({name: x[name]}) != digest({name: y[name]}):
            return (name, *_value_difference(x[name], y[name]))
    return key, "a different batch", None
