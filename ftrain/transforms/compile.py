"""Compile the whole update: ``with_compile(step)``.

Two compiled programs: forward + backward (autocast, loss scaling, ``loss.backward()``) and
the update (clipping, the optimizer's rule, clearing the gradients); host decisions stay eager
in between. Learning rates and momenta are fed as tensors (no recompile on a schedule).

Fallbacks to eager (warned once with :class:`CompileFallbackWarning`): the fp16 scaler's
update; an optimizer not from ``torch.optim`` (or LBFGS/SparseAdam) or with step hooks; a
DDP/FSDP2 model; a transform not from ftrain (for its phase); checkpointing with
``monitor=True`` or a ``dynamic`` plan (forward+backward); ``with_nonfinite_check`` (update).
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain._checks import flag
from ftrain.transforms.base import STAGE_CLIP, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_compile", "Compile", "CompileFallbackWarning"]


class CompileFallbackWarning(UserWarning):
    """Part of a compiled step runs eagerly (see :mod:`ftrain.transforms.compile`)."""


_NOT_COMPILABLE_OPTIMIZERS = ("LBFGS", "SparseAdam")


def _fresh(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object (dynamo caches and budgets per code object)."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable | None:
    """The optimizer's update rule without torch's wrappers (hooks, profiler, graph breaks)."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim") or cls.__name__ in _NOT_COMPILABLE_OPTIMIZERS:
        return None
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return None
    from torch.optim import optimizer as _opt_mod

    if _opt_mod._global_optimizer_pre_hooks or _opt_mod._global_optimizer_post_hooks:
        return None
    own = vars(optimizer).get("step")
    if own is not None and not hasattr(own, "_wrapped_by_lr_sched"):
        return None  # a step patched on the instance: it must run
    fn = cls.step
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _is_distributed(model: torch.nn.Module) -> bool:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    return hasattr(model, "set_requires_gradient_sync")  # FSDP2


def _mark_batch_dynamic(batch: Any) -> None:
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(leaf, 0)


def _detach_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


# ---------------------------------------------------------------- the programs
def _forward_loss(loss_fn, split, autocast, model, batch):
    """The loss (under autocast), still attached to its compiled backward."""
    with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
        return split(loss_fn(model, batch))


def _forward_backward(loss_fn, split, autocast, model, batch, mult):
    """Loss (under autocast), scaled backward; the loss and metrics detached."""
    loss, metrics = _forward_loss(loss_fn, split, autocast, model, batch)
    (loss if mult is None else loss * mult).backward()
    return loss.detach(), _detach_metrics(metrics)


def _clip_and_step(raw_step, clip, optimizer, params, count, mean):
    """Clip the gradients (any mode), apply the optimizer, clear the gradients."""
    norm = threshold = None
    with torch.no_grad():
        if clip is not None:
            grads = [p.grad for p in params]
            norm = torch.nn.utils.get_total_norm(grads, clip.norm_type)
            threshold, count, mean = clip.clip(params, grads, norm, count, mean)
        raw_step(optimizer)
    for p in params:
        p.grad = None
    return norm, threshold, count, mean


@attrs.frozen
class Compile(Transform):
    """Compile a step's forward+backward and its update. See :func:`with_compile`."""

    mode: str | None = None
    backend: str = "inductor"
    fullgraph: bool = False
    dynamic_batch: bool = True
    options: Mapping[str, Any] | None = attrs.field(default=None, eq=False, hash=False, repr=False)
    name = "compile"
    stage = 0
    _cache: dict = attrs.field(factory=dict, init=False, eq=False, hash=False, repr=False)

    # --------------------------------------------------------------- helpers
    def _compiled(self, key: str, fn: Callable) -> Callable:
        compiled = self._cache.get(key)
        if compiled is None:
            kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph}
            if self.mode is not None:
                kwargs["mode"] = self.mode
            if self.options:
                kwargs["options"] = dict(self.options)
            compiled = self._cache[key] = torch.compile(_fresh(fn), **kwargs)
        return compiled

    def _warn_once(self, what: str) -> None:
        seen = self._cache.setdefault("warned", set())
        if what not in seen:
            seen.add(what)
            warnings.warn(f"with_compile: {what}", CompileFallbackWarning, stacklevel=4)

    def _eager_reason(self, step: Step, ctx: StepContext) -> str | None:
        """Why the forward+backward must run eagerly (``None``: it compiles)."""
        from ftrain.memory.plans import DynamicPlan
        from ftrain.transforms.accum import GradAccum
        from ftrain.transforms.amp import Amp
        from ftrain.transforms.nonfinite import NonFiniteCheck
        from ftrain.transforms.remat import ActivationCheckpoint

        if _is_distributed(ctx.model):
            return "the model is wrapped for DDP/FSDP2: the step runs eagerly."
        for t in step.transforms:
            if isinstance(t, ActivationCheckpoint) and (
                t.monitor or isinstance(t.plan, DynamicPlan)
            ):
                return (
                    "activation checkpointing with monitor=True or a dynamic plan measures "
                    "eager activations: the forward+backward runs eagerly."
                )
            # NonFiniteCheck scales the loss only across ranks (DDP/FSDP2 run eagerly anyway)
            if t.overrides("scale_loss") and not isinstance(t, (GradAccum, Amp, NonFiniteCheck)):
                return f"{t!r} scales the loss in its own way: the forward+backward runs eagerly."
            if t.overrides("after_forward") and not isinstance(
                t,
                (NonFiniteCheck, ActivationCheckpoint, GradAccum),  # GradAccum: summed losses
            ):
                return f"{t!r} reads the live loss: the forward+backward runs eagerly."
        return None

    # ------------------------------------------------ called by Step (phases)
    def forward_backward(self, step: Step, ph: Any, ctx: StepContext, batch: Any) -> bool:
        """Run the forward and backward compiled; ``False``: the step does it eagerly."""
        key = ("fb_reason", id(ctx.model))
        reason = self._cache.get(key, ...)
        if reason is ...:
            reason = self._cache[key] = self._eager_reason(step, ctx)
        if reason is not None:
            self._warn_once(reason)
            return False
        from ftrain.dist import unwrap
        from ftrain.step import split_loss

        amp = ctx.tstate.get("amp")
        autocast = None if amp is None else (amp.device_type, step["amp"].dtype)
        mult: Any = None
        for t in ph.scale_loss:
            if t.name == "accum":
                mult = (1.0 if mult is None else mult) / t.every
            elif t.name == "amp":  # the loss scale tensor (created on the first call)
                scaler = ctx.tstate["amp"].scaler
                if scaler is not None:
                    scale = scaler.scale(torch.ones((), device=amp.device_type))
                    mult = scale if mult is None else scale * mult
        if self.dynamic_batch:
            _mark_batch_dynamic(batch)
        # Activation checkpointing: torch cannot yet recompute a region with random ops (CPU
        # attention is one) in a traced backward: compile the forward (AOT autograd's joint
        # graph holds its backward) and call backward from here.
        joint = "activation_checkpoint" in ctx.tstate
        model = unwrap(ctx.model)  # a user's torch.compile(model): compile its module once
        with contextlib.ExitStack() as stack:
            for t in ph.outer:
                stack.enter_context(t.outer_context(ctx))
            for t in ph.forward:
                if t.name != "amp":
                    stack.enter_context(t.forward_context(ctx))
            ctx.backward_started = True
            if joint:
                fn = self._compiled(f"f-{autocast}", _forward_loss)
                out, metrics = fn(step.loss_fn, split_loss, autocast, model, batch)
                (out if mult is None else out * mult).backward()
                loss, metrics = out.detach(), _detach_metrics(metrics)
            else:
                fn = self._compiled(f"fb-{autocast}", _forward_backward)
                with torch._dynamo.config.patch(trace_autograd_ops=True):
                    loss, metrics = fn(step.loss_fn, split_loss, autocast, model, batch, mult)
        ctx.metrics = metrics
        for t in ph.after_forward:
            t.after_forward(ctx, loss)
        metrics["loss"] = loss
        return True

    def update(self, ph: Any, ctx: StepContext) -> bool:
        """Run the update with its tensor work compiled; ``False``: the step does it eagerly."""
        from ftrain.step import clear_grads
        from ftrain.transforms.clip import Clip, ClipStats

        raw = self._cache.get("raw_step", ...)
        if raw is ... or self._cache.get("raw_for") is not ctx.optimizer:
            raw = _raw_step(ctx.optimizer)
            self._cache["raw_step"], self._cache["raw_for"] = raw, ctx.optimizer
        if raw is None:
            self._warn_once(
                f"{type(ctx.optimizer).__name__} (or its step hooks) cannot be traced: "
                "the optimizer update runs eagerly."
            )
            return False
        if ph.updater is not None:
            self._warn_once(
                "the fp16 loss scaler decides on the host whether to step: the update runs "
                "eagerly (the forward+backward stays compiled)."
            )
            return False
        if _is_distributed(ctx.model):
            return False
        clip = None
        for t in ph.before_update:
            if isinstance(t, Clip):
                clip = t
            elif t.stage > STAGE_CLIP:
                self._warn_once(f"{t!r} acts after clipping: the update runs eagerly.")
                return False
        for t in ph.before_update:
            if t is not clip:
                t.before_update(ctx)  # rescale a flush, checks, finiteness decision: eager
        ctx.update_started = True
        if ctx.skip:
            for t in ph.after_update:
                t.after_update(ctx)
            clear_grads(ctx.optimizer)
            return True
        params = ctx.params_with_grad()
        if not params:
            return False
        opt = ctx.optimizer
        # one program per optimizer: it holds it (and its state) by identity, so a new one
        # gets its own program, not a recompile
        held = self._cache.get("update_for")
        if held is None or held() is not opt:
            self._cache.pop("update", None)
            self._cache["update_for"] = weakref.ref(opt)
        fn = self._compiled("update", _clip_and_step)
        originals = self._lr_tensors(opt)
        self._keep_state_identity(opt)
        stats = ctx.tstate.get("clip") if clip is not None else None
        count, mean = (None, None) if stats is None else (stats.count, stats.mean)
        try:
            norm, threshold, count, mean = fn(raw, clip, opt, params, count, mean)
        finally:
            for group, original in zip(opt.param_groups, originals, strict=True):
                group.update(original)
        if hasattr(opt, "_opt_called"):
            opt._opt_called = True  # what torch's LR schedulers look for
        if clip is not None:
            ctx.metrics["grad_norm"] = norm
            if threshold is not None:
                ctx.metrics["clip_threshold"] = threshold
                ctx.tstate["clip"] = ClipStats(count=count, mean=mean)
        for t in ph.after_update:
            t.after_update(ctx)
        return True

    def _lr_tensors(self, opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Swap each group's scheduled floats for 0-d tensors (no recompile); return the originals."""
        tensors = self._cache.setdefault("hyper", {})
        saved = []
        for i, group in enumerate(opt.param_groups):
            original: dict[str, Any] = {}
            device = group["params"][0].device
            for key in ("lr", "momentum", "betas"):
                value = group.get(key)
                if key == "betas":
                    if not (isinstance(value, tuple) and all(type(v) is float for v in value)):
                        continue
                    parts = [(f"{key}{j}", v) for j, v in enumerate(value)]
                elif type(value) is float or (key == "lr" and type(value) is int):
                    parts = [(key, float(value))]
                else:
                    continue
                out = []
                for name, v in parts:
                    t = tensors.get((i, name))
                    if t is None or t.device != device:
                        t = tensors[i, name] = torch.tensor(v, dtype=torch.float32, device=device)
                    elif tensors[i, name, "value"] != v:
                        t.fill_(v)
                    tensors[i, name, "value"] = v
                    out.append(t)
                original[key] = value
                group[key] = tuple(out) if key == "betas" else out[0]
            saved.append(original)
        return saved

    def _keep_state_identity(self, opt: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``, put the loaded values in the compiled tensors.

        The compiled update holds the state tensors by identity: copying resumes without
        recompiling."""
        snap = self._cache.get("opt_state")
        state = opt.state
        if snap is not None and snap[0] is opt and snap[2]:
            _, n_params, entries = snap
            p0, k0, t0 = entries[0]
            if state.get(p0, {}).get(k0) is t0 and len(state) == n_params:
                return  # unchanged: the common case, one lookup
            for p, k, old in entries:
                live = state.get(p)
                new = None if live is None else live.get(k)
                fits = isinstance(new, torch.Tensor) and new is not old and new.shape == old.shape
                if fits and new.dtype == old.dtype and new.device == old.device:
                    old.copy_(new)
                    live[k] = old
        entries = [
            (p, k, v) for p, s in state.items() for k, v in s.items() if isinstance(v, torch.Tensor)
        ]
        self._cache["opt_state"] = (opt, len(state), entries)


def with_compile(
    step: Step,
    *,
    mode: str | None = None,
    backend: str = "inductor",
    fullgraph: bool = False,
    dynamic_batch: bool = True,
    options: Mapping[str, Any] | None = None,
) -> Step:
    """Compile the whole update: forward, backward, gradient transforms, optimizer step.

    ``mode``, ``backend``, ``fullgraph`` and ``options`` go to ``torch.compile``;
    ``dynamic_batch=False`` compiles once per batch size.

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_compile(ftrain.make_step(lambda m, b: m(b).mean()))
        >>> step["compile"]
        Compile(mode=None, backend='inductor', fullgraph=False, dynamic_batch=True)
    """
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"with_compile: mode must be a torch.compile mode name, got {mode!r}.")
    flag("with_compile: fullgraph", fullgraph)
    flag("with_compile: dynamic_batch", dynamic_batch)
    options = None if options is None else dict(options)
    return step.with_transform(
        Compile(mode, backend, bool(fullgraph), bool(dynamic_batch), options)
    )
