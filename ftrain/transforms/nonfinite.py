"""What to do when a loss or the gradient is NaN or infinite: raise (detectron2) or skip."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain.errors import NonFiniteLossError
from ftrain.loss import data_parallel_world
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


def _world(model: torch.nn.Module) -> tuple[int, int]:
    """(rank, world size) of the ranks sharing ``model``'s gradient (DDP/FSDP2); (0, 1)
    for a plain module, which trains on its own even under a process group."""
    world = data_parallel_world(model)
    if world == 1:
        return 0, 1
    return torch.distributed.get_rank(), world


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _nonfinite(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d float tensor on ``device``: 1 when any element of ``grads`` is NaN or ±inf.

    The largest magnitude of each tensor (``inf``-norm: NaN propagates, and
    unlike a 2-norm it cannot overflow on large finite values), per device,
    with no host synchronisation.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    flags = []
    for group in by_device.values():
        amax = torch.stack(torch._foreach_norm(group, float("inf"))).float().amax()
        flags.append((~torch.isfinite(amax)).to(device))
    if not flags:
        return torch.zeros((), device=device)
    return torch.stack(flags).any().float()


_DDP = torch.nn.parallel.DistributedDataParallel


def _gather_flags(
    loss_bad: torch.Tensor, grad_bad: torch.Tensor, rank: int, world: int, device: torch.device
) -> torch.Tensor:
    """Every rank's loss flag, then the gradient flag, summed over the ranks (a collective)."""
    flags = torch.zeros(world + 1, device=device)
    flags[rank] = loss_bad
    flags[world] = grad_bad
    torch.distributed.all_reduce(flags)
    return flags


@attrs.frozen
class NonFiniteCheck(Transform):
    """Check the window's losses and the gradient before the update. See :func:`with_nonfinite_check`."""

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
        if st.window:
            losses = torch.cat([t.reshape(-1).float() for t in st.window])
            device = losses.device
            loss_bad = (~torch.isfinite(losses)).any().float()
        elif params:  # a flushed window restored without its losses
            losses, device = None, _local(params[0]).device
            loss_bad = torch.zeros((), device=device)
        else:
            return
        # The gradient: a loss scaler (fp16) checks it itself and skips an overflow;
        # otherwise the norm clipping computed (the same on every rank), or our own.
        amp = ctx.tstate.get("amp")
        scaled = amp is not None and getattr(amp, "scaler", None) is not None
        if scaled or not params:
            grad_bad = torch.zeros((), device=device)
        elif ctx.grad_norm is not None:
            grad_bad = (~torch.isfinite(ctx.grad_norm.detach())).float().to(device)
        else:
            grad_bad = _nonfinite([_local(p.grad) for p in params], device)
        # Folded: the gradient flag is already the same on every rank and covers every
        # rank's loss (poisoned in scale_loss): DDP's all-reduced gradient, or the global
        # norm clipping computed. Otherwise one small all-reduce of the flags per update.
        folded = world == 1 or (
            not scaled
            and bool(params)
            and (ctx.grad_norm is not None or isinstance(ctx.model, _DDP))
        )
        flags = None
        if folded:
            bad_any = (loss_bad + grad_bad) > 0
        else:
            flags = _gather_flags(loss_bad, grad_bad, rank, world, device)
            bad_any = flags.sum() > 0
        if not bool(bad_any):  # one host sync per optimizer update
            ctx.tstate["nonfinite"] = NonFiniteState((), st.skipped)
            ctx.metrics.setdefault("skipped", torch.zeros((), dtype=torch.bool))
            return
        if self.action == "raise":
            if flags is None and world > 1:  # every rank raises: name the rank(s) that saw it
                flags = _gather_flags(loss_bad, grad_bad, rank, world, device)
            raise NonFiniteLossError(self._message(ctx, st, losses, flags, rank, world))
        ctx.skip = True
        ctx.tstate["nonfinite"] = NonFiniteState((), st.skipped + 1)
        ctx.metrics["skipped"] = torch.ones((), dtype=torch.bool)

    def _message(self, ctx, st, losses, flags, rank, world) -> str:
        state = ctx.state
        first = state.micro_step - len(st.window) + 1
        where = f"step {state.step} (micro-batches {first}..{state.micro_step})"
        if flags is not None:
            values = flags.tolist()
            ranks = [r for r in range(world) if values[r] > 0]
            grad = values[world] > 0 or ctx.grad_norm is not None and not ranks
        else:
            ranks = []
            grad = losses is None or bool(torch.isfinite(losses).all())
        if ranks:
            what = f"Loss became non-finite at {where} on rank(s) {ranks}" + (
                f": losses on this rank (rank {rank}) = {losses.tolist()}"
                if rank in ranks
                else f" (this is rank {rank}, whose losses were finite)"
            )
        elif losses is not None and not bool(torch.isfinite(losses).all()):
            what = f"Loss became non-finite at {where}: losses = {losses.tolist()}"
        elif grad:
            norm = "" if ctx.grad_norm is None else f" (grad_norm = {float(ctx.grad_norm)})"
            what = (
                f"The gradient became non-finite at {where} although the loss was finite"
                f"{norm}: an operation with an infinite derivative (sqrt or log at 0, "
                "pow with a negative exponent at 0...)"
            )
        else:  # pragma: no cover - the flags said so
            what = f"A non-finite value was seen at {where}"
        return (
            f"{what}. The update was not applied on any rank: weights and optimizer are those "
            "of the last good update, and `err.state` continues from there. Lower the "
            "learning rate, add `with_clip(...)`, check the data (and the loss function's "
            "derivative), or use `with_nonfinite_check(step, action='skip')` to skip such "
            "updates."
        )


def with_nonfinite_check(step: Step, action: str = "raise") -> Step:
    """Check that every loss of an optimizer window, and the gradient, are finite.

    The gradient is checked too: a finite loss can have an infinite gradient
    (``sqrt`` at 0). With ``with_clip`` the check reuses the norm clipping
    computes (before clipping); without it, the largest gradient magnitude is
    computed on the device. With an fp16 loss scaler (``with_amp``) the
    scaler checks the gradient itself (an overflow is skipped and the scale
    backed off); this check then covers the losses.

    Under DDP/FSDP2 every rank takes the same decision: a non-finite loss
    poisons its rank's gradient (NaN), so the gradient's own collective
    carries the flag to every rank. Under DDP (all-reduced gradients) and
    with ``with_clip`` (a global norm) that costs no extra communication;
    otherwise (FSDP2 without clipping, an fp16 loss scaler) the flags travel
    in one all-reduce of ``world_size + 1`` numbers per update. A NaN loss
    on one rank makes every rank skip, or raise (the message names the rank
    that saw it).

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
