"""Several optimizers seen as one: what a step bound to several named optimizers updates.

A :class:`~ftrain.state.TrainState` created with named optimizers, and a step bound to more
than one of them (``make_step(loss_fn, optimizer=("backbone", "head"))``), hands its
transforms an :class:`OptimizerGroup`: their param groups in order (the members' own dicts,
so a schedule written into it reaches them), ``step()`` and ``zero_grad()`` of each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["OptimizerGroup"]


class OptimizerGroup(torch.optim.Optimizer):
    """The named optimizers ``members`` as one optimizer (a view: it holds no state).

    ``param_groups`` are the members' (the same dicts, in order), ``state`` their
    states; ``step()`` steps each member in order, ``zero_grad()`` clears each. It is not
    saved: a checkpoint holds each member under its name.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> group = OptimizerGroup({"a": torch.optim.SGD(a.parameters(), lr=0.1),
        ...                         "b": torch.optim.AdamW(b.parameters(), lr=1e-3)})
        >>> group.names, [g["lr"] for g in group.param_groups]
        (('a', 'b'), [0.1, 0.001])
    """

    def __init__(self, members: Mapping[str, torch.optim.Optimizer]) -> None:
        # Optimizer.__init__ is not called: it would copy the param groups, and a schedule
        # written into the copies would never reach the members.
        self.names: tuple[str, ...] = tuple(members)
        self.optimizers: tuple[torch.optim.Optimizer, ...] = tuple(members.values())
        self.defaults: dict[str, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("OptimizerGroup.step: a closure is not supported.")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in zip(self.names, self.optimizers)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        for name, opt in zip(self.names, self.optimizers):
            opt.load_state_dict(state_dict[name])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError(
            "OptimizerGroup.add_param_group: add the group to one of its optimizers "
            f"({', '.join(self.names)}): state.optimizers[name].add_param_group(...)."
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={type(o).__name__}" for n, o in zip(self.names, self.optimizers))
        return f"OptimizerGroup({inner})"
