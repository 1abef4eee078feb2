"""Efficient conv-bn eval as a step transform: ``with_efficient_conv_bn_eval``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from ftrain.dist import unwrap
from ftrain.memory.conv_bn import EfficientConvBN, find_conv_bn_pairs
from ftrain.memory.plans import _check_names
from ftrain.transforms.base import Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_efficient_conv_bn_eval", "EfficientConvBNEval"]


@attrs.frozen
class EfficientConvBNEval(Transform):
    """Fold eval-mode BatchNorms into their convolutions. See :func:`with_efficient_conv_bn_eval`."""

    modules: tuple[str, ...] | None = None
    method: str = "fx"
    name = "efficient_conv_bn_eval"

    def init(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[tuple[str, str], ...]:
        """The ``(conv, bn)`` name pairs found in the model (the transform's state)."""
        return tuple(find_conv_bn_pairs(unwrap(model), self.modules, method=self.method))

    def outer_context(self, ctx: StepContext) -> EfficientConvBN:
        # Around forward AND backward: an activation-checkpoint recomputation
        # during the backward must run the same (fused) code as the forward.
        model = unwrap(ctx.model)
        return EfficientConvBN(model, _local(model, ctx.tstate[self.name]))


_DDP_PREFIX = "module."


def _local(model: torch.nn.Module, pairs: Sequence[Sequence[str]]) -> Sequence[Sequence[str]]:
    """Pairs named inside the DDP wrapper: state saved by older versions had the prefix."""
    if not any(str(n).startswith(_DDP_PREFIX) for pair in pairs for n in pair):
        return pairs  # the usual case: nothing to look up
    known = {n for n, _ in model.named_modules()}
    out = []
    for pair in pairs:
        conv, bn = (str(n) for n in pair)
        if conv not in known and conv.startswith(_DDP_PREFIX):
            conv = conv[len(_DDP_PREFIX) :]
        if bn not in known and bn.startswith(_DDP_PREFIX):
            bn = bn[len(_DDP_PREFIX) :]
        out.append((conv, bn))
    return tuple(out)


def with_efficient_conv_bn_eval(
    step: Step,
    modules: str | Sequence[str] | None = None,
    *,
    method: str = "fx",
    model: torch.nn.Module | None = None,
) -> Step:
    """Save activation memory for Conv -> BatchNorm pairs whose BN is in eval mode.

    Example:
        >>> import torch, ftrain
        >>> from ftrain.transforms.conv_bn import with_efficient_conv_bn_eval
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten())
        >>> _ = net[1].eval()  # frozen BN, as when fine-tuning
        >>> state = ftrain.TrainState.create(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> step = with_efficient_conv_bn_eval(ftrain.make_step(lambda m, b: m(b).pow(2).mean()))
        >>> state, _ = step(state, torch.randn(2, 3, 8, 8))
        >>> state.transforms["efficient_conv_bn_eval"]
        (('0', '1'),)
    """
    if isinstance(modules, str):
        modules = (modules,)
    mods = None if modules is None else tuple(modules)
    if method not in ("fx", "children"):
        raise ValueError(
            f"with_efficient_conv_bn_eval: method must be 'fx' or 'children', got {method!r}."
        )
    if model is not None and mods is not None:
        _check_names(unwrap(model), mods)
    return step.with_transform(EfficientConvBNEval(mods, method))
