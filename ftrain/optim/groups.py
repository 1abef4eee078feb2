"""Per-parameter learning rate and weight decay, the MMCV ``paramwise_cfg`` way.

:func:`param_groups` gives each parameter ``lr * lr_mult`` and ``weight_decay * decay_mult``,
the multipliers from the first rule that applies (MMCV ``DefaultOptimizerConstructor``,
mmengine ``DefaultOptimWrapperConstructor.add_params``):

1. ``custom_keys`` ``{substring: dict(lr_mult=..., decay_mult=...)}`` (fields default to 1):
   the longest key found in ``f"{prefix}.{name}"`` wins (ties: alphabetical; a top-level
   ``pos_embed`` is ``.pos_embed``); a match skips 2-3.
2. learning rate: ``bias_lr_mult`` for biases outside norm layers and deformable convs;
   ``dcn_offset_lr_mult`` for a ``Conv2d`` named ``*conv_offset*`` directly inside a
   deformable conv (mmcv ``DeformConv2d`` / ``ModulatedDeformConv2d`` or a subclass, by
   class name).
3. weight decay, the first rule whose multiplier is set: norm layers (:data:`NORM_LAYERS`)
   ``norm_decay_mult``; other biases (not in a DCN) ``bias_decay_mult``; depthwise
   ``Conv2d`` (``groups == in_channels``, weight and bias) ``dwconv_decay_mult``; other 1-D
   parameters (not in a DCN) ``flat_decay_mult``. As in MMEngine 0.10.7 an unset (``None``)
   rule lets its parameters fall through: ``flat_decay_mult=0.0`` alone switches decay off
   for every 1-D parameter.

Frozen parameters (``requires_grad=False``) keep the base values.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ftrain._checks import flag

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


@attrs.frozen
class _Rules:
    """The checked ``paramwise_cfg`` multipliers (``None``: the rule is unset)."""

    lr: float
    weight_decay: float
    bias_lr_mult: float | None
    bias_decay_mult: float | None
    norm_decay_mult: float | None
    dwconv_decay_mult: float | None
    dcn_offset_lr_mult: float | None
    flat_decay_mult: float | None
    keys: dict[str, dict[str, float]]
    sorted_keys: tuple[str, ...]

    def values(self, module: nn.Module, prefix: str, in_dcn: bool, name: str, param) -> tuple:
        """``(lr, weight_decay)`` of parameter ``name`` of ``module`` (MMCV's ``add_params``)."""
        lr, wd = self.lr, self.weight_decay
        if not param.requires_grad:  # frozen parameters keep the base values
            return lr, wd
        # MMCV matches ".name" at the top level
        key = next((k for k in self.sorted_keys if k in f"{prefix}.{name}"), None)
        if key is not None:
            return lr * self.keys[key].get("lr_mult", 1.0), wd * self.keys[key].get(
                "decay_mult", 1.0
            )
        is_norm = isinstance(module, NORM_LAYERS)
        is_bias = name == "bias"
        if is_bias and not (is_norm or in_dcn) and self.bias_lr_mult is not None:
            lr = self.lr * self.bias_lr_mult
        is_offset = in_dcn and "conv_offset" in prefix and isinstance(module, nn.Conv2d)
        if is_offset and self.dcn_offset_lr_mult is not None:
            lr = self.lr * self.dcn_offset_lr_mult
        return lr, self._decay(module, is_norm, is_bias, in_dcn, param)

    def _decay(self, module: nn.Module, is_norm: bool, is_bias: bool, in_dcn: bool, param) -> float:
        """The first decay rule whose multiplier is set (MMEngine 0.10.7: unset falls through)."""
        wd = self.weight_decay
        is_dwconv = isinstance(module, nn.Conv2d) and module.in_channels == module.groups
        if is_norm and self.norm_decay_mult is not None:
            return wd * self.norm_decay_mult
        if is_bias and not in_dcn and self.bias_decay_mult is not None:
            return wd * self.bias_decay_mult
        if is_dwconv and self.dwconv_decay_mult is not None:
            return wd * self.dwconv_decay_mult
        if self.flat_decay_mult is not None and param.ndim == 1 and not in_dcn:
            return wd * self.flat_decay_mult
        return wd


def _rules(lr: Any, weight_decay: Any, mults: dict[str, Any], custom_keys: Any) -> _Rules:
    lr = _check_mult(lr, "lr", "pass the base learning rate, e.g. lr=0.01")
    fix = "pass the base weight decay, e.g. weight_decay=1e-4"
    weight_decay = _check_mult(weight_decay, "weight_decay", fix)
    fix = "multipliers scale the base value: 0.0 switches it off, 1.0 keeps it"
    unset = fix + ", None leaves the rule unset"
    for k, v in mults.items():
        if v is not None:
            _check_mult(v, k, fix if "lr" in k else unset)
    keys = _check_custom_keys(custom_keys)
    # alphabetical first, then a stable sort by length: longest wins, ties alphabetical
    sorted_keys = tuple(sorted(sorted(keys), key=len, reverse=True))
    return _Rules(lr, weight_decay, **mults, keys=keys, sorted_keys=sorted_keys)


def _entries(model: nn.Module, rules: _Rules, bypass_duplicate: bool) -> list[tuple]:
    """``(name, param, lr, weight_decay)`` of every parameter, in ``add_params`` order."""
    entries: list[tuple[str, nn.Parameter, float, float]] = []
    seen: dict[int, str] = {}
    for module, prefix, in_dcn in _walk(model):
        for name, param in module.named_parameters(recurse=False):
            full_name = f"{prefix}.{name}" if prefix else name
            first = seen.get(id(param))
            if first is not None:
                what = f"parameter {full_name!r} is the same tensor as {first!r} (tied weights)"
                if bypass_duplicate:
                    warnings.warn(f"{what}; skipped (bypass_duplicate=True)", stacklevel=3)
                    continue
                raise ValueError(
                    f"{what}; an optimizer cannot hold it twice. Pass bypass_duplicate=True "
                    f"to keep only its first occurrence ({first!r})."
                )
            seen[id(param)] = full_name
            entries.append((full_name, param, *rules.values(module, prefix, in_dcn, name, param)))
    return entries


def _grouped(entries: list[tuple], merge: bool) -> list[dict[str, Any]]:
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
    """Parameter groups for ``torch.optim`` with MMCV ``paramwise_cfg`` rules (module docs).

    Each parameter gets ``lr * lr_mult`` and ``weight_decay * decay_mult`` from the first rule
    that applies: ``custom_keys``, then the bias / DCN-offset learning-rate rules, then the
    norm / bias / depthwise / flat decay rules. Unlike MMCV: every group has explicit ``lr``
    and ``weight_decay``; a parameter reached twice (tied weights) raises ``ValueError``
    unless ``bypass_duplicate=True`` (keep the first, warn); DDP / ``torch.compile`` wrappers
    are unwrapped. ``merge=True`` gives one group per distinct ``(lr, weight_decay)`` with
    ``'names'``; ``merge=False`` one group per parameter with ``'name'``, as MMCV.

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
    flag("param_groups: bypass_duplicate", bypass_duplicate)
    flag("param_groups: merge", merge)
    mults = dict(bias_lr_mult=bias_lr_mult, dcn_offset_lr_mult=dcn_offset_lr_mult)
    mults.update(bias_decay_mult=bias_decay_mult, norm_decay_mult=norm_decay_mult)
    mults.update(dwconv_decay_mult=dwconv_decay_mult, flat_decay_mult=flat_decay_mult)
    rules = _rules(lr, weight_decay, mults, custom_keys)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from ftrain.dist import unwrap

    model = unwrap(model)  # no "module." / "_orig_mod." in the names
    return _grouped(_entries(model, rules, bypass_duplicate), merge)
