"""A loss that is a sum over a varying number of items, and its normalisation.

:class:`SummedLoss` is what a loss function returns when its loss is a *sum*
(over the tokens of padded sequences, the valid pixels of a mask...): the
step then divides the update's gradient by the count summed over the whole
optimizer window and every data-parallel rank. :func:`divide_by_count` is
that division; :mod:`ftrain.step` and ``with_grad_accum`` both use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["SummedLoss", "divide_by_count", "data_parallel_world", "is_count"]


class SummedLoss(NamedTuple):
    """A loss summed over ``count`` items, returned by a loss function.

    ``total`` is the scalar sum of the per-item losses (it must require
    grad), ``count`` how many items it sums over (a number or a 0-d tensor,
    e.g. ``mask.sum()``), ``metrics`` an optional dict of tensors to report.
    The update's gradient is then that of ``sum of total / sum of count``
    over every micro-batch of the optimizer window (``with_grad_accum``) and
    every data-parallel rank: the mean over all items, not a mean of
    per-micro-batch means. The metric ``loss`` is this micro-batch's mean;
    ``loss_sum`` and ``loss_count`` let the logger report the item-weighted
    mean. It is a named tuple (it also traces under ``torch.compile``); the
    step checks its fields when it reads it.

    Example:
        >>> import torch, ftrain
        >>> def loss_fn(model, batch):
        ...     x, y, mask = batch
        ...     per_token = (model(x) - y).pow(2).mean(-1)
        ...     return ftrain.SummedLoss(per_token[mask].sum(), mask.sum())
        >>> model = torch.nn.Linear(3, 2)
        >>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> batch = (torch.randn(5, 3), torch.randn(5, 2), torch.tensor([1, 1, 1, 0, 0]).bool())
        >>> state, metrics = ftrain.make_step(loss_fn)(state, batch)
        >>> int(metrics["loss_count"])
        3
    """

    total: torch.Tensor
    count: Any
    metrics: Mapping[str, Any] | None = None


def is_count(x: Any) -> bool:
    """Whether ``x`` can be an item count: a real number or a one-element real tensor."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not x.is_complex()
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_summed(out: SummedLoss) -> None:
    """Raise a clear ``TypeError`` for a :class:`SummedLoss` whose fields are wrong."""
    if not is_count(out.count):
        raise TypeError(
            "SummedLoss(total, count): count must be a number or a 0-d tensor (how many "
            f"items total sums over, e.g. mask.sum()); got {_describe(out.count)}."
        )
    if out.metrics is not None and not isinstance(out.metrics, Mapping):
        raise TypeError(
            "SummedLoss(total, count, metrics): metrics must be a dict of tensors to "
            f"report (or None); got {type(out.metrics).__name__}."
        )


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def data_parallel_world(model: torch.nn.Module) -> int:
    """How many ranks average ``model``'s gradient: the world size under DDP/FSDP2, else 1.

    A plain module under an initialised process group trains on its own
    (each rank independently): its gradient is no one else's business.

    Example:
        >>> import torch
        >>> from ftrain.loss import data_parallel_world
        >>> data_parallel_world(torch.nn.Linear(2, 1))
        1
    """
    tdist = torch.distributed
    if not (tdist.is_available() and tdist.is_initialized()):
        return 1
    from ftrain.dist import strategy

    return tdist.get_world_size() if strategy(model) in ("ddp", "fsdp2") else 1


def divide_by_count(
    params: list[torch.Tensor], count: torch.Tensor, model: torch.nn.Module
) -> None:
    """Divide the gradients of a summed loss by its count over the window and the ranks.

    The gradients hold ``sum of d(total)`` over the window's micro-batches
    (and, after DDP's / FSDP2's averaging all-reduce, over the ranks divided
    by the world size). Dividing by the count summed over the ranks (one
    small all-reduce, no host synchronisation) makes them the gradient of
    the mean over every item of the window on every rank. A plain ``model``
    (not DDP/FSDP2) is divided by its own count, even under a process group.
    A count of 0 (no item anywhere) leaves zero gradients.

    Example:
        >>> import torch
        >>> from ftrain.loss import divide_by_count
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad = torch.tensor([4.0, 8.0])
        >>> divide_by_count([p], torch.tensor(4), torch.nn.Linear(1, 1))
        >>> p.grad
        tensor([1., 2.])
    """
    world = data_parallel_world(model)
    total = count.detach().float().clone()
    if world > 1:
        torch.distributed.all_reduce(total)
    factor = torch.where(total > 0, world / total.clamp(min=1e-30), torch.zeros_like(total))
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in by_device.items():
        torch._foreach_mul_(grads, factor.to(device=device, dtype=dtype))
