"""Compile the step: ``with_compile(step)``, a step executor.

:class:`Compile` runs the step's phases as the eager step does, with two kinds of compiled
programs:

- the forward: the loss function (one process), or the model's compute blocks under DDP
  (the wrapped module) and FSDP2 (each innermost ``fully_shard`` unit, as torchtitan compiles
  its blocks), whose hooks stay eager. Its backward is the compiled one AOT autograd attaches;
  the transforms' contexts are entered around it and the loss phases act on the live loss.
- the update: the optimizer's own rule with every phase a transform traces
  (:attr:`~ftrain.transforms.base.Transform.tracing`), e.g. clipping; a phase that runs
  eagerly splits it in two programs, in the step's order.

Nothing here knows another transform: each says how it runs in its
:class:`~ftrain.transforms.base.Tracing`. What runs eagerly is warned once with
:class:`CompileFallbackWarning`: the forward when a transform asks for it; the optimizer step
when a transform owns it (the fp16 scaler) or the optimizer cannot be traced (not from
``torch.optim``, LBFGS/SparseAdam, step hooks).

CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``, ``options={"triton.cudagraphs":
True}``): each step call marks a step begin (``torch.compiler.cudagraph_mark_step_begin``);
outputs kept after the call (loss, metrics, transform state) are copied out of the graphs'
memory; every trainable parameter keeps its gradient buffer (zeroed, not freed, so an unused
parameter gets a zero gradient); the batch is static by default (each new batch shape records
a new graph: keep shapes fixed, e.g. ``drop_last=True``).
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import torch

from ftrain._checks import flag
from ftrain.transforms.base import Executor, Transform

if TYPE_CHECKING:
    from ftrain.step import LossFn, Step, StepContext

__all__ = ["with_compile", "Compile", "CompileFallbackWarning", "TracedContext"]


class CompileFallbackWarning(UserWarning):
    """Part of a compiled step runs eagerly (see :mod:`ftrain.transforms.compile`)."""


_NOT_COMPILABLE_OPTIMIZERS = ("LBFGS", "SparseAdam")
_STEP = "step"  # the optimizer's update, an element of the update program
_MISSING = object()


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


def _mark_dynamic(args: Any) -> None:
    """Mark the first dimension of every tensor in ``args`` as dynamic (the batch)."""
    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(leaf, 0)


def _copied(tree: Any) -> Any:
    """``tree`` with every tensor copied (out of the CUDA graphs' memory; autograd kept)."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, tree)


def _regions(model: torch.nn.Module) -> tuple[torch.nn.Module, ...] | None:
    """The modules whose forward is compiled under DDP/FSDP2; ``None``: the whole loss.

    DDP: the wrapped module (DDP's hooks run eagerly around it). FSDP2: every ``fully_shard``
    unit with no unit inside (its all-gather and reduce-scatter hooks run eagerly around it).
    """
    from ftrain.dist import strategy, unwrap

    kind = strategy(model)
    if kind is None:
        return None
    if kind == "ddp":
        return (unwrap(model),)
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = tuple(
        u for u in units if not any(isinstance(m, FSDPModule) for m in u.modules() if m is not u)
    )
    return inner or None


class _Element(NamedTuple):
    """One piece of the update: a transform's phase, or the optimizer's step (``transform``:
    the transform that owns it, or ``None``); ``traced``: the transform traces the phase."""

    phase: str
    transform: Transform | None
    traced: bool = False


class TracedContext:
    """What a traced phase (:attr:`Tracing.traced <ftrain.transforms.base.Tracing>`) sees of
    the :class:`~ftrain.step.StepContext`: the same ``tstate`` dict, the ``metrics`` the update
    wrote so far (what it writes lands in the step's), ``grad_norm``, ``params_with_grad()``,
    ``model``, ``boundary``, ``flush`` and, read only, ``skip``.

    Only the update's metrics: their names are the same at every update, also a flush's,
    which has no forward (the program is compiled for the names it sees)."""

    def __init__(self, ctx: StepContext, forward: frozenset[str]) -> None:
        self.tstate, self.grad_norm = ctx.tstate, ctx.grad_norm
        self.metrics = {k: v for k, v in ctx.metrics.items() if k not in forward}
        self.model, self.boundary, self.flush = ctx.model, ctx.boundary, ctx.flush
        self._skip = ctx.skip
        self._params = ctx.params_with_grad()

    @property
    def skip(self) -> bool:
        return self._skip

    def params_with_grad(self) -> list[torch.Tensor]:
        return self._params


def _phase(phase: str, t: Transform) -> _Element:
    return _Element(phase, t, phase in t.tracing.traced)


# ---------------------------------------------------------------- the programs
def _call_loss(loss_fn: LossFn, model: torch.nn.Module, batch: Any) -> Any:
    """The loss function, compiled whole (one process); its backward comes compiled with it."""
    return loss_fn(model, batch)


def _program(
    elements: tuple[_Element, ...], ctx: TracedContext, raw_steps: tuple, optimizers: tuple
) -> None:
    """The traced part of an update: transforms' phases and the optimizers' rules, in order."""
    for phase, t, _ in elements:
        if phase == _STEP:
            with torch.no_grad():
                for raw_step, optimizer in zip(raw_steps, optimizers):
                    raw_step(optimizer)
        else:
            getattr(t, phase)(ctx)


def _region_call(compiled: Callable, module: torch.nn.Module, dynamic: bool, *args, **kwargs):
    """A compute block's forward, compiled (its wrapper's hooks run around this call)."""
    if dynamic:
        _mark_dynamic((args, kwargs))
    return compiled(module, *args, **kwargs)


@contextlib.contextmanager
def _patched(forwards: Mapping[torch.nn.Module, Callable]) -> Iterator[None]:
    """Each module's ``forward`` replaced (an instance attribute) for the block."""
    saved = [(m, vars(m).get("forward", _MISSING)) for m in forwards]
    try:
        for m, fn in forwards.items():
            m.forward = fn
        yield
    finally:
        for m, before in saved:
            if before is _MISSING:
                vars(m).pop("forward", None)
            else:
                m.forward = before


@attrs.frozen
class Compile(Executor):
    """Run a step with its forward and update compiled. See :func:`with_compile`."""

    mode: str | None = None
    backend: str | Callable = "inductor"
    fullgraph: bool = False
    dynamic_batch: bool | None = None
    options: Mapping[str, Any] | None = attrs.field(default=None, eq=False, hash=False, repr=False)
    name = "compile"
    _cache: dict = attrs.field(factory=dict, init=False, eq=False, hash=False, repr=False)

    @property
    def cudagraphs(self) -> bool:
        """Whether the compiled programs run as CUDA graphs (mode, options or backend)."""
        known = self._cache.get("cudagraphs")
        if known is None:
            import torch._inductor

            options = {} if self.mode is None else torch._inductor.list_mode_options(self.mode)
            known = self.backend == "cudagraphs" or bool(
                {**options, **(self.options or {})}.get("triton.cudagraphs")
            )
            self._cache["cudagraphs"] = known
        return known

    @property
    def dynamic(self) -> bool:
        """Whether the batch dimension is compiled dynamic (default: unless CUDA graphs)."""
        return not self.cudagraphs if self.dynamic_batch is None else self.dynamic_batch

    # --------------------------------------------------------------- helpers
    def _compiled(self, key: Any, fn: Callable) -> Callable:
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
            warnings.warn(f"with_compile: {what}", CompileFallbackWarning, stacklevel=5)

    def _forward_plan(self, step: Step, model: torch.nn.Module) -> Any:
        """``str``: why the forward runs eagerly; a tuple: the compiled regions; ``None``: the
        whole loss function compiled (cached per step and model)."""
        key = ("forward", id(step), id(model))
        held = self._cache.get(key)
        if held is not None and held[0]() is step and held[1]() is model:
            return held[2]
        plan: Any = next(
            (f"{t!r} {t.tracing.eager}" for t in step.transforms if t.tracing.eager), None
        )
        plan = _regions(model) if plan is None else plan
        self._cache[key] = (weakref.ref(step), weakref.ref(model), plan)
        return plan

    # ----------------------------------------------------------- the forward
    def loss_fn(self, step: Step, ctx: StepContext) -> LossFn:
        """The compiled loss function (``step.loss_fn`` when the forward runs eagerly or its
        regions are compiled: see :meth:`outer_context`)."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
            for opt in ctx.optimizers:
                _keep_grads(opt)
        plan = self._forward_plan(step, ctx.model)
        if isinstance(plan, str):
            self._warn_once(f"{plan}: the forward and backward run eagerly.")
        if plan is not None:
            return step.loss_fn
        return functools.partial(self._run_loss, self._compiled("loss", _call_loss), step.loss_fn)

    def _run_loss(self, compiled: Callable, loss_fn: LossFn, model: torch.nn.Module, batch: Any):
        from ftrain.dist import unwrap

        if self.dynamic:
            _mark_dynamic(batch)
        out = compiled(loss_fn, unwrap(model), batch)  # a user's torch.compile(model): its module
        return _copied(out) if self.cudagraphs else out

    def outer_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        """Under DDP/FSDP2: the compute blocks' forwards compiled for this forward+backward."""
        plan = self._forward_plan(ctx.step, ctx.model)
        if not isinstance(plan, tuple):
            return contextlib.nullcontext()
        forwards = self._cache.get(("regions", plan))
        if forwards is None:
            forwards = self._cache[("regions", plan)] = {
                m: functools.partial(
                    _region_call,
                    self._compiled(("region", type(m)), type(m).forward),
                    m,
                    self.dynamic,
                )
                for m in plan
            }
        return _patched(forwards)

    # ------------------------------------------------------------ the update
    def update(self, step: Step, ctx: StepContext) -> bool:
        """The update: eager phases in their place, traced ones compiled with the optimizer."""
        if self.cudagraphs and ctx.flush:
            torch.compiler.cudagraph_mark_step_begin()
        raw = self._raw(ctx.optimizers)
        forward = frozenset(ctx.metrics)  # the forward's metrics, not the update's
        pending: list[_Element] = []
        for element in self._elements(step):
            if element.phase == _STEP:
                ctx.update_started = True  # from here a failure leaves no valid state
            if self._is_traced(element, raw):
                if element.phase != _STEP or not ctx.skip:
                    pending.append(element)
                continue
            self._run_program(pending, ctx, raw, forward)
            pending = []
            self._run_eager(element, ctx)
        self._run_program(pending, ctx, raw, forward)
        for opt in ctx.optimizers:
            self._clear_grads(opt)
        return True

    def _elements(self, step: Step) -> tuple[_Element, ...]:
        """The update's pieces in the step's order (cached per step)."""
        key = ("elements", id(step))
        held = self._cache.get(key)
        if held is not None and held[0]() is step:
            return held[1]
        by_stage = sorted(step.transforms, key=lambda t: t.stage)
        owner = next((t for t in step.transforms if t.owns_update), None)
        elements = (
            *(_phase("before_update", t) for t in by_stage if t.overrides("before_update")),
            _Element(_STEP, owner),
            *(_phase("after_update", t) for t in by_stage if t.overrides("after_update")),
        )
        self._cache[key] = (weakref.ref(step), elements)
        return elements

    def _is_traced(self, element: _Element, raw: tuple[Callable, ...] | None) -> bool:
        phase, t, traced = element
        if phase != _STEP:
            return traced
        if t is not None:
            self._warn_once(f"{t!r} owns the optimizer update: the optimizer step runs eagerly.")
            return False
        if raw is None:
            self._warn_once(
                "the optimizer (or its step hooks) cannot be traced: its update runs eagerly."
            )
        return raw is not None

    def _raw(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> tuple[Callable, ...] | None:
        """The optimizers' traceable rules (``None`` unless each has one; cached per
        optimizers); new optimizers drop the update programs of the old ones (they hold them
        and their state by identity)."""
        held = self._cache.get("optimizer")
        if held is None or [r() for r in held[0]] != list(optimizers):
            for key in [k for k in self._cache if isinstance(k, tuple) and k[0] == "update"]:
                del self._cache[key]
            for key in ("opt_state", "hyper"):
                self._cache.pop(key, None)
            raws = tuple(_raw_step(opt) for opt in optimizers)
            rule = None if any(r is None for r in raws) else raws
            held = self._cache["optimizer"] = ([weakref.ref(o) for o in optimizers], rule)
        return held[1]

    def _run_eager(self, element: _Element, ctx: StepContext) -> None:
        phase, t, _ = element
        if phase != _STEP:
            getattr(t, phase)(ctx)
        elif t is not None:
            t.update(ctx)
        elif not ctx.skip:
            for opt in ctx.optimizers:
                opt.step()

    def _run_program(
        self,
        elements: list[_Element],
        ctx: StepContext,
        raw: tuple[Callable, ...] | None,
        forward: frozenset,
    ) -> None:
        """Run ``elements`` as one compiled program (nothing when empty). ``ctx.optimizer``
        (one, or a bound step's group: a view of the same groups and state) gives the
        hyper-parameters and state; the rules step each of ``ctx.optimizers``."""
        has_step = any(e.phase == _STEP for e in elements)
        if has_step and not ctx.params_with_grad():  # no gradient: the step would do nothing
            elements = [e for e in elements if e.phase != _STEP]
            has_step = False
        if not elements:
            return
        key = ("update", tuple((e.phase, id(e.transform)) for e in elements))
        fn = self._compiled(key, _program)
        traced, opt = TracedContext(ctx, forward), ctx.optimizer
        before = (dict(ctx.metrics), dict(ctx.tstate), ctx.grad_norm) if self.cudagraphs else ()
        originals: list[dict[str, Any]] = []
        if has_step:
            self._keep_state_identity(opt)
            originals = self._lr_tensors(opt)
        try:
            fn(tuple(elements), traced, raw, ctx.optimizers)
        finally:
            for group, original in zip(opt.param_groups, originals, strict=False):
                group.update(original)
        for member in ctx.optimizers if has_step else ():
            if hasattr(member, "_opt_called"):
                member._opt_called = True  # what torch's LR schedulers look for
        ctx.metrics.update(traced.metrics)
        ctx.grad_norm = traced.grad_norm
        if self.cudagraphs:
            _copy_new_outputs(ctx, *before)

    def _clear_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients: freed, or zeroed in place under CUDA graphs (kept)."""
        from ftrain.step import clear_grads

        if not self.cudagraphs:
            clear_grads(optimizer)
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _lr_tensors(self, opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Swap each group's scheduled ``lr`` and ``betas`` for 0-d tensors (no recompile);
        return the originals. ``momentum`` stays a float (SGD and RMSprop branch on it):
        dynamo does not specialise floats, so a new value does not recompile either."""
        tensors = self._cache.setdefault("hyper", {})
        saved = []
        for i, group in enumerate(opt.param_groups):
            original: dict[str, Any] = {}
            device = group["params"][0].device
            for key in ("lr", "betas"):
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


def _keep_grads(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter a gradient buffer outside the CUDA graphs' memory: the
    backward accumulates into it instead of handing over graph-owned memory, and the update's
    graph reads it in place (a static address: no copy per replay)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
                torch._dynamo.mark_static_address(p.grad)


def _copy_new_outputs(ctx: StepContext, metrics: dict, tstate: dict, norm: Any) -> None:
    """Copy the tensors a program wrote into the step's metrics, state and ``grad_norm`` out of
    the CUDA graphs' memory (the next replay overwrites it); one copy per tensor."""
    memo: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = t.clone()
        return memo[id(t)]

    for new, old in ((ctx.metrics, metrics), (ctx.tstate, tstate)):
        for k, v in new.items():
            if v is not old.get(k, _MISSING):
                new[k] = torch.utils._pytree.tree_map_only(torch.Tensor, copy, v)
    if ctx.grad_norm is not None and ctx.grad_norm is not norm:
        ctx.grad_norm = copy(ctx.grad_norm)


def with_compile(
    step: Step,
    *,
    mode: str | None = None,
    backend: str | Callable = "inductor",
    fullgraph: bool = False,
    dynamic_batch: bool | None = None,
    options: Mapping[str, Any] | None = None,
) -> Step:
    """Compile the step: its forward and backward, and its update (gradient transforms and the
    optimizer's rule), as :mod:`ftrain.transforms.compile` describes.

    ``mode``, ``backend``, ``fullgraph`` and ``options`` go to ``torch.compile`` (checked
    here). ``dynamic_batch``: compile the batch dimension dynamic, so a smaller last batch
    does not recompile (default: yes, except under CUDA graphs, where shapes stay fixed).

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_compile(ftrain.make_step(lambda m, b: m(b).mean()))
        >>> step["compile"]
        Compile(mode=None, backend='inductor', fullgraph=False, dynamic_batch=None)
    """
    from ftrain.step import Step

    if not isinstance(step, Step):
        raise TypeError(
            f"with_compile needs a Step, got {type(step).__name__} {step!r}. Build one from "
            "your loss function first: ftrain.with_compile(ftrain.make_step(loss_fn))."
        )
    _check_backend_and_mode(backend, mode, options)
    fullgraph = flag("with_compile: fullgraph", fullgraph)
    dynamic_batch = flag("with_compile: dynamic_batch", dynamic_batch, none=True)
    options = None if options is None else dict(options)
    return step.with_transform(Compile(mode, backend, fullgraph, dynamic_batch, options))


def _check_backend_and_mode(backend: Any, mode: Any, options: Any) -> None:
    """The errors ``torch.compile`` would give at the first step, at build time."""
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if not callable(backend) and backend not in backends:
        raise ValueError(
            f"with_compile: unknown backend {backend!r}; use one of {backends} (or a "
            "callable backend)."
        )
    if mode is None:
        return
    import torch._inductor

    modes = sorted(torch._inductor.list_mode_options())
    if not isinstance(mode, str):
        raise TypeError(f"with_compile: mode must be a torch.compile mode name, got {mode!r}.")
    if mode not in modes:
        raise ValueError(f"with_compile: unknown mode {mode!r}; use one of {modes}, or None.")
    if backend != "inductor":
        raise ValueError(
            f"with_compile: mode={mode!r} is an inductor setting; backend={backend!r} takes "
            "none. Pass backend='inductor', or leave mode out."
        )
    if options:
        raise ValueError(
            "with_compile: pass mode= or options=, not both (torch.compile takes one); "
            f"mode {mode!r} is options {torch._inductor.list_mode_options(mode)}."
        )
