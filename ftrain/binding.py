"""A step bound to named optimizers: which optimizer(s) it updates, and its gradients kept apart.

A :class:`~ftrain.state.TrainState` created with several optimizers by name is trained by
steps bound to the ones they update (``make_step(loss_fn, optimizer="disc")``). A bound step
starts each optimizer window from clean gradients of its own parameters, and its backward
leaves the gradients of every other parameter as they were (another step's window, or none):
what ``opt.zero_grad()`` before each backward does in a hand-written two-optimizer loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from ftrain.state import TrainState

__all__ = ["Binding", "bind", "optimizer_of", "check_names"]


def check_names(optimizer: str | Sequence[str] | None) -> tuple[str, ...]:
    """``make_step``'s ``optimizer=``: the names as a tuple (``()``: the state's one optimizer).

    Example:
        >>> check_names("disc"), check_names(("backbone", "head")), check_names(None)
        (('disc',), ('backbone', 'head'), ())
    """
    if optimizer is None or optimizer == ():
        return ()
    names = (optimizer,) if isinstance(optimizer, str) else tuple(optimizer)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(
            "make_step: optimizer= names the optimizer(s) the step updates, as the state's "
            "dict names them: a name ('disc') or distinct names (('backbone', 'head')); got "
            f"{optimizer!r}."
        )
    return names


def optimizer_of(state: TrainState, names: tuple[str, ...]) -> torch.optim.Optimizer:
    """The optimizer a step bound to ``names`` updates: the state's one optimizer (``()``),
    the named one, or several as one :class:`~ftrain.optim.group.OptimizerGroup`.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 1)})
        >>> s = ftrain.TrainState.create(m, {"a": torch.optim.SGD(m.a.parameters(), lr=0.1),
        ...                                  "b": torch.optim.SGD(m.b.parameters(), lr=0.1)})
        >>> optimizer_of(s, ("b",)) is s.optimizers["b"], optimizer_of(s, ("a", "b"))
        (True, OptimizerGroup(a=SGD, b=SGD))
    """
    if not names:
        return state.optimizer  # (its error names the fix on a state with several)
    held = state.optimizers
    if not held:
        raise ValueError(
            f"This step is bound to optimizer(s) {list(names)}, but the state was created with "
            "one optimizer, not by name: create it with TrainState.create(model, "
            f"{{{names[0]!r}: optimizer, ...}}), or make the step without optimizer=."
        )
    if missing := [n for n in names if n not in held]:
        raise KeyError(
            f"This step is bound to optimizer(s) {missing} that the state does not hold; its "
            f"optimizers are {list(held)}: make_step(loss_fn, optimizer={next(iter(held))!r})."
        )
    if len(names) == 1:
        return held[names[0]]
    from ftrain.optim.group import OptimizerGroup

    return OptimizerGroup({n: held[n] for n in names})


@attrs.frozen(eq=False)
class Binding:
    """A bound step's optimizer over a state's tensors: ``optimizer`` (one, or the group),
    ``optimizers`` (the torch optimizers it steps, in order), ``own`` (their parameters) and
    ``others`` (the model's other parameters, whose gradients its backward leaves alone)."""

    optimizer: torch.optim.Optimizer
    optimizers: tuple[torch.optim.Optimizer, ...]
    own: tuple[torch.Tensor, ...]
    others: tuple[torch.Tensor, ...]
    #: :func:`layout` of the state's optimizers when bound (a param group added since
    #: rebinds: its parameters are trained by the step bound to it, left alone by the others).
    layout: tuple[int, ...] = ()

    def fits(self, state: TrainState, names: tuple[str, ...]) -> bool:
        """Whether this binding is still the one of ``state`` (same optimizers, same param
        groups)."""
        held = state.optimizers
        return (
            len(names) == len(self.optimizers)
            and all(held.get(n) is o for n, o in zip(names, self.optimizers))
            and layout(held) == self.layout
        )

    def isolate(self, window_start: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Before a backward: clear the own gradients at a window's start, and set the other
        parameters' aside (:meth:`restore` puts them back)."""
        if window_start:
            for p in self.own:
                p.grad = None
        kept = [(p, p.grad) for p in self.others]
        for p in self.others:
            p.grad = None
        return kept

    @staticmethod
    def restore(kept: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """After the backward: the other parameters' gradients as they were before it."""
        for p, grad in kept:
            p.grad = grad


def layout(optimizers: Mapping[str, torch.optim.Optimizer]) -> tuple[int, ...]:
    """The parameter count of every param group of ``optimizers``: what
    ``add_param_group`` changes (cheap enough to compare at every step).

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(a.parameters(), lr=0.1)
        >>> before = layout({"opt": opt})
        >>> opt.add_param_group({"params": b.parameters()})
        >>> before, layout({"opt": opt})
        ((2,), (2, 2))
    """
    return tuple(len(g["params"]) for o in optimizers.values() for g in o.param_groups)


def bind(state: TrainState, names: tuple[str, ...]) -> Binding:
    """The :class:`Binding` of a step bound to ``names`` over ``state``'s tensors."""
    optimizer = optimizer_of(state, names)
    optimizers = tuple(state.optimizers[n] for n in names)
    own = {id(p): p for opt in optimizers for g in opt.param_groups for p in g["params"]}
    others = tuple(p for p in state.model.parameters() if id(p) not in own)
    return Binding(optimizer, optimizers, tuple(own.values()), others, layout(state.optimizers))
