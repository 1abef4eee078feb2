"""What to do when a loss is NaN or infinite: raise (detectron2) or skip the update."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain.errors import NonFiniteLossError
from ftrain.transforms.base import STAGE_DECIDE, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_nonfinite_check", "NonFiniteCheck", "NonFiniteState"]


@attrs.frozen(repr=False)
class NonFiniteState:
    """Losses of the current window (device tensors) and updates skipped so far."""

    window: tuple[torch.Tensor, ...] = ()
    skipped: int = 0

    def __repr__(self) -> str:
        return f"NonFiniteState(skipped={self.skipped})"


@attrs.frozen
class NonFiniteCheck(Transform):
    """Check the window's losses before the update. See :func:`with_nonfinite_check`."""

    action: str = "raise"
    name = "nonfinite"
    stage = STAGE_DECIDE

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> NonFiniteState:
        return NonFiniteState()

    def restore(
        self, saved: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> NonFiniteState:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        window = tuple(t.to(device) for t in saved.get("window", ()))
        return NonFiniteState(window=window, skipped=int(saved.get("skipped", 0)))

    def discard_window(self, tstate: NonFiniteState) -> NonFiniteState:
        return attrs.evolve(tstate, window=())

    def after_forward(self, ctx: StepContext, loss: torch.Tensor) -> None:
        st: NonFiniteState = ctx.tstate["nonfinite"]
        ctx.tstate["nonfinite"] = NonFiniteState(st.window + (loss.detach(),), st.skipped)

    def before_update(self, ctx: StepContext) -> None:
        st: NonFiniteState = ctx.tstate["nonfinite"]
        if not st.window:
            return
        losses = torch.cat([t.reshape(-1).float() for t in st.window])
        finite = bool(torch.isfinite(losses).all())  # one host sync per optimizer update
        if finite:
            ctx.tstate["nonfinite"] = NonFiniteState((), st.skipped)
            ctx.metrics.setdefault("skipped", torch.zeros((), dtype=torch.bool))
            return
        if self.action == "raise":
            state = ctx.state
            first = state.micro_step - len(st.window) + 1
            raise NonFiniteLossError(
                f"Loss became non-finite at step {state.step} (micro-batches {first}.."
                f"{state.micro_step}): losses = {losses.tolist()}. The update was not applied: "
                "weights and optimizer are those of the last good update, and `err.state` "
                "continues from there. Lower the learning rate, add "
                "`with_clip(...)`, check the data, or use "
                "`with_nonfinite_check(step, action='skip')` to skip such updates."
            )
        ctx.skip = True
        ctx.tstate["nonfinite"] = NonFiniteState((), st.skipped + 1)
        ctx.metrics["skipped"] = torch.ones((), dtype=torch.bool)


def with_nonfinite_check(step: Step, action: str = "raise") -> Step:
    """Check that every loss of an optimizer window is finite before updating.

    ``action="raise"`` raises :class:`~ftrain.errors.NonFiniteLossError` (a
    ``FloatingPointError``) naming the step and the loss values, before any
    weight changes (detectron2's behaviour, without losing data: the error's
    ``state`` attribute is a valid state to continue from).
    ``action="skip"`` skips the update, drops the window's gradients, and
    counts it in ``state.transforms["nonfinite"].skipped``; the metric
    ``skipped`` says so. The decision costs one host synchronisation per
    optimizer update (not per micro-batch).

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_nonfinite_check(ftrain.make_step(lambda m, b: m(b).mean()), "skip")
        >>> step["nonfinite"]
        NonFiniteCheck(action='skip')
    """
    if action not in ("raise", "skip"):
        raise ValueError(f"with_nonfinite_check: action must be 'raise' or 'skip', got {action!r}.")
    return step.with_transform(NonFiniteCheck(action=action))
