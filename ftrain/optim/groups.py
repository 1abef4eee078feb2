"""Per-parameter learning rate and weight decay, the MMCV ``paramwise_cfg`` way."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["param_groups", "NORM_LAYERS", "CUSTOM_KEY_FIELDS"]

#: Module types whose weight and bias get ``norm_decay_mult`` (as in MMCV).
NORM_LAYERS: tuple[type[nn.Module], ...] = (_BatchNorm, _InstanceNorm, nn.GroupNorm, nn.LayerNorm)

#: The fields a ``custom_keys`` value may hold.
CUSTOM_KEY_FIELDS = ("lr_mult", "decay_mult")

# Deformable convs (mmcv.ops.DeformConv2d / ModulatedDeformConv2d and their
# ``*Pack`` subclasses), recognised by class name so mmcv is never imported.
_DCN_CLASS_NAMES = frozenset({"DeformConv2d", "ModulatedDeformConv2d"})


def _check_mult(value: Any, what: str, fix: str) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}; {fix}")
    return float(value)


def _check_custom_keys(custom_keys: Any) -> dict[str, dict[str, float]]:
    if custom_keys is None:
        return {}
    example = "dict(lr_mult=0.1, decay_mult=0.0)"
    if not isinstance(custom_keys, Mapping):
        raise ValueError(
            f"custom_keys must be a dict {{substring: {example}}}, got {type(custom_keys).__name__}"
        )
    checked: dict[str, dict[str, float]] = {}
    for key, spec in custom_keys.items():
        if not isinstance(key, str):
            raise ValueError(f"custom_keys keys must be str (substrings of names), got {key!r}")
        if not isinstance(spec, Mapping):
            raise ValueError(f"custom_keys[{key!r}] must be a dict such as {example}, got {spec!r}")
        if unknown := sorted(set(spec) - set(CUSTOM_KEY_FIELDS)):
            hint = ""
            if "requires_grad" in unknown:
                hint = "; to freeze parameters call p.requires_grad_(False) before param_groups"
            raise ValueError(
                f"custom_keys[{key!r}] has unknown field(s) {unknown}; the allowed fields are "
                f"'lr_mult' and 'decay_mult', e.g. custom_keys={{{key!r}: {example}}}{hint}"
            )
        fix = "use 0.0 to switch the learning rate / decay off, 1.0 to keep the base value"
        checked[key] = {
            f: _check_mult(spec[f], f"custom_keys[{key!r}][{f!r}]", fix)
            for f in CUSTOM_KEY_FIELDS
            if f in spec
        }
    return checked


def _walk(
    module: nn.Module, prefix: str = "", in_dcn: bool = False
) -> Iterator[tuple[nn.Module, str, bool]]:
    """``(module, prefix, is_child_of_dcn)`` in MMCV's ``add_params`` order."""
    yield module, prefix, in_dcn
    is_dcn = any(cls.__name__ in _DCN_CLASS_NAMES for cls in type(module).__mro__)
    for child_name, child in module.named_children():
        yield from _walk(child, f"{prefix}.{child_name}" if prefix else child_name, is_dcn)


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    bias_lr_mult: float | None = None,
    bias_decay_mult: float | None = None,
    norm_decay_mult: float | None = None,
    dwconv_decay_mult: float | None = None,
    dcn_offset_lr_mult: float | None = None,
    custom_keys: Mapping[str, Mapping[str, float]] | None = None,
    bypass_duplicate: bool = False,
    flat_decay_mult: float | None = None,
    merge: bool = True,
) -> list[dict[str, Any]]:
    """Parameter groups for ``torch.optim`` with MMCV ``paramwise_cfg`` rules.

    Each parameter gets ``lr * lr_mult`` and ``weight_decay * decay_mult``, the
    multipliers from the first rule that applies (MMCV ``DefaultOptimizerConstructor``,
    mmengine ``DefaultOptimWrapperConstructor.add_params``):

    1. ``custom_keys`` ``{substring: dict(lr_mult=..., decay_mult=...)}`` (fields
       default to 1): the longest key found in ``f"{prefix}.{name}"`` wins (ties:
       alphabetical; a top-level ``pos_embed`` is ``.pos_embed``); a match skips 2-3.
    2. learning rate: ``bias_lr_mult`` for biases outside norm layers and deformable
       convs; ``dcn_offset_lr_mult`` for a ``Conv2d`` named ``*conv_offset*`` directly
       inside a deformable conv (mmcv ``DeformConv2d`` / ``ModulatedDeformConv2d`` or
       a subclass, by class name).
    3. weight decay, the first rule whose multiplier is set: norm layers
       (:data:`NORM_LAYERS`) ``norm_decay_mult``; other biases (not in a DCN)
       ``bias_decay_mult``; depthwise ``Conv2d`` (``groups == in_channels``, weight and
       bias) ``dwconv_decay_mult``; other 1-D parameters (not in a DCN)
       ``flat_decay_mult``. As in MMEngine 0.10.7 an unset (``None``) rule lets its
       parameters fall through: ``flat_decay_mult=0.0`` alone switches decay off for
       every 1-D parameter.

    Unlike MMCV: every group has explicit ``lr`` and ``weight_decay``; a parameter reached
    twice (tied weights) raises ``ValueError`` unless ``bypass_duplicate=True`` (keep the
    first, warn); DDP / ``torch.compile`` wrappers are unwrapped. ``merge=True`` gives one
    group per distinct ``(lr, weight_decay)`` with ``'names'``; ``merge=False`` one group per
    parameter with ``'name'``, as MMCV.

    Example:
        >>> import torch
        >>> from ftrain.optim import param_groups
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 2, 1))
        >>> groups = param_groups(model, lr=0.1, weight_decay=1e-4, norm_decay_mult=0.0,
        ...                       custom_keys={"2.": dict(lr_mult=0.5)})
        >>> [(g["names"], g["lr"], g["weight_decay"]) for g in groups]  # doctest: +NORMALIZE_WHITESPACE
        [(['0.weight', '0.bias'], 0.1, 0.0001), (['1.weight', '1.bias'], 0.1, 0.0),
         (['2.weight', '2.bias'], 0.05, 0.0001)]
    """
    lr = _check_mult(lr, "lr", "pass the base learning rate, e.g. lr=0.01")
    fix = "pass the base weight decay, e.g. weight_decay=1e-4"
    weight_decay = _check_mult(weight_decay, "weight_decay", fix)
    fix = "multipliers scale the base value: 0.0 switches it off, 1.0 keeps it"
    unset = fix + ", None leaves the rule unset"
    mults = dict(bias_lr_mult=bias_lr_mult, dcn_offset_lr_mult=dcn_offset_lr_mult)
    mults.update(bias_decay_mult=bias_decay_mult, norm_decay_mult=norm_decay_mult)
    mults.update(dwconv_decay_mult=dwconv_decay_mult, flat_decay_mult=flat_decay_mult)
    for k, v in mults.items():
        if v is not None:
            _check_mult(v, k, fix if "lr" in k else unset)
    keys = _check_custom_keys(custom_keys)
    # alphabetical first, then a stable sort by length: longest wins, ties alphabetical
    sorted_keys = sorted(sorted(keys), key=len, reverse=True)

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from ftrain.dist import unwrap

    model = unwrap(model)  # no "module." / "_orig_mod." in the names

    entries: list[tuple[str, nn.Parameter, float, float]] = []
    seen: dict[int, str] = {}
    for module, prefix, in_dcn in _walk(model):
        is_norm = isinstance(module, NORM_LAYERS)
        is_dwconv = isinstance(module, nn.Conv2d) and module.in_channels == module.groups
        is_offset = in_dcn and "conv_offset" in prefix and isinstance(module, nn.Conv2d)
        for name, param in module.named_parameters(recurse=False):
            full_name = f"{prefix}.{name}" if prefix else name
            first = seen.get(id(param))
            if first is not None:
                what = f"parameter {full_name!r} is the same tensor as {first!r} (tied weights)"
                if bypass_duplicate:
                    warnings.warn(f"{what}; skipped (bypass_duplicate=True)", stacklevel=2)
                    continue
                raise ValueError(
                    f"{what}; an optimizer cannot hold it twice. Pass bypass_duplicate=True "
                    f"to keep only its first occurrence ({first!r})."
                )
            seen[id(param)] = full_name

            p_lr, p_wd = lr, weight_decay
            # frozen parameters keep the base values; MMCV matches ".name" at the top level
            key = next((k for k in sorted_keys if k in f"{prefix}.{name}"), None)
            if key is not None and param.requires_grad:
                p_lr = lr * keys[key].get("lr_mult", 1.0)
                p_wd = weight_decay * keys[key].get("decay_mult", 1.0)
            elif param.requires_grad:
                is_bias = name == "bias"
                if is_bias and not (is_norm or in_dcn) and bias_lr_mult is not None:
                    p_lr = lr * bias_lr_mult
                if is_offset and dcn_offset_lr_mult is not None:
                    p_lr = lr * dcn_offset_lr_mult
                # MMEngine 0.10.7: an unset multiplier (None) lets the parameter fall through
                if is_norm and norm_decay_mult is not None:
                    p_wd = weight_decay * norm_decay_mult
                elif is_bias and not in_dcn and bias_decay_mult is not None:
                    p_wd = weight_decay * bias_decay_mult
                elif is_dwconv and dwconv_decay_mult is not None:
                    p_wd = weight_decay * dwconv_decay_mult
                elif flat_decay_mult is not None and param.ndim == 1 and not in_dcn:
                    p_wd = weight_decay * flat_decay_mult
            entries.append((full_name, param, p_lr, p_wd))

    if not merge:
        return [
            {"params": [p], "name": n, "lr": p_lr, "weight_decay": p_wd}
            for n, p, p_lr, p_wd in entries
        ]
    merged: dict[tuple[float, float], dict[str, Any]] = {}
    for n, p, p_lr, p_wd in entries:
        group = merged.setdefault(
            (p_lr, p_wd), {"params": [], "names": [], "lr": p_lr, "weight_decay": p_wd}
        )
        group["params"].append(p)
        group["names"].append(n)
    return list(merged.values())
