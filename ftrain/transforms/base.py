"""The protocol every transform implements.

A transform is a small immutable value (an ``attrs`` frozen class) that adds
behaviour to a :class:`~ftrain.step.Step` at fixed *phases*. The step runs the
phases in a fixed order, and within a phase the transforms by their
``stage`` number, so the order in which a user composes transforms never
changes what training does::

    step(state, batch), one call = one micro-batch
    │
    ├─ is_boundary(ctx)            does this micro-batch end an optimizer window?
    ├─ outer_context(ctx)  ┐       around forward AND backward (DDP no_sync)
    │   ├─ forward_context(ctx)  ┐ around the loss function (autocast, checkpointing)
    │   │     loss_fn(model, batch)
    │   │                        ┘
    │   ├─ after_forward(ctx, loss)     observe the loss (finiteness)
    │   ├─ scale_loss(ctx, loss)        divide for accumulation, multiply by the loss scale
    │   └─ loss.backward()
    │                      ┘
    └─ only on a boundary (or a flush of a partial window):
        ├─ before_update(ctx)   by stage: rescale a partial window (5), checks (6),
        │                       unscale (10), clip (30), finiteness decision (40)
        ├─ update(ctx)          the one transform that owns it (fp16 scaler) or optimizer.step()
        └─ after_update(ctx)    loss-scale update, statistics

    between calls: observe(state, tstate, metrics) an evaluation's metrics (Step.observe)

Each transform keeps its state in ``state.transforms[name]``: ``init``
creates it, and the phases read and write it through ``ctx.tstate[name]``.

An :class:`Executor` (``with_compile``) runs the same phases its own way; each transform
says how in its :attr:`Transform.tracing` (a :class:`Tracing`), so the executor never needs to
know the transforms by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

if TYPE_CHECKING:
    from ftrain.state import TrainState
    from ftrain.step import LossFn, Step, StepContext

__all__ = [
    "Transform",
    "Tracing",
    "Executor",
    "TRACEABLE_PHASES",
    "STAGE_RESCALE",
    "STAGE_CHECK",
    "STAGE_DECIDE",
    "STAGE_UNSCALE",
    "STAGE_CLIP",
]

STAGE_RESCALE = 5  # scale a flushed partial window to its true size
STAGE_CHECK = 6  # read-only checks of the gradients (unused parameters)
STAGE_UNSCALE = 10  # divide the gradients by the loss scale
STAGE_CLIP = 30  # clip the (unscaled, accumulated) gradient
STAGE_DECIDE = 40  # decide whether to skip the update (non-finite loss or gradient), after
#                    clipping so the decision reuses the gradient norm clipping computed


#: The phases a transform may ask ``with_compile`` to trace into its compiled update.
TRACEABLE_PHASES = frozenset({"before_update", "after_update"})


@attrs.frozen
class Tracing:
    """How ``with_compile`` runs a transform's phases (:attr:`Transform.tracing`).

    Every phase runs eagerly around the compiled code, in its place, unless listed here:

    - ``traced``: the update phases (``"before_update"``, ``"after_update"``) that run *inside*
      the compiled update program, fused with clipping and the optimizer's rule. Such a phase
      only computes with tensors (no host sync, no ``if`` on a tensor's value, no new frozen
      ``attrs`` value) and uses only ``ctx.tstate``, ``ctx.metrics`` (those the update wrote
      so far), ``ctx.grad_norm``, ``ctx.params_with_grad()``, ``ctx.model``, ``ctx.boundary``,
      ``ctx.flush`` and ``ctx.skip`` (read only): see
      :class:`~ftrain.transforms.compile.TracedContext`.
    - ``eager``: why the forward and backward must run eagerly while this transform takes
      part (e.g. it measures eager activations); ``None``: they are compiled around it.

    Example:
        >>> Tracing(traced={"before_update"})
        Tracing(traced=frozenset({'before_update'}), eager=None)
    """

    traced: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    eager: str | None = None

    def __attrs_post_init__(self) -> None:
        unknown = self.traced - TRACEABLE_PHASES
        if unknown:
            raise ValueError(
                f"Tracing(traced=...): {sorted(unknown)} cannot be traced into the compiled "
                f"update; traceable phases: {sorted(TRACEABLE_PHASES)}. Leave the others out: "
                "they run eagerly around the compiled code."
            )


class Transform:
    """Base class for transforms (``attrs`` frozen classes); override only the phases you need.

    ``name`` keys the transform's state in ``TrainState.transforms`` (one per step).
    """

    name: ClassVar[str] = "transform"
    stage: ClassVar[int] = 50
    #: Whether this transform owns the optimizer update (at most one may).
    owns_update: ClassVar[bool] = False
    #: How ``with_compile`` runs this transform's phases (a property where it depends on the
    #: transform's fields). The default: every phase eagerly, around the compiled code.
    tracing: ClassVar[Tracing] = Tracing()

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The transform's initial state (``None`` when it keeps none)."""
        return None

    def restore(self, saved: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """Turn saved data (from a checkpoint) into live state."""
        return load_saved(self.init(model, optimizer), saved)

    def pending(self, tstate: Any) -> int:
        """Micro-batches whose gradients wait for an update (accumulation)."""
        return 0

    def discard_window(self, tstate: Any) -> Any:
        """``tstate`` after the current accumulation window was thrown away."""
        return tstate

    def is_boundary(self, ctx: StepContext) -> bool:
        return True

    def outer_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_forward(self, ctx: StepContext, loss: torch.Tensor) -> None:
        return None

    def scale_loss(self, ctx: StepContext, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def before_update(self, ctx: StepContext) -> None:
        return None

    def update(self, ctx: StepContext) -> None:
        raise NotImplementedError

    def after_update(self, ctx: StepContext) -> None:
        return None

    def observe(self, state: TrainState, tstate: Any, metrics: Mapping[str, Any]) -> Any:
        """``tstate`` after an evaluation of ``state`` returned ``metrics`` (a plateau rule)."""
        return tstate

    def on_error(self, ctx: StepContext) -> None:
        """Undo per-call bookkeeping after a step call raised before its update."""
        return None

    @classmethod
    def overrides(cls, phase: str) -> bool:
        return getattr(cls, phase) is not getattr(Transform, phase)


class Executor(Transform):
    """A transform that runs the step's forward and update its own way (``with_compile``).

    A step has at most one. The step calls :meth:`loss_fn` at the start of each call and
    :meth:`update` on each boundary; the executor reads how to run each transform from its
    :attr:`~Transform.tracing`.
    """

    stage = 0

    def loss_fn(self, step: Step, ctx: StepContext) -> LossFn:
        """The function the step's forward calls this time (``step.loss_fn``: eagerly)."""
        return step.loss_fn

    def update(self, step: Step, ctx: StepContext) -> bool:
        """Run the whole update (``True``), or leave it to the step (``False``)."""
        return False


def load_saved(current: Any, saved: Any) -> Any:
    """Saved data (``ftrain.persist.state.to_saved``) loaded into live state shaped like ``current``."""
    if callable(getattr(current, "load_state_dict", None)):
        current.load_state_dict(saved)
        return current
    if attrs.has(type(current)):
        values = {
            f.name: load_saved(getattr(current, f.name), saved[f.name])
            for f in attrs.fields(type(current))
            if f.init and f.name in saved
        }
        return attrs.evolve(current, **{k.lstrip("_"): v for k, v in values.items()})
    if isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(device=current.device, dtype=current.dtype).clone()
    if isinstance(current, dict) and isinstance(saved, dict):
        return {k: load_saved(current[k], v) if k in current else v for k, v in saved.items()}
    if isinstance(current, (list, tuple)) and isinstance(saved, (list, tuple)):
        if len(current) == len(saved):
            return type(current)(load_saved(c, s) for c, s in zip(current, saved))
    return saved
