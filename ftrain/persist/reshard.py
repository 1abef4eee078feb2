"""A whole-tensor checkpoint (one process, DDP) resumed by an FSDP2 model: each rank cuts its
shards from the whole tensors, the way FSDP2 sharded them (no communication).

The model's parameters, the optimizer's per-parameter state (tensors shaped like their
parameter: AdamW's moments, SGD's momentum) and a partial window's gradients are sharded;
scalars (AdamW's ``step``) stay as they are. What cannot be cut like its parameter (an
optimizer state of another shape, a parameter of another shape, another number of
parameters) is a :class:`~ftrain.errors.CheckpointError` naming it and the fix, before
anything is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ftrain import dist as _dist
from ftrain.errors import CheckpointError

__all__ = ["needs_sharding", "into_shards"]


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def needs_sharding(model: torch.nn.Module, saved_model: Any) -> bool:
    """Whether ``model`` has FSDP2 shards (DTensors) and ``saved_model`` whole tensors for them.

    Example:
        >>> needs_sharding(torch.nn.Linear(2, 1), {"weight": torch.ones(1, 2)})
        False
    """
    if not isinstance(saved_model, Mapping) or not _dist.is_sharded(model):
        return False
    live = model.state_dict()
    return any(
        _is_dtensor(t) and isinstance(saved_model.get(k), torch.Tensor)
        and not _is_dtensor(saved_model[k])
        for k, t in live.items()
    )  # fmt: skip


def _refuse(problem: str, written_by: int | None) -> CheckpointError:
    by = "one process or DDP" if written_by is None else f"{written_by} process(es)"
    return CheckpointError(
        f"The checkpoint was written by {by} with whole tensors, and this run shards the "
        f"model with FSDP2 over {_dist.world_size()} process(es): {problem}, so it cannot "
        "be resharded. Resume with the number of processes and the strategy that wrote it, "
        "or start a new run and load only the weights: "
        "ftrain.checkpoint.load_weights(model, path)."
    )


def _shard(whole: torch.Tensor, like: Any, what: str, written_by: int | None = None) -> Any:
    """``whole`` cut like the DTensor ``like`` (this rank's shard of it)."""
    from torch.distributed.tensor import distribute_tensor

    if tuple(whole.shape) != tuple(like.shape):
        problem = f"{what} has shape {tuple(whole.shape)}, the parameter {tuple(like.shape)}"
        raise _refuse(problem, written_by)
    return distribute_tensor(whole.detach(), like.device_mesh, like.placements, src_data_rank=None)


def _model(saved: Mapping[str, Any], live: Mapping[str, Any], by: int | None) -> dict[str, Any]:
    out = dict(saved)
    for k, t in live.items():
        v = saved.get(k)
        if _is_dtensor(t) and isinstance(v, torch.Tensor) and not _is_dtensor(v):
            out[k] = _shard(v, t, f"parameter {k!r}", by)
    return out


def _param_state(state: Mapping[str, Any], p: Any, name: str, by: int | None) -> dict[str, Any]:
    out = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.dim() > 0:
            v = _shard(v, p, f"optimizer state {key!r} of parameter {name!r}", by)
        out[key] = v
    return out


def _optimizer(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: dict, by: int | None
) -> dict:
    groups = saved.get("param_groups") or []
    sizes = [len(g["params"]) for g in groups]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != want:
        problem = f"its optimizer has parameter groups of {sizes} parameters, this run's {want}"
        raise _refuse(problem, by)
    ids = [i for g in groups for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = dict(saved.get("state") or {})
    for i, p in zip(ids, params, strict=True):
        if i in state and _is_dtensor(p):
            state[i] = _param_state(state[i], p, names.get(id(p), f"#{i}"), by)
    return {**saved, "state": state}


def into_shards(
    saved: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``saved`` (:func:`ftrain.persist.state.state_dict`'s dict of a whole model) with the
    model, the optimizer state and the gradients cut into ``model``'s FSDP2 shards.

    ``model`` is the unwrapped module; raises :class:`~ftrain.errors.CheckpointError` for
    what cannot be cut like its parameter (naming ``saved["written_by"]``, the number of
    processes that wrote it, when :meth:`Checkpointer.localize
    <ftrain.persist.checkpointer.Checkpointer.localize>` put it there).
    """
    by = saved.get("written_by")
    names = {id(p): n for n, p in model.named_parameters()}
    out = dict(saved)
    out["model"] = _model(saved["model"], model.state_dict(), by)
    if isinstance(saved.get("optimizer"), Mapping):
        out["optimizer"] = _optimizer(saved["optimizer"], optimizer, names, by)
    params = dict(model.named_parameters())
    grads = dict(saved.get("grads") or {})
    for k, g in grads.items():
        p = params.get(k)
        if p is not None and _is_dtensor(p) and not _is_dtensor(g):
            grads[k] = _shard(g, p, f"the gradient of {k!r}", by)
    out["grads"] = grads
    return out
