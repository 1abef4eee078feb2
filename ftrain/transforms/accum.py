"""Gradient accumulation: one optimizer update per ``every`` micro-batches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
import torch

from ftrain.loss import divide_by_count
from ftrain.transforms.base import STAGE_RESCALE, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_grad_accum", "GradAccum", "AccumState", "no_sync"]


@attrs.frozen
class AccumState:
    """Micro-batches accumulated, waiting for an update; ``count``: a SummedLoss's window count."""

    pending: int = 0
    count: torch.Tensor | None = None


@contextlib.contextmanager
def _fsdp2_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Skip the gradient reduction for a micro-batch (DDP ``no_sync``, FSDP2/HSDP
    ``set_requires_gradient_sync(False)``); a no-op for a plain module."""
    if hasattr(model, "no_sync"):  # DistributedDataParallel
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 fully_shard
        return _fsdp2_no_sync(model)
    return contextlib.nullcontext()


_SYNCS = ("auto", "boundary", "each")


def _skips_sync(model: torch.nn.Module, sync: str) -> bool:
    """Whether a non-boundary micro-batch skips the gradient reduction: ``"auto"`` skips it
    under DDP (its gradients are whole anyway), not under FSDP2 (they stay sharded)."""
    if sync == "auto":
        return hasattr(model, "no_sync")  # DistributedDataParallel
    return sync == "boundary"


@attrs.frozen(repr=False)
class GradAccum(Transform):
    """Accumulate gradients over ``every`` micro-batches. See :func:`with_grad_accum`."""

    every: int
    sync: str = "auto"
    name = "accum"
    stage = STAGE_RESCALE

    def __repr__(self) -> str:
        sync = "" if self.sync == "auto" else f", sync={self.sync!r}"
        return f"GradAccum(every={self.every}{sync})"

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> AccumState:
        return AccumState()

    def pending(self, tstate: AccumState | None) -> int:
        return 0 if tstate is None else tstate.pending

    def restore(self, saved, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        saved = saved if hasattr(saved, "get") else {}
        count = saved.get("count")
        if isinstance(count, torch.Tensor):
            count = count.to(next((p.device for p in model.parameters()), torch.device("cpu")))
        return AccumState(int(saved.get("pending", 0)), count)

    def discard_window(self, tstate: AccumState) -> AccumState:
        return AccumState()

    def is_boundary(self, ctx: StepContext) -> bool:
        st = ctx.tstate["accum"]
        pending = st.pending + 1
        boundary = pending >= self.every
        ctx.tstate["accum"] = AccumState(0 if boundary else pending, st.count)
        return boundary

    def outer_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        if ctx.boundary or not _skips_sync(ctx.model, self.sync):
            return contextlib.nullcontext()
        return no_sync(ctx.model)

    def after_forward(self, ctx: StepContext, loss: torch.Tensor) -> None:
        st = ctx.tstate["accum"]
        count = ctx.loss_count
        first = self.every == 1 or (not ctx.boundary and st.pending == 1)
        if st.count is not None if count is None else st.count is None and not first:
            was, now = ("a SummedLoss", "a plain loss")[:: 1 if count is None else -1]
            raise TypeError(
                f"with_grad_accum: loss_fn returned {was} earlier in this window and {now} "
                "now; return the same form for every micro-batch."
            )
        if count is None:
            return
        ctx.loss_count = None  # the window's total is applied at the update
        ctx.tstate["accum"] = AccumState(
            st.pending, count if st.count is None else st.count + count
        )

    def scale_loss(self, ctx: StepContext, loss: torch.Tensor) -> torch.Tensor:
        if ctx.tstate["accum"].count is not None:
            return loss  # a summed loss: divided by the window's count at the update
        return loss / self.every

    def before_update(self, ctx: StepContext) -> None:
        st = ctx.tstate["accum"]
        if st.count is not None:
            divide_by_count(ctx.params_with_grad(), st.count, ctx.model)
            ctx.tstate["accum"] = AccumState()
        elif ctx.flush:  # a partial window: each micro-batch was divided by `every`
            grads = [p.grad for p in ctx.params_with_grad()]
            if grads:
                torch._foreach_mul_(grads, self.every / ctx.flush)
            ctx.tstate["accum"] = AccumState()


def with_grad_accum(step: Step, every: int, *, sync: str = "auto") -> Step:
    """Apply the optimizer once per ``every`` micro-batches.

    Each loss is divided by ``every`` (a :class:`~ftrain.loss.SummedLoss` window by
    its total count); ``step.flush(state)`` applies a partial window at its true
    size. A mid-window checkpoint resumes exactly.

    ``sync``: when gradients are reduced over the ranks. ``"auto"``: DDP only at the
    window's last micro-batch (``no_sync`` before: its gradients are whole on every rank
    anyway); FSDP2/HSDP at every micro-batch (a reduce-scatter each, so each rank keeps
    only its shard of the gradient). ``"boundary"``: also FSDP2 only at the last one
    (``every - 1`` fewer reduce-scatters per window, but every rank holds the whole
    model's unsharded gradient, in the reduce dtype, between micro-batches: world size
    times the sharded gradient). ``"each"``: also DDP at every micro-batch (more
    communication, no memory saved).

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_grad_accum(ftrain.make_step(lambda m, b: m(b).mean()), every=4)
        >>> step["accum"]
        GradAccum(every=4)
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"with_grad_accum: every must be a whole number >= 1 (micro-batches per update), "
            f"got {every!r}."
        )
    if sync not in _SYNCS:
        raise ValueError(f"with_grad_accum: sync must be one of {_SYNCS}, got {sync!r}.")
    return step.with_transform(GradAccum(every=every, sync=sync))
