"""A loss summed over a varying number of items (:class:`SummedLoss`), and its normalisation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "SummedLoss",
    "divide_by_count",
    "data_parallel_world",
    "is_count",
    "check_count_tensor",
]


class SummedLoss(NamedTuple):
    """A loss summed over ``count`` items (tokens of padded sequences), returned by a loss function.

    ``count``: a number or 0-d tensor (``mask.sum()``), >= 0 and finite. The update's
    gradient is that of ``sum(total) / sum(count)`` over the optimizer window and the ranks
    (the mean over all items, not a mean of means; no host sync). Metrics:
    ``loss`` (this micro-batch's mean), ``loss_sum``, ``loss_count``.

    A negative or non-finite count is refused when the step reads it, before the backward:
    a number at once (``ValueError``); a tensor by ``torch._assert_async``, never read on the
    host (one or two comparisons and the assertion per micro-batch): a CPU tensor raises a
    ``ValueError`` at once, one on an accelerator stops the run at the device's next sync
    with a device-side assertion.

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
    if isinstance(c, torch.Tensor):
        check_count_tensor(c)
    elif not 0 <= c < math.inf:
        raise ValueError(_NEGATIVE.format(got=repr(c)))
    if out.metrics is not None and not isinstance(out.metrics, Mapping):
        raise TypeError(
            "SummedLoss(total, count, metrics): metrics must be a dict of tensors to "
            f"report (or None); got {type(out.metrics).__name__}."
        )


_NEGATIVE = (
    "SummedLoss(total, count): count must be a finite number >= 0 (how many items total sums "
    "over), got {got}: a negative count would train with the update's sign flipped or "
    "cancelled. Count the items, e.g. mask.sum(), not a difference or a masked-out total."
)


def check_count_tensor(count: torch.Tensor) -> None:
    """Refuse a negative or non-finite tensor ``count`` without reading it on the host:
    ``torch._assert_async`` checks it on its device (queued behind the step's work on an
    accelerator; a CPU tensor is checked at once, a ``ValueError``).

    Example:
        >>> check_count_tensor(torch.tensor(3))
        >>> check_count_tensor(torch.tensor(-4))
        Traceback (most recent call last):
        ...
        ValueError: SummedLoss(total, count): count must be a finite number >= 0 (how many \
items total sums over), got tensor(-4): a negative count would train with the update's sign \
flipped or cancelled. Count the items, e.g. mask.sum(), not a difference or a masked-out total.
    """
    if torch.compiler.is_compiling() or count.device.type == "meta":
        return  # (with_compile refuses a summed loss with its own message)
    try:
        assert_count_on_device(count)
    except RuntimeError:  # a CPU tensor: raised at once (the slow path may read it)
        raise ValueError(_NEGATIVE.format(got=f"tensor({count.detach().item()!r})")) from None


def assert_count_on_device(count: torch.Tensor) -> None:
    """Queue the check of ``count`` on its device, no host sync: one comparison (an integer
    count) or two (a float: ``sqrt`` is NaN below 0, ``isfinite`` refuses NaN and inf) and
    the assertion. A bad value raises at the device's next sync (on a CPU tensor at once)."""
    count = count.detach()
    ok = torch.isfinite(count.sqrt()) if count.is_floating_point() else count >= 0
    torch._assert_async(ok, _NEGATIVE.format(got="a negative or non-finite tensor"))


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
