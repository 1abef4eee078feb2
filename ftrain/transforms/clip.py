"""Gradient clipping: by norm, by an adaptive (average) threshold, or by value."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain.loss import mul_grads
from ftrain.transforms.base import STAGE_CLIP, Tracing, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_clip", "Clip", "ClipStats", "CLIP_MODES", "scale_by_threshold"]

CLIP_MODES = ("norm", "average", "moving_average", "value")


def scale_by_threshold(grads: list[torch.Tensor], threshold: torch.Tensor, norm: torch.Tensor):
    """``clip_grads_with_norm_`` for a *tensor* threshold, with no host sync."""
    mul_grads(grads, torch.clamp(threshold / (norm + 1e-6), max=1.0))


def _global(norm: torch.Tensor) -> torch.Tensor:
    """The total norm as a plain tensor, equal on every rank: with FSDP2 a replicated DTensor
    (``full_tensor()`` costs no communication); DDP gradients are already all-reduced."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@attrs.frozen(repr=False)
class ClipStats:
    """Past finite gradient norms (adaptive modes): ``count``, and their mean (``average``)
    or moving average, not bias-corrected (``moving_average``); device tensors (no sync)."""

    count: torch.Tensor
    mean: torch.Tensor

    def __repr__(self) -> str:
        return f"ClipStats(count={int(self.count)}, mean={float(self.mean):.4g})"


@attrs.frozen
class Clip(Transform):
    """Clip the accumulated, unscaled gradient once per update. See :func:`with_clip`."""

    mode: str = "norm"
    max_norm: float | None = None
    norm_type: float = 2.0
    tolerance: float = 5.0
    momentum: float = 0.9
    clip_value: float | None = None
    name = "clip"
    stage = STAGE_CLIP

    def __repr__(self) -> str:
        used = {
            "norm": ("max_norm", "norm_type"),
            "value": ("clip_value",),
            "average": ("tolerance", "norm_type"),
            "moving_average": ("tolerance", "momentum", "norm_type"),
        }[self.mode]
        return f"Clip({self.mode!r}, " + ", ".join(f"{k}={getattr(self, k):g}" for k in used) + ")"

    @property
    def tracing(self) -> Tracing:  # type: ignore[override]
        """with_compile: "norm" and "value" clip inside the compiled update; the adaptive
        modes make new statistics (a ``ClipStats``) and clip eagerly."""
        return Tracing(traced={"before_update"}) if self.mode in ("norm", "value") else Tracing()

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ClipStats | None:
        if self.mode not in ("average", "moving_average"):
            return None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return ClipStats(count=zero, mean=zero.clone())

    def before_update(self, ctx: StepContext) -> None:
        params = ctx.params_with_grad()
        if not params:
            return
        grads = [p.grad for p in params]
        norm = _global(torch.nn.utils.get_total_norm(grads, self.norm_type))
        ctx.metrics["grad_norm"] = norm
        ctx.grad_norm = norm  # reused by with_nonfinite_check (no second norm)
        stats = ctx.tstate.get("clip")  # adaptive modes only
        count, mean = (stats.count, stats.mean) if isinstance(stats, ClipStats) else (None, None)
        threshold, count, mean = self.clip(params, grads, norm, count, mean)
        if threshold is not None:
            ctx.tstate["clip"] = ClipStats(count=count, mean=mean)
            ctx.metrics["clip_threshold"] = threshold

    def clip(self, params: list, grads: list, norm: torch.Tensor, count: Any, mean: Any) -> tuple:
        """Clip the gradients whose total norm is ``norm``; ``(threshold, count, mean)``: the
        adaptive modes' threshold and new statistics (else ``None`` and those given)."""
        if self.mode == "norm":
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        elif self.mode == "value":
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
        else:
            threshold, count, mean = self.adaptive_threshold(count, mean, norm.float())
            scale_by_threshold(grads, threshold, norm)
            return threshold, count, mean
        return None, count, mean

    def adaptive_threshold(
        self, count: torch.Tensor, mean: torch.Tensor, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(threshold, new_count, new_mean)``, tensors only: the threshold from *past* norms;
        this norm folded in if finite."""
        seen = count > 0
        finite = torch.isfinite(norm)
        new_count = count + finite.float()
        if self.mode == "average":
            past = mean
            new_mean = torch.where(finite, mean + (norm - mean) / new_count.clamp(min=1.0), mean)
        else:  # moving_average, bias-corrected like Adam's moments
            m = self.momentum
            past = mean / (1.0 - torch.pow(m, count)).clamp(min=1e-12)
            new_mean = torch.where(finite, m * mean + (1.0 - m) * norm, mean)
        threshold = torch.where(seen, self.tolerance * past, torch.full_like(past, math.inf))
        return threshold, new_count, new_mean


def with_clip(
    step: Step,
    mode: str = "norm",
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    tolerance: float | None = None,
    momentum: float | None = None,
    clip_value: float | None = None,
) -> Step:
    """Clip the gradient before each optimizer update.

    Clips the whole accumulated gradient after AMP unscaling, once per update, whatever the
    transforms' order; the pre-clip total norm (of ``norm_type``) is the ``grad_norm``
    metric (under DDP/FSDP2 that of the whole averaged gradient).

    Modes (United-Perception ``grad_clipper``): ``"norm"``: ``clip_grad_norm_(max_norm,
    norm_type)``; ``"value"``: ``clip_grad_value_(clip_value)``; ``"average"`` /
    ``"moving_average"``: threshold = ``tolerance`` (default 2.0 / 5.0) × the mean / the
    bias-corrected moving average (``momentum``, default 0.9) of the *past* finite norms
    (unlike UP, not the current one), kept in ``state.transforms["clip"]``; metric
    ``clip_threshold``. An argument the mode does not use is refused; an infinite
    ``max_norm``, ``clip_value`` or ``tolerance`` (never clips) warns.

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_clip(ftrain.make_step(lambda m, b: m(b).mean()), "norm", max_norm=1.0)
        >>> step["clip"].max_norm
        1.0
    """
    mode = "norm" if mode == "pre_defined" else mode  # United-Perception's name
    if mode not in CLIP_MODES:
        raise ValueError(f"with_clip: unknown mode {mode!r}; use one of {CLIP_MODES}.")
    given = {"max_norm": max_norm, "tolerance": tolerance, "momentum": momentum}
    _check_used(mode, {**given, "clip_value": clip_value})
    tolerance = (2.0 if mode == "average" else 5.0) if tolerance is None else tolerance
    momentum = 0.9 if momentum is None else momentum
    adaptive = mode in ("average", "moving_average")
    clip = Clip(
        mode=mode,
        max_norm=_number(mode, "max_norm", max_norm, mode == "norm"),
        norm_type=_number(mode, "norm_type", norm_type, True),
        tolerance=_number(mode, "tolerance", tolerance, adaptive),
        momentum=_number(mode, "momentum", momentum, mode == "moving_average", below=1.0),
        clip_value=_number(mode, "clip_value", clip_value, mode == "value"),
    )
    _warn_never_clips(clip)
    return step.with_transform(clip)


#: The arguments each mode reads, besides ``norm_type`` (every mode's ``grad_norm``).
_USES = {
    "norm": ("max_norm",),
    "value": ("clip_value",),
    "average": ("tolerance",),
    "moving_average": ("tolerance", "momentum"),
}
_DOES = {
    "norm": "scales the gradient down to a total norm of max_norm",
    "value": "clamps each gradient element to [-clip_value, clip_value]",
    "average": "clips at tolerance x the mean of past norms",
    "moving_average": "clips at tolerance x a moving average (momentum) of past norms",
}


def _check_used(mode: str, given: dict[str, object]) -> None:
    """Refuse an argument ``mode`` does not read (it would be ignored)."""
    for name, value in given.items():
        if value is None or name in _USES[mode]:
            continue
        users = [m for m, names in _USES.items() if name in names]
        raise ValueError(
            f"with_clip(mode={mode!r}) does not use {name}={value!r} (it {_DOES[mode]}), so "
            f"it would be ignored. Drop {name}, or use mode={users[0]!r}"
            + (f" or {users[1]!r}" if len(users) > 1 else "")
            + " to clip by it."
        )


def _warn_never_clips(clip: Clip) -> None:
    """An infinite threshold measures ``grad_norm`` but never clips: legitimate, so a warning."""
    name = {"norm": "max_norm", "value": "clip_value"}.get(clip.mode, "tolerance")
    if getattr(clip, name) == math.inf:
        warnings.warn(
            f"with_clip(mode={clip.mode!r}, {name}=inf) never clips: the step only reports "
            f"grad_norm. Pass a finite {name} to clip, or drop with_clip for no clipping.",
            stacklevel=3,
        )


def _number(mode: str, name: str, value: object, used: bool, below: float = math.inf) -> Any:
    """``value`` as a float (``None`` stays), or an error naming ``name`` and what it takes."""
    expected = "a number in (0, 1)" if below == 1.0 else "a number > 0, e.g. 1.0"
    if value is None:
        if used:
            raise ValueError(f"with_clip(mode={mode!r}) needs {name}: {expected}.")
        return None
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        try:
            fix = f"pass {name}={float(value)!r}, a number"  # type: ignore[arg-type]
        except (TypeError, ValueError):
            fix = "pass a number"
        raise TypeError(
            f"with_clip: {name} must be {expected}, got {value!r} ({type(value).__name__}); {fix}."
        )
    number = float(value)  # type: ignore[arg-type]
    if used and not (0.0 < number < below or number == below == math.inf):
        raise ValueError(f"with_clip(mode={mode!r}): {name} must be {expected}, got {value!r}.")
    return number
