"""What to do when a loss or the gradient is NaN or infinite: raise (detectron2) or skip."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ftrain._tensors import local_tensor as _local
from ftrain.errors import NonFiniteLossError
from ftrain.loss import data_parallel_world
from ftrain.transforms.amp import AmpState
from ftrain.transforms.base import STAGE_DECIDE, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_nonfinite_check", "NonFiniteCheck", "NonFiniteState"]


@attrs.frozen(repr=False)
class NonFiniteState:
    """Losses of the current window (device tensors), updates skipped so far, and in a row."""

    window: tuple[torch.Tensor, ...] = ()
    skipped: int = 0
    streak: int = 0

    def __repr__(self) -> str:
        return f"NonFiniteState(skipped={self.skipped}, streak={self.streak})"


def _world(model: torch.nn.Module) -> tuple[int, int]:
    """(rank, world size) of the ranks sharing ``model``'s gradient (DDP/FSDP2); (0, 1)
    for a plain module, which trains on its own even under a process group."""
    world = data_parallel_world(model)
    return (0, 1) if world == 1 else (torch.distributed.get_rank(), world)


def _nonfinite(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d float tensor on ``device``: 1 when any element of ``grads`` is NaN or ±inf, with
    no host sync. The ``inf``-norm: NaN propagates, and unlike a 2-norm it cannot overflow."""
    if not grads:
        return torch.zeros((), device=device)
    amax = torch.nn.utils.get_total_norm(grads, float("inf"))
    return (~torch.isfinite(amax)).float().to(device)


def _sum_over_ranks(flags: torch.Tensor) -> torch.Tensor:
    """``flags`` summed over the ranks (a small all-reduce; a new tensor)."""
    flags = flags.clone()
    torch.distributed.all_reduce(flags)
    return flags


def _rank_flags(loss_bad: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Which ranks saw a non-finite loss (a collective; only on the way to an error)."""
    flags = torch.zeros(world, device=loss_bad.device)
    flags[rank] = loss_bad
    return _sum_over_ranks(flags)


def _window_losses(
    st: NonFiniteState, params: list[torch.Tensor]
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The window's losses and whether one is non-finite (``None``: nothing to check)."""
    if st.window:
        losses = torch.cat([t.reshape(-1).float() for t in st.window])
        return losses, (~torch.isfinite(losses)).any().float()
    if params:  # a flushed window restored without its losses
        return None, torch.zeros((), device=_local(params[0]).device)
    return None


@attrs.frozen
class NonFiniteCheck(Transform):
    """Check the window's losses and the gradient before the update. See :func:`with_nonfinite_check`."""

    action: str = "raise"
    warn_after: int | None = 10
    name = "nonfinite"
    stage = STAGE_DECIDE

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> NonFiniteState:
        return NonFiniteState()

    def restore(
        self, saved: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> NonFiniteState:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        window = tuple(t.to(device) for t in saved.get("window", ()))
        return NonFiniteState(window, int(saved.get("skipped", 0)), int(saved.get("streak", 0)))

    def discard_window(self, tstate: NonFiniteState) -> NonFiniteState:
        return attrs.evolve(tstate, window=())

    def after_forward(self, ctx: StepContext, loss: torch.Tensor) -> None:
        st: NonFiniteState = ctx.tstate["nonfinite"]
        ctx.tstate["nonfinite"] = attrs.evolve(st, window=st.window + (loss.detach(),))

    def scale_loss(self, ctx: StepContext, loss: torch.Tensor) -> torch.Tensor:
        if _world(ctx.model)[1] == 1:
            return loss
        # A non-finite loss poisons this rank's gradient (NaN), so the gradient's own
        # collective (DDP's all-reduce; FSDP2's reduce-scatter, then clipping's norm)
        # carries the flag to every rank. A finite loss is multiplied by exactly 1.
        factor = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
        return loss * factor

    def before_update(self, ctx: StepContext) -> None:
        st: NonFiniteState = ctx.tstate["nonfinite"]
        rank, world = _world(ctx.model)
        params = ctx.params_with_grad()
        found = _window_losses(st, params)
        if found is None:
            return
        losses, loss_bad = found
        if not self._agreed_bad(ctx, params, loss_bad, world):  # one host sync per update
            ctx.tstate["nonfinite"] = NonFiniteState((), st.skipped, 0)
            ctx.metrics.setdefault("skipped", torch.zeros((), dtype=torch.bool))
            return
        if self.action == "raise":  # every rank raises: name the rank(s) that saw it
            flags = _rank_flags(loss_bad, rank, world) if world > 1 else None
            raise NonFiniteLossError(self._message(ctx, st, losses, flags, rank, world))
        self._skip(ctx, st)

    def _agreed_bad(
        self, ctx: StepContext, params: list, loss_bad: torch.Tensor, world: int
    ) -> bool:
        """Whether any rank's loss, or the gradient, is non-finite: the same on every rank.

        No collective of its own where one already carries the flag (a non-finite loss
        poisons its rank's gradient in :meth:`scale_loss`): the all-reduced DDP gradient,
        clipping's global norm, or a loss scaler's overflow flag. With a scaler an overflow
        alone is the scaler's to skip, so only when it (or a loss) is non-finite the ranks
        agree the losses (a small all-reduce, on that update only). Else (FSDP2 without
        clipping) one all-reduce of two numbers."""
        device = loss_bad.device
        amp = ctx.tstate.get("amp")
        overflow = amp.overflow(*ctx.optimizers) if isinstance(amp, AmpState) else None
        if overflow is not None:  # fp16: a non-finite gradient is an overflow
            suspect = bool((loss_bad + overflow.to(device)) > 0)
            return suspect and bool(_sum_over_ranks(loss_bad) > 0 if world > 1 else loss_bad > 0)
        if ctx.grad_norm is not None:
            grad_bad = (~torch.isfinite(ctx.grad_norm.detach())).float().to(device)
        elif params:
            grad_bad = _nonfinite([_local(p.grad) for p in params], device)
        else:
            grad_bad = torch.zeros((), device=device)
        folded = world == 1 or (
            bool(params) and (ctx.grad_norm is not None or isinstance(ctx.model, DDP))
        )
        flags = torch.stack([loss_bad, grad_bad])
        return bool((flags if folded else _sum_over_ranks(flags)).sum() > 0)

    def _skip(self, ctx: StepContext, st: NonFiniteState) -> None:
        ctx.skip = True
        ctx.tstate["nonfinite"] = NonFiniteState((), st.skipped + 1, st.streak + 1)
        ctx.metrics["skipped"] = torch.ones((), dtype=torch.bool)
        if st.streak + 1 == self.warn_after:  # the host already knows: no extra sync
            last = ctx.state.step + 1  # the update being skipped
            warnings.warn(
                f"with_nonfinite_check skipped {self.warn_after} updates in a row (updates "
                f"{last - self.warn_after + 1} to {last}): the loss or the gradient "
                "was NaN/inf each time, so the model is not training. Likely causes: a learning "
                "rate too high (lower it or warm it up; add with_clip), an fp16 overflow (use "
                "bf16, or with_amp's loss scaling), bad data (NaN/inf in the batches), or a loss "
                "with an infinite derivative (sqrt or log at 0). action='raise' stops at the "
                "first one with the values.",
                stacklevel=3,
            )

    def _message(self, ctx, st, losses, flags, rank, world) -> str:
        state = ctx.state
        first = state.micro_step - len(st.window) + 1
        where = f"step {state.step} (micro-batches {first}..{state.micro_step})"
        ranks = [] if flags is None else [r for r, bad in enumerate(flags.tolist()[:world]) if bad]
        if ranks:
            what = f"Loss became non-finite at {where} on rank(s) {ranks}" + (
                f": losses on this rank (rank {rank}) = {losses.tolist()}"
                if rank in ranks
                else f" (this is rank {rank}, whose losses were finite)"
            )
        elif losses is not None and not bool(torch.isfinite(losses).all()):
            what = f"Loss became non-finite at {where}: losses = {losses.tolist()}"
        else:  # the flags (or this rank's losses) say: not a loss, so the gradient
            norm = "" if ctx.grad_norm is None else f" (grad_norm = {float(ctx.grad_norm)})"
            what = (
                f"The gradient became non-finite at {where} although the loss was finite"
                f"{norm}: an operation with an infinite derivative (sqrt or log at 0, "
                "pow with a negative exponent at 0...)"
            )
        return (
            f"{what}. The update was not applied on any rank: weights and optimizer are those "
            "of the last good update, and `err.state` continues from there. Lower the "
            "learning rate, add `with_clip(...)`, check the data (and the loss function's "
            "derivative), or use `with_nonfinite_check(step, action='skip')` to skip such "
            "updates."
        )


def with_nonfinite_check(step: Step, action: str = "raise", *, warn_after: int | None = 10) -> Step:
    """Check that every loss of an optimizer window, and the gradient, are finite.

    The gradient through ``with_clip``'s norm, else its largest magnitude (an fp16 loss scaler
    checks it itself). ``action="raise"``: :class:`~ftrain.errors.NonFiniteLossError` naming
    the step and the losses, before any weight changes (its ``state`` continues from the last
    good update). ``action="skip"``: the update is skipped (metric ``skipped``); ``warn_after``
    skips in a row warn (``None``: never). MMEngine's ``CheckInvalidLossHook`` maps here.

    One host sync per optimizer update. Under DDP/FSDP2 every rank decides alike (a bad loss
    poisons its rank's gradient, whose collective carries the flag).

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_nonfinite_check(ftrain.make_step(lambda m, b: m(b).mean()), "skip")
        >>> step["nonfinite"]
        NonFiniteCheck(action='skip', warn_after=10)
    """
    if action not in ("raise", "skip"):
        raise ValueError(f"with_nonfinite_check: action must be 'raise' or 'skip', got {action!r}.")
    if warn_after is not None and (
        isinstance(warn_after, bool) or not isinstance(warn_after, int) or warn_after < 1
    ):
        raise TypeError(
            "with_nonfinite_check: warn_after must be a whole number >= 1 (updates skipped in a "
            f"row before a warning) or None (never warn), got {warn_after!r}."
        )
    return step.with_transform(NonFiniteCheck(action=action, warn_after=warn_after))
