"""Efficient conv-bn eval (MMCV/MMEngine ``efficient_conv_bn_eval``, arXiv 2305.11624).

A convolution followed by an eval-mode BatchNorm is one affine map
``conv(x, W * c, beta + c * (b - mean))`` with ``c = gamma / sqrt(running_var + eps)``, so only
the convolution input is saved for backward; gradients reach every parameter. Pairs are found
by ``method="fx"`` (tracing; untraceable modules fall back to ``"children"`` with a warning)
or ``"children"`` (consecutive named children ``(conv, bn)`` with matching channels).

Example:
    >>> import torch
    >>> from ftrain.memory import efficient_conv_bn_eval, measure_activations
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
    >>> x = torch.randn(2, 3, 16, 16)
    >>> eager = measure_activations(net, lambda: net(x).sum()).total_bytes
    >>> with efficient_conv_bn_eval(net):
    ...     fused = measure_activations(net, lambda: net(x).sum()).total_bytes
    >>> fused < eager
    True
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from ftrain.memory.apply import restore_forwards
from ftrain.memory.plans import _check_names

__all__ = [
    "find_conv_bn_pairs", "efficient_conv_bn_eval", "efficient_conv_bn_eval_forward",
    "EfficientConvBN"
]  # fmt: skip


def _is_conv(m: Any) -> bool:
    return isinstance(m, _ConvNd) and not m.transposed


def _is_bn(m: Any) -> bool:
    return isinstance(m, _BatchNorm)


def _fusable(bn: _BatchNorm) -> bool:
    """Whether the BatchNorm uses its running statistics now (eval mode, tracked)."""
    return not bn.training and bn.running_mean is not None and bn.running_var is not None


def efficient_conv_bn_eval_forward(conv: _ConvNd, bn: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """``bn(conv(x))`` for an eval-mode ``bn``, saving only ``x`` for backward.

    Example:
        >>> import torch
        >>> conv, bn = torch.nn.Conv1d(2, 4, 3), torch.nn.BatchNorm1d(4).eval()
        >>> x = torch.randn(5, 2, 7)
        >>> torch.allclose(efficient_conv_bn_eval_forward(conv, bn, x), bn(conv(x)), atol=1e-6)
        True
    """
    mean, var = bn.running_mean, bn.running_var
    assert mean is not None and var is not None
    gamma = bn.weight if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(var)
    b = conv.bias if conv.bias is not None else torch.zeros_like(mean)
    c = gamma * torch.rsqrt(var + bn.eps)
    weight = conv.weight * c.reshape([-1] + [1] * (conv.weight.dim() - 1))
    bias = beta + c * (b - mean)
    return conv._conv_forward(x, weight, bias)


# ---------------------------------------------------------------- discovery
def _pairs_children(root: torch.nn.Module, prefix: str) -> list[tuple[str, str]]:
    out = []
    for parent_name, parent in root.named_modules(prefix=prefix):
        children = list(parent.named_children())
        for (n1, m1), (n2, m2) in zip(children, children[1:]):
            if _is_conv(m1) and _is_bn(m2) and m1.out_channels == m2.num_features:
                base = f"{parent_name}." if parent_name else ""
                out.append((base + n1, base + n2))
    return out


def _pairs_fx(root: torch.nn.Module, prefix: str) -> list[tuple[str, str]]:
    import torch.fx

    graph = torch.fx.symbolic_trace(root).graph
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    out = []
    for node in graph.nodes:
        src = node.args[0] if node.op == "call_module" and node.args else None
        if not isinstance(src, torch.fx.Node) or src.op != "call_module":
            continue
        if len(node.args) != 1 or node.kwargs or len(src.users) != 1:
            continue
        if calls[node.target] != 1 or calls[src.target] != 1:
            continue
        bn = root.get_submodule(node.target)
        conv = root.get_submodule(src.target)
        if _is_conv(conv) and _is_bn(bn) and conv.out_channels == bn.num_features:
            base = f"{prefix}." if prefix else ""
            out.append((base + src.target, base + node.target))
    return out


def find_conv_bn_pairs(
    model: torch.nn.Module, modules: str | Sequence[str] | None = None, *, method: str = "fx"
) -> list[tuple[str, str]]:
    """``(conv_name, bn_name)`` pairs where the BatchNorm directly follows the conv.

    ``modules``: the submodules to search (default: the whole model), e.g. ``["backbone"]`` as
    MMEngine's ``efficient_conv_bn_eval="[backbone]"``; ``method``: see the module docstring.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.ReLU())
        >>> find_conv_bn_pairs(net)
        [('0', '1')]
    """
    if method not in ("fx", "children"):
        raise ValueError(f"find_conv_bn_pairs: method must be 'fx' or 'children', got {method!r}.")
    roots = [""] if modules is None else [modules] if isinstance(modules, str) else list(modules)
    _check_names(model, roots)
    pairs: list[tuple[str, str]] = []
    for name in roots:
        root = model.get_submodule(name)
        found = None
        if method == "fx":
            try:
                found = _pairs_fx(root, name)
            except Exception as exc:  # noqa: BLE001 - any tracing failure
                warnings.warn(
                    f"efficient conv-bn eval: cannot fx-trace {name or type(root).__name__!r} "
                    f"({type(exc).__name__}: {exc}); pairing consecutive named children instead.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        pairs.extend(_pairs_children(root, name) if found is None else found)
    return list(dict.fromkeys(pairs))


# ---------------------------------------------------------------- patching
class EfficientConvBN(contextlib.AbstractContextManager):
    """Run the given conv-bn pairs with :func:`efficient_conv_bn_eval_forward`."""

    def __init__(self, model: torch.nn.Module, pairs: Iterable[Sequence[str]]) -> None:
        self.model = model
        self.pairs = [(str(c), str(b)) for c, b in pairs]
        self._patched: list[tuple[torch.nn.Module, bool, Any]] = []

    def __enter__(self) -> EfficientConvBN:
        try:
            for conv_name, bn_name in self.pairs:
                conv = self.model.get_submodule(conv_name)
                bn = self.model.get_submodule(bn_name)
                if not (_is_conv(conv) and _is_bn(bn)):
                    raise TypeError(
                        f"efficient conv-bn eval: {conv_name!r} -> {bn_name!r} is not a "
                        f"(Conv, BatchNorm) pair ({type(conv).__name__}, {type(bn).__name__})."
                    )
                self._patch(conv, bn, conv_name, bn_name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _patch(self, conv: _ConvNd, bn: _BatchNorm, conv_name: str, bn_name: str) -> None:
        conv_fwd, bn_fwd = conv.forward, bn.forward
        last: list[Any] = [None]  # weakref to the fused output waiting for the BN

        def conv_forward(x: torch.Tensor) -> torch.Tensor:
            if not _fusable(bn):
                return conv_fwd(x)
            out = efficient_conv_bn_eval_forward(conv, bn, x)
            last[0] = weakref.ref(out)
            return out

        def bn_forward(x: torch.Tensor) -> torch.Tensor:
            ref, last[0] = last[0], None
            if ref is None:
                return bn_fwd(x)
            if ref() is not x:
                raise RuntimeError(
                    f"efficient conv-bn eval: {bn_name!r} did not receive the output of "
                    f"{conv_name!r} directly, so the pair cannot be fused. Use "
                    "method='fx' or leave these modules out (modules=...)."
                )
            return x

        for module, fwd in ((conv, conv_forward), (bn, bn_forward)):
            had = "forward" in vars(module)
            self._patched.append((module, had, vars(module).get("forward")))
            module.forward = fwd

    def __exit__(self, *exc: Any) -> None:
        restore_forwards(self._patched)


def efficient_conv_bn_eval(
    model: torch.nn.Module,
    modules: str | Sequence[str] | None = None,
    *,
    method: str = "fx",
    pairs: Iterable[Sequence[str]] | None = None,
) -> EfficientConvBN:
    """Context manager: efficient conv-bn eval for the pairs found in ``modules``.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
        >>> x = torch.randn(1, 3, 8, 8)
        >>> with efficient_conv_bn_eval(net) as ctx:
        ...     y = net(x)
        >>> ctx.pairs, torch.allclose(y, net(x), atol=1e-5)
        ([('0', '1')], True)
    """
    if pairs is None:
        pairs = find_conv_bn_pairs(model, modules, method=method)
    return EfficientConvBN(model, pairs)
