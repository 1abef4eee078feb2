"""A loss summed over a varying number of items (:class:`SummedLoss`), and its normalisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["SummedLoss", "divide_by_count", "data_parallel_world", "is_count"]


class SummedLoss(NamedTuple):
    """A loss summed over ``count`` items (tokens of padded sequences), returned by a loss function.

    ``count``: a number or 0-d tensor (``mask.sum()``). The update's gradient is
    that of ``sum(total) / sum(count)`` over the optimizer window and the ranks
    (the mean over all items, not a mean of means; no host sync). Metrics:
    ``loss`` (this micro-batch's mean), ``loss_sum``, ``loss_count``.

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
    if not is_count(c := out.count):
        got = type(c).__name__
        if isinstance(c, torch.Tensor):
            got = f"a tensor of shape {tuple(c.shape)}"
        raise TypeError(
            "SummedLoss(total, count): count must be a number or a 0-d tensor (how many "
            f"items total sums over, e.g. mask.sum()); got {got}."
        )
    if out.metrics is not None and not isinstance(out.metrics, Mapping):
        raise TypeError(
            "SummedLoss(total, count, metrics): metrics must be a dict of tensors to "
            f"report (or None); got {type(out.metrics).__name__}."
        )


def data_parallel_world(model: torch.nn.Module) -> int:
    """How many ranks average ``model``'s gradient: the world size under DDP/FSDP2, else 1."""
    tdist = torch.distributed
    if not (tdist.is_available() and tdist.is_initialized()):
        return 1
    from ftrain.dist import strategy

    return tdist.get_world_size() if strategy(model) in ("ddp", "fsdp2") else 1


def divide_by_count(
    params: list[torch.Tensor], count: torch.Tensor, model: torch.nn.Module
) -> None:
    """Divide a summed loss's gradients by its count summed over the ranks (0 items: zeros).

    DDP/FSDP2 already averaged the gradients over the ranks, hence ``world / count``.

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
    mul_grads([p.grad for p in params], factor)


def mul_grads(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the 0-d tensor ``factor``, per device and dtype (no sync)."""
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in by_device.items():
        torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))
