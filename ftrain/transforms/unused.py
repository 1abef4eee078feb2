"""Find parameters that do not take part in the loss (MMCV ``detect_anomalous_params``)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain._checks import flag
from ftrain.transforms.base import STAGE_CHECK, Transform

if TYPE_CHECKING:
    from ftrain.step import LossFn, Step, StepContext

__all__ = ["find_unused_parameters", "with_unused_check", "UnusedCheck", "UnusedParametersError"]


class UnusedParametersError(RuntimeError):
    """Trainable parameters received no gradient."""


def find_unused_parameters(
    model: torch.nn.Module, loss_fn: LossFn, batch: Any
) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of trainable parameters not in the loss's autograd graph: one
    forward pass (no backward, no update), then a walk of the graph from the loss.

    Example:
        >>> import torch, ftrain
        >>> model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 1), "unused": torch.nn.Linear(2, 1)})
        >>> ftrain.transforms.find_unused_parameters(model, lambda m, b: m["used"](b).sum(), torch.ones(1, 2))
        [('unused.weight', (1, 2)), ('unused.bias', (1,))]
    """
    from ftrain.step import parse_loss

    loss, _, _ = parse_loss(loss_fn(model, batch))
    reached: set[int] = set()
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        reached.add(id(getattr(fn, "variable", None)))  # AccumulateGrad nodes hold a leaf
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return [
        (name, tuple(p.shape))
        for name, p in model.named_parameters()
        if p.requires_grad and id(p) not in reached
    ]


@attrs.frozen
class UnusedCheck(Transform):
    """Report parameters with no gradient at an update. See :func:`with_unused_check`."""

    action: str = "warn"
    once: bool = True
    name = "unused"
    stage = STAGE_CHECK

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        return False  # whether a check already ran

    def before_update(self, ctx: StepContext) -> None:
        if self.once and ctx.tstate["unused"]:
            return
        ctx.tstate["unused"] = True
        missing = [  # (a step bound to named optimizers: the parameters they hold)
            f"{name} {tuple(p.shape)}"
            for name, p in ctx.named_parameters()
            if p.requires_grad and p.grad is None
        ]
        if not missing:
            return
        message = (
            f"{len(missing)} trainable parameter(s) got no gradient at step {ctx.state.step}: "
            + ", ".join(missing)
            + ". Freeze them (requires_grad_(False)), remove them, or pass "
            "find_unused_parameters=True to DDP."
        )
        if self.action == "raise":
            raise UnusedParametersError(message)
        warnings.warn(message, stacklevel=2)


def with_unused_check(step: Step, action: str = "warn", once: bool = True) -> Step:
    """Report trainable parameters that received no gradient, by name and shape, at the
    first optimizer update (``once=True``) or at every one; ``action``: "warn" or "raise".

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.transforms.with_unused_check(ftrain.make_step(lambda m, b: m(b).mean()))
        >>> step["unused"]
        UnusedCheck(action='warn', once=True)
    """
    if action not in ("warn", "raise"):
        raise ValueError(f"with_unused_check: action must be 'warn' or 'raise', got {action!r}.")
    flag("with_unused_check: once", once)
    return step.with_transform(UnusedCheck(action=action, once=once))
