"""A ``TrainState`` as a ``torch.save``-able dict, and back (with checks that name the fix).

Public as ``ftrain.checkpoint.state_dict`` and ``ftrain.checkpoint.load_state_dict``.
Names are the unwrapped module's (no ``module.`` or ``_orig_mod.``), so a
checkpoint loads into a compiled or plain, wrapped or bare model alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from ftrain._checks import flag
from ftrain.dist import unwrap
from ftrain.errors import CheckpointError
from ftrain.persist.reshard import into_shards, needs_sharding
from ftrain.persist.rng import capture_rng, restore_rng
from ftrain.state import TrainState, Unloaded, advance, wait_readers
from ftrain.transforms.base import load_saved

__all__ = ["state_dict", "load_state_dict", "to_saved", "check_compatible", "FORMAT"]

FORMAT = "ftrain.TrainState/1"

_PREFIXES = ("module.", "_orig_mod.")


def strip_wrapper_prefixes(d: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``d`` without a wrapper prefix (``module.``, ``_orig_mod.``) all its keys carry and ``names`` lack.

    Example:
        >>> strip_wrapper_prefixes({"module.w": 1}, ["w"])
        {'w': 1}
    """
    names = list(names)
    out = dict(d)
    changed = True
    while changed and out:
        changed = False
        for p in _PREFIXES:
            if all(k.startswith(p) for k in out) and not (
                names and all(n.startswith(p) for n in names)
            ):
                out = {k[len(p) :]: v for k, v in out.items()}
                changed = True
    return out


def to_saved(value: Any) -> Any:
    """A transform's state as plain ``torch.save``-able data (:func:`load_saved` reverses it)."""
    if isinstance(value, Unloaded):
        return value.saved
    if callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    if attrs.has(type(value)):
        return {f.name: to_saved(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(to_saved(v) for v in value)
    if isinstance(value, dict):
        return {k: to_saved(v) for k, v in value.items()}
    return value


def state_dict(state: TrainState, *, rng: bool = True) -> dict[str, Any]:
    """Everything needed to continue ``state`` exactly (partial-window gradients and, with
    ``rng``, the random generators included), as a ``torch.save``-able dict.

    Like torch's ``state_dict()``, it holds references to the state's tensors, and
    :func:`load_state_dict` keeps optimizer tensors whose dtype and device match (as
    ``Optimizer.load_state_dict`` does): loading it into another live state in the same
    process makes the two share optimizer tensors. Save it to a file first, or copy a state
    in memory with ``state.clone()``.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> sorted(ftrain.checkpoint.state_dict(s))[:3]
        ['epoch', 'format', 'grads']
    """
    flag("state_dict: rng", rng)
    model = unwrap(state.model)  # checks the state is fresh
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "format": FORMAT,
        "step": state.step,
        "micro_step": state.micro_step,
        "epoch": state.epoch,
        "model": model.state_dict(),
        **_optimizers_saved(state),
        "transforms": {k: to_saved(v) for k, v in state.transforms.items()},
        "grads": grads,
        "rng": capture_rng() if rng else None,
    }


def _optimizers_saved(state: TrainState) -> dict[str, Any]:
    """``optimizer`` and ``optimizer_class``; several by name: ``optimizers`` and
    ``optimizer_classes``, dicts by name."""
    named = state.optimizers
    if not named:
        return {
            "optimizer": state.optimizer.state_dict(),
            "optimizer_class": type(state.optimizer).__name__,
        }
    return {
        "optimizers": {name: opt.state_dict() for name, opt in named.items()},
        "optimizer_classes": {name: type(opt).__name__ for name, opt in named.items()},
    }


def _check_named(state: TrainState, saved: Mapping[str, Any], source: str, fix: str) -> None:
    """Raise a :class:`CheckpointError` when ``saved`` holds other optimizers than
    ``state``: one against several, other names, or another class under a name."""
    have = {name: type(opt).__name__ for name, opt in state.optimizers.items()}
    want = saved.get("optimizer_classes")
    if not have or not isinstance(want, Mapping):
        what = f"optimizers {sorted(want)}" if isinstance(want, Mapping) else "one optimizer"
        mine = f"optimizers {sorted(have)}" if have else "one optimizer"
        raise CheckpointError(
            f"{source} was written with {what}, and this run's state holds {mine}. {fix}"
        )
    if set(want) != set(have):
        raise CheckpointError(
            f"{source} was written with optimizers {sorted(want)}, and this run's state holds "
            f"{sorted(have)}. {fix}"
        )
    for name, cls in have.items():
        if want[name] != cls:
            raise CheckpointError(
                f"{source} was written with optimizer {name!r} a {want[name]}, and this run's "
                f"is a {cls}. {fix}"
            )


def check_compatible(state: TrainState, saved: Mapping[str, Any], source: str) -> None:
    """Raise a :class:`CheckpointError` when ``saved`` does not fit ``state``'s optimizer class
    (older files: its hyper-parameter names) or model parameter names and shapes."""
    fix = (
        "Resume with the model and optimizer the checkpoint was written with, or start a new "
        "run in a new work_dir and load only the weights with "
        "ftrain.checkpoint.load_weights(model, path)."
    )
    if state.optimizers or "optimizer_classes" in saved:
        _check_named(state, saved, source, fix)
        _check_model(state, saved, source, fix)
        return
    optimizer = state.optimizer
    want = saved.get("optimizer_class")
    have = type(optimizer).__name__
    saved_opt = saved.get("optimizer")
    if want is not None and want != have:
        raise CheckpointError(
            f"{source} was written with optimizer {want}, and this run uses {have}. {fix}"
        )
    if want is None and isinstance(saved_opt, Mapping) and saved_opt.get("param_groups"):
        keys = set(saved_opt["param_groups"][0]) - {"params"}
        current = set(optimizer.param_groups[0]) - {"params"} if optimizer.param_groups else keys
        missing = sorted(current - keys)
        if missing and len(missing) > len(current) // 2:
            raise CheckpointError(
                f"{source} holds the state of another kind of optimizer than this run's {have}: "
                f"its settings lack {missing[:5]}. {fix}"
            )
    _check_model(state, saved, source, fix)


def _check_model(state: TrainState, saved: Mapping[str, Any], source: str, fix: str) -> None:
    """Raise a :class:`CheckpointError` when ``saved``'s model parameter names or shapes
    differ from ``state``'s."""
    saved_model = saved.get("model")
    if not isinstance(saved_model, Mapping):
        return
    current_sd = unwrap(state.model).state_dict()
    saved_sd = strip_wrapper_prefixes(saved_model, current_sd)
    missing = [k for k in current_sd if k not in saved_sd]
    unexpected = [k for k in saved_sd if k not in current_sd]
    shapes = [
        f"{k}: saved {tuple(saved_sd[k].shape)}, model {tuple(v.shape)}"
        for k, v in current_sd.items()
        if hasattr(saved_sd.get(k), "shape") and hasattr(v, "shape")
        and tuple(saved_sd[k].shape) != tuple(v.shape) and type(v).__name__ != "DTensor"
    ]  # fmt: skip
    parts = [
        shapes and f"shapes differ ({'; '.join(shapes[:3])})",
        missing and f"the model has parameters the checkpoint lacks ({missing[:3]})",
        unexpected and f"the checkpoint has parameters the model lacks ({unexpected[:3]})",
    ]
    if any(parts):
        raise CheckpointError(
            f"{source} does not fit this run's model: {', '.join(p for p in parts if p)}. {fix}"
        )


_NAMED_FIX = "Load it into a state created with the optimizers it was saved with."


def _load_optimizers(state: TrainState, saved: Mapping[str, Any]) -> None:
    if not state.optimizers:
        state.optimizer.load_state_dict(saved["optimizer"])
    for name, opt in state.optimizers.items():
        opt.load_state_dict(saved["optimizers"][name])


def load_state_dict(
    state: TrainState, saved: Mapping[str, Any], *, rng: bool = True, strict: bool = True
) -> TrainState:
    """Load :func:`state_dict`'s ``saved`` into ``state``'s tensors in place (consuming
    ``state``); return the new record. State of transforms not run yet is restored lazily.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> s = ftrain.checkpoint.load_state_dict(s, ftrain.checkpoint.state_dict(s))
        >>> s.step, s.is_consumed
        (0, False)
    """
    flag("load_state_dict: rng", rng)
    flag("load_state_dict: strict", strict)
    if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
        raise ValueError(
            "load_state_dict: not an ftrain TrainState state dict (missing "
            f"format={FORMAT!r}). For weights only, use "
            "`ftrain.checkpoint.load_weights(model, path)`."
        )
    model = unwrap(state.model)  # checks the state is fresh
    wait_readers(state)  # a background checkpoint copy still reading the tensors
    names = model.state_dict().keys()
    if state.optimizers or "optimizers" in saved:
        _check_named(state, saved, "load_state_dict: the saved state", _NAMED_FIX)
    saved = {**saved, "model": strip_wrapper_prefixes(saved["model"], names)}
    saved["grads"] = strip_wrapper_prefixes(saved.get("grads") or {}, names)
    if needs_sharding(model, saved["model"]):  # a whole-tensor checkpoint, an FSDP2 model
        saved = into_shards(saved, model, state.optimizer)  # (one optimizer: create refuses
        #                                                      several over a sharded model)
    model.load_state_dict(saved["model"], strict=strict)
    _load_optimizers(state, saved)
    grads = saved["grads"]
    for name, p in model.named_parameters():
        g = grads.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
    transforms: dict[str, Any] = dict(state.transforms)
    for name, value in (saved.get("transforms") or {}).items():
        current = transforms.get(name)
        if current is None or isinstance(current, Unloaded):
            transforms[name] = Unloaded(value)
        else:
            transforms[name] = load_saved(current, value)
    if rng and saved.get("rng") is not None:
        restore_rng(saved["rng"])
    return advance(
        state,
        "load_state_dict",
        int(saved["step"]),
        int(saved["micro_step"]),
        transforms,
        epoch=int(saved["epoch"]),
    )


def adopt_hook_state(state_dict: dict[str, Any], hooks: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with a 0.1 checkpoint's ``EMAHook`` state (``hooks["ema"]``) as the state
    of ``with_ema`` (the same format), so old runs resume with their average."""
    saved = hooks.get("ema") if isinstance(hooks, Mapping) else None
    transforms = state_dict.get("transforms") or {}
    if not isinstance(saved, Mapping) or "updates" not in saved or "ema" in transforms:
        return state_dict
    return {**state_dict, "transforms": {**transforms, "ema": dict(saved)}}
