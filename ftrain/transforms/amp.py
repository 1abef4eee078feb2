"""Automatic mixed precision: autocast, and loss scaling for float16."""

from __future__ import annotations

import collections
import contextlib
import sys
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain.transforms.base import STAGE_UNSCALE, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_amp", "Amp", "AmpState"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_DTYPES.update(dict.fromkeys(("fp16", "float16", "half"), torch.float16))
_SCALER_KEYS = {"init_scale", "growth_factor", "backoff_factor", "growth_interval"}


def _device_type(model: torch.nn.Module) -> str:
    """Where the model computes: its parameters' device, or their mesh's (FSDP2 CPU offload)."""
    p = next(model.parameters(), None)
    if p is None:
        return "cpu"
    mesh_type = getattr(getattr(p, "device_mesh", None), "device_type", None)
    return mesh_type if isinstance(mesh_type, str) else p.device.type


def _found_inf(found: dict[Any, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The overflow flags of every device (a model over several GPUs) summed on ``device``."""
    total = torch.zeros((), device=device)
    for flag in found.values():
        total = total + flag.to(device, non_blocking=True)
    return total


def param_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype each FSDP2 unit of ``model`` gathers and computes in, by unit name (``""``:
    the root): its ``MixedPrecisionPolicy.param_dtype``, else its parameters' own. Units
    without parameters are left out; ``{}`` for a model that is not FSDP2.

    Example:
        >>> import torch
        >>> from ftrain.transforms.amp import param_dtypes
        >>> param_dtypes(torch.nn.Linear(2, 1))
        {}
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 model exists
    out: dict[str, torch.dtype] = {}
    for name, m in model.named_modules() if fsdp is not None else ():
        if isinstance(m, fsdp.FSDPModule):
            state = m._get_fsdp_state()
            params = [p.sharded_param for g in state._fsdp_param_groups for p in g.fsdp_params]
            if params:
                out[name] = state._mp_policy.param_dtype or params[0].dtype
    return out


def _check_fsdp2_policy(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Refuse autocast over FSDP2 units that gather and compute in another dtype (fp32):
    autocast would keep a low-precision copy of every weight from forward to backward."""
    wrong = {n or "<root>": d for n, d in param_dtypes(model).items() if d != dtype}
    if wrong:
        short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        raise ValueError(
            f"with_amp({short}): FSDP2 units {sorted(wrong)} gather and compute in "
            f"{sorted({str(d) for d in wrong.values()})}, not {dtype}: autocast over them would "
            "keep a low-precision copy of every weight alive from forward to backward and "
            f"all-gather in full precision. Wrap with ftrain.dist.wrap(model, 'fsdp2', "
            f"mixed_precision={short!r}) (FSDP2's MixedPrecisionPolicy: {short} parameters, "
            "fp32 gradient reduction), or pass mixed_precision=MixedPrecisionPolicy(...) to "
            "choose the reduction dtype."
        )


@attrs.frozen(repr=False)
class AmpState:
    """The AMP state kept in the ``TrainState``: device type and loss scaler."""

    device_type: str
    scaler: torch.amp.GradScaler | None = attrs.field(default=None, eq=False)
    #: updates skipped for overflow so far (a device tensor once counting starts)
    skipped: torch.Tensor | int = 0

    def overflow(self, *optimizers: torch.optim.Optimizer) -> torch.Tensor | None:
        """This update's overflow flag (> 0: an inf/NaN gradient of any of ``optimizers``)
        once the gradients were unscaled; ``None`` without a loss scaler (or before
        unscaling). The same on every rank: DDP's gradients are all-reduced, FSDP2 reduces
        the flag as it unscales.

        Example:
            >>> import torch
            >>> from ftrain.transforms.amp import AmpState
            >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            >>> AmpState("cpu").overflow(opt) is None   # bf16: no loss scaler
            True
        """
        scaler = self.scaler
        if scaler is None or scaler._scale is None:
            return None
        found = [f for opt in optimizers for f in scaler._found_inf_per_device(opt).values()]
        return _found_inf(dict(enumerate(found)), scaler._scale.device) if found else None

    def __repr__(self) -> str:
        if self.scaler is None:
            return f"AmpState({self.device_type}, no loss scaling)"
        scale = self.scaler._scale
        scale = self.scaler._init_scale if scale is None else float(scale)
        return f"AmpState({self.device_type}, loss_scale={scale:g}, skipped={int(self.skipped)})"


@attrs.frozen
class Amp(Transform):
    """Autocast the forward pass; scale the loss for float16. See :func:`with_amp`."""

    dtype: torch.dtype = torch.bfloat16
    loss_scale: str | float | dict | None = None
    name = "amp"
    stage = STAGE_UNSCALE

    @property
    def owns_update(self) -> bool:  # type: ignore[override]
        return self.loss_scale is not None

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> AmpState:
        _check_fsdp2_policy(model, self.dtype)
        device_type = _device_type(model)
        if self.loss_scale is None:
            return AmpState(device_type)
        options = {} if self.loss_scale == "dynamic" else self.loss_scale
        if isinstance(self.loss_scale, (int, float)):
            options = {"init_scale": float(self.loss_scale), "growth_interval": 2**31 - 1}
        return AmpState(device_type, torch.amp.GradScaler(device_type, **options))

    def restore(
        self, saved: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> AmpState:
        live = self.init(model, optimizer)
        if live.scaler is not None and saved.get("scaler"):
            live.scaler.load_state_dict(saved["scaler"])
        skipped = saved.get("skipped", 0)
        if isinstance(skipped, torch.Tensor):  # a fresh scaler's scale is made lazily, on use
            skipped = skipped.cpu()
        return attrs.evolve(live, skipped=skipped)

    def forward_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        return torch.autocast(ctx.tstate["amp"].device_type, dtype=self.dtype)

    def scale_loss(self, ctx: StepContext, loss: torch.Tensor) -> torch.Tensor:
        scaler = ctx.tstate["amp"].scaler
        return loss if scaler is None else scaler.scale(loss)

    def before_update(self, ctx: StepContext) -> None:
        scaler = ctx.tstate["amp"].scaler
        if scaler is not None:
            if scaler._scale is None:  # resumed mid-window, flushed before any new scale()
                params = ctx.params_with_grad()
                scaler._lazy_init_scale_growth_tracker(
                    params[0].device if params else torch.device(ctx.tstate["amp"].device_type)
                )
            for opt in ctx.optimizers:  # several (one loss): unscale each, as torch documents
                scaler.unscale_(opt)

    def update(self, ctx: StepContext) -> None:
        amp: AmpState = ctx.tstate["amp"]
        scaler = amp.scaler
        found_inf = amp.overflow(*ctx.optimizers)
        if found_inf is None:  # no gradient at all
            found_inf = torch.zeros((), device=scaler._scale.device)
        if not ctx.skip:
            for opt in ctx.optimizers:  # each skips (one host sync) on its own inf/NaN
                scaler.step(opt)
        static = isinstance(self.loss_scale, (int, float))
        scaler.update(float(self.loss_scale) if static else None)  # a static scale stays
        # several optimizers: true when any of them skipped (torch skips each on its own)
        skipped = torch.ones_like(found_inf, dtype=torch.bool) if ctx.skip else found_inf > 0
        ctx.metrics["skipped"] = skipped
        ctx.tstate["amp"] = attrs.evolve(amp, skipped=amp.skipped + skipped.long())
        ctx.metrics["loss_scale"] = scaler._scale.detach().clone()

    def on_error(self, ctx: StepContext) -> None:
        scaler = getattr(ctx.tstate.get("amp"), "scaler", None)
        if scaler is not None:  # forget a half-done unscale_ so the next update can unscale again
            scaler._per_optimizer_states = collections.defaultdict(
                torch.amp.grad_scaler._refresh_per_optimizer_state
            )


def with_amp(
    step: Step,
    dtype: torch.dtype | str = torch.bfloat16,
    loss_scale: str | float | dict | None = "auto",
) -> Step:
    """Run the forward pass under autocast on the device the model computes on (CPU too).

    Args:
        dtype: ``torch.bfloat16`` (``"bf16"``) or ``torch.float16`` (``"fp16"``).
        loss_scale: ``"dynamic"`` (a ``GradScaler``: an overflowing update is
            skipped and the scale backed off), a float (a static scale;
            overflows still skip), a dict of ``GradScaler`` options, or
            ``None``. ``"auto"``: dynamic for float16, none for bfloat16.

    Gradients are unscaled once per update, before any clipping; metrics gain
    ``loss_scale`` and ``skipped``. A scaler syncs the host once per update (as
    ``GradScaler.step`` does); every rank takes the same skip decision. An FSDP2 model
    must compute in ``dtype`` itself (``dist.wrap(model, "fsdp2", mixed_precision="bf16")``),
    else the first step raises: autocast over its fp32 weights would keep a second copy of
    them alive from forward to backward.

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_amp(ftrain.make_step(lambda m, b: m(b).mean()), dtype="bf16")
        >>> step["amp"]
        Amp(dtype=torch.bfloat16, loss_scale=None)
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"with_amp: unknown dtype {dtype!r}; use 'bf16' or 'fp16'.")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"with_amp: dtype must be torch.bfloat16 or torch.float16, got {dtype}. For full "
            "precision, leave with_amp out."
        )
    if loss_scale == "auto":
        loss_scale = "dynamic" if dtype == torch.float16 else None
    return step.with_transform(Amp(dtype=dtype, loss_scale=_loss_scale(loss_scale)))


def _loss_scale(loss_scale: str | float | dict | None) -> str | float | dict | None:
    """``with_amp``'s ``loss_scale``, checked (a static scale as a float)."""
    if isinstance(loss_scale, dict):
        unknown = set(loss_scale) - _SCALER_KEYS
        if unknown:
            raise ValueError(
                f"with_amp: unknown loss_scale option(s) {sorted(unknown)}; allowed: "
                f"{sorted(_SCALER_KEYS)}."
            )
    elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not 0 < loss_scale < float("inf"):
            raise ValueError(
                f"with_amp: a static loss_scale must be a finite number > 0, got {loss_scale}."
            )
        return float(loss_scale)
    elif loss_scale is not None and loss_scale != "dynamic":
        raise ValueError(
            f"with_amp: loss_scale={loss_scale!r} is not understood; use 'dynamic', a float "
            "(static scale), a dict of GradScaler options, or None."
        )
    return loss_scale
