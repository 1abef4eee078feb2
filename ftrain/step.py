"""The pure training step: ``state, metrics = step(state, batch)``.

:func:`make_step` turns a loss function into a :class:`Step`. Transforms
(:mod:`ftrain.transforms`) return new steps with more behaviour; a step is a
value you can print, compare and compose.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import torch

from ftrain.binding import Binding, bind, check_names
from ftrain.errors import NonFiniteLossError
from ftrain.loss import SummedLoss, check_summed, divide_by_count, is_count
from ftrain.state import TrainState, Unloaded, advance, consume, wait_readers
from ftrain.transforms.base import Executor, Transform

if TYPE_CHECKING:
    from ftrain.sequence import StepSequence

__all__ = ["Step", "StepContext", "make_step", "LossFn", "Metrics", "SummedLoss"]

Metrics: TypeAlias = dict[str, Any]
LossFn: TypeAlias = Callable[
    [torch.nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, Any] | SummedLoss"
]


@attrs.define(eq=False, repr=False)
class StepContext:
    """Scratch space of one step call, handed to every transform phase.

    Attributes:
        tstate: the transforms' state being built for the returned record (this step's
            transforms by name; a bound step's are kept under its name in the state).
        optimizer: the optimizer the step updates: the state's one, the one it is bound to,
            or those it is bound to as one :class:`~ftrain.optim.group.OptimizerGroup`.
        optimizers: the torch optimizers the update steps, in order (``(optimizer,)`` but
            for a group).
        boundary: whether this call ends an optimizer window.
        flush: on a flush of a partial window, how many micro-batches it holds.
        skip: set by a transform to skip this optimizer update.
        grad_norm: this update's total gradient norm (same on every rank) once
            a transform computed it (``with_clip``), else ``None``.
        loss_count: for a :class:`SummedLoss`, the count the gradient still
            has to be divided by (``with_grad_accum`` takes it over).
    """

    step: Step
    state: TrainState
    tstate: dict[str, Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    optimizers: tuple[torch.optim.Optimizer, ...]
    metrics: Metrics = attrs.Factory(dict)
    boundary: bool = True
    flush: int = 0
    skip: bool = False
    grad_norm: torch.Tensor | None = None
    loss_count: torch.Tensor | None = None
    backward_started: bool = False
    update_started: bool = False
    _params: list[torch.Tensor] | None = None

    def params_with_grad(self) -> list[torch.Tensor]:
        """The optimizer's parameters that have a gradient (computed once)."""
        if self._params is None:
            self._params = [p for opt in self.optimizers for p in _params_with_grad(opt)]
        return self._params

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters the step trains, by name: the model's, or for a step bound to named
        optimizers those they hold (the others keep their gradients out of its backward)."""
        named = self.model.named_parameters()
        if not self.step.bound:
            return list(named)
        own = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        return [(n, p) for n, p in named if id(p) in own]


class _Phases:
    """The transforms of a step sorted into the phases they take part in."""

    def __init__(self, transforms: tuple[Transform, ...]) -> None:
        names: dict[str, Transform] = {}
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"Step transforms must be Transform values, got {t!r}.")
            if t.name in names:
                raise ValueError(
                    f"This step already has a {t.name!r} transform ({names[t.name]!r}); "
                    f"cannot add {t!r}. Compose each kind of transform once."
                )
            names[t.name] = t
        owners = [t for t in transforms if t.owns_update]
        if len(owners) > 1:
            raise ValueError(f"Only one transform may own the optimizer update, got {owners!r}.")
        by_stage = sorted(transforms, key=lambda t: t.stage)  # stable: ties keep order
        self.all = transforms
        self.is_boundary = [t for t in by_stage if t.overrides("is_boundary")]
        self.outer = [t for t in by_stage if t.overrides("outer_context")]
        self.forward = [t for t in by_stage if t.overrides("forward_context")]
        self.after_forward = [t for t in by_stage if t.overrides("after_forward")]
        self.scale_loss = [t for t in by_stage if t.overrides("scale_loss")]
        self.before_update = [t for t in by_stage if t.overrides("before_update")]
        self.after_update = [t for t in by_stage if t.overrides("after_update")]
        self.updater = owners[0] if owners else None
        executors = [t for t in transforms if isinstance(t, Executor)]
        if len(executors) > 1:
            raise ValueError(f"Only one transform may execute the step, got {executors!r}.")
        # with_compile: runs the forward and the update compiled
        self.executor = executors[0] if executors else None


_STEPPED = "the step call it was passed to"
_Tensor = torch.Tensor
_BASE_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_profiling = torch._C._autograd._profiler_enabled


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` without its ~12 µs ``record_function``
    (unless the optimizer overrides ``zero_grad`` or a profiler runs)."""
    if (
        type(optimizer).zero_grad is not _BASE_ZERO_GRAD
        or "zero_grad" in optimizer.__dict__  # one set on the instance
        or _profiling()
    ):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def parse_loss(out: Any) -> tuple[torch.Tensor, Metrics, torch.Tensor | None]:
    """``loss_fn``'s result as ``(loss, metrics, count)``; ``count`` for a summed loss."""
    count: Any = None
    if isinstance(out, torch.Tensor):
        loss, metrics = out, {}
    elif isinstance(out, SummedLoss):
        check_summed(out)
        loss, count = out.total, out.count
        metrics = dict(out.metrics) if out.metrics is not None else {}
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, metrics = out[0], dict(out[1])
    elif isinstance(out, tuple) and len(out) in (2, 3) and is_count(out[1]):
        what = "a one-element tensor" if isinstance(out[1], torch.Tensor) else type(out[1]).__name__
        raise TypeError(
            f"loss_fn(model, batch) returned a tuple whose second element is a number ({what}), "
            "which is ambiguous: metrics go in a dict, "
            "(loss, {'acc': acc}). For a loss summed over a varying number of items (tokens), "
            "return ftrain.SummedLoss(loss_sum, count) or ftrain.SummedLoss(loss_sum, count, "
            "metrics): the update is then normalised by the count over the optimizer window "
            "and the ranks."
        )
    else:
        raise TypeError(
            "loss_fn(model, batch) must return a scalar loss tensor, (loss, metrics_dict), or "
            "ftrain.SummedLoss(loss_sum, count[, metrics_dict]) for a summed loss; got "
            f"{type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple) else "")
            + "."
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "loss_fn must return a scalar loss tensor (reduce it with .mean() or .sum()); got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
        )
    if not loss.requires_grad:
        raise RuntimeError(
            "The loss does not require grad: did loss_fn run under torch.no_grad(), or are all "
            "the model's parameters frozen (requires_grad=False)?"
        )
    if count is not None:
        if isinstance(count, torch.Tensor):
            count = count.detach().reshape(()).to(device=loss.device, dtype=torch.float32)
        else:
            count = torch.tensor(float(count), device=loss.device)
    return loss, metrics, count


def _counted_metrics(metrics: Metrics, loss: torch.Tensor, count: torch.Tensor) -> None:
    """A summed loss's metrics: the mean, and the sum and count the logger weights by."""
    total = loss.detach()
    metrics["loss"] = total / count
    metrics["loss_sum"] = total
    metrics["loss_count"] = count


def _params_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _enter(contexts: list[Transform], method: str, ctx: StepContext, stack: contextlib.ExitStack):
    for t in contexts:
        stack.enter_context(getattr(t, method)(ctx))


@attrs.frozen(repr=False)
class Step:
    """A training step: ``state, metrics = step(state, batch)``, one micro-batch per call.

    Forward, backward and, at the end of an optimizer window, the update and
    ``zero_grad``. Metrics are tensors (no host sync). Build one with
    :func:`make_step`; add ``with_*`` transforms in any order. ``bound``: the names of the
    optimizers it updates, on a state holding several (``make_step(loss_fn, optimizer=...)``);
    ``a.then(b)`` runs ``a`` then ``b`` on each batch (:mod:`ftrain.sequence`).

    Example:
        >>> import torch, ftrain
        >>> model = torch.nn.Linear(3, 1)
        >>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        >>> state, metrics = step(state, (torch.ones(4, 3), torch.zeros(4, 1)))
        >>> state.step, sorted(metrics)
        (1, ['loss'])
    """

    loss_fn: LossFn
    transforms: tuple[Transform, ...] = attrs.field(default=(), converter=tuple)
    bound: tuple[str, ...] = attrs.field(default=(), converter=check_names)
    _phases: _Phases = attrs.field(init=False, eq=False)
    _plain: bool = attrs.field(init=False, eq=False)  # no transforms: the inline fast path
    # (transform, key of its state): a bound step keeps it under "<name>/<transform>"
    _keys: tuple[tuple[Transform, str], ...] = attrs.field(init=False, eq=False)
    _bindings: weakref.WeakKeyDictionary = attrs.field(init=False, eq=False)  # model -> Binding

    def __attrs_post_init__(self) -> None:
        prefix = f"{self.name}/" if self.bound else ""
        object.__setattr__(self, "_phases", _Phases(self.transforms))
        object.__setattr__(self, "_plain", not self.transforms and not self.bound)
        object.__setattr__(self, "_keys", tuple((t, prefix + t.name) for t in self.transforms))
        object.__setattr__(self, "_bindings", weakref.WeakKeyDictionary())

    @property
    def name(self) -> str:
        """The bound optimizers' names joined by ``+`` (``""`` unbound): the prefix of this
        step's transform state in ``state.transforms`` and of its metrics in a sequence."""
        return "+".join(self.bound)

    def with_transform(self, transform: Transform) -> Step:
        """A new step with ``transform`` added (what every ``with_*`` calls)."""
        return attrs.evolve(self, transforms=(*self.transforms, transform))

    def without(self, name: str) -> Step:
        """A new step without the transform named ``name``."""
        kept = tuple(t for t in self.transforms if t.name != name)
        if len(kept) == len(self.transforms):
            raise KeyError(f"No {name!r} transform in {self!r}.")
        return attrs.evolve(self, transforms=kept)

    def then(self, *steps: Step) -> StepSequence:
        """A step running this step, then each of ``steps``, on every batch: one update of
        each per call, one ``state.step``. Each is bound to its own optimizer(s).

        Example:
            >>> import torch, ftrain
            >>> gan = torch.nn.ModuleDict({"gen": torch.nn.Linear(2, 2), "disc": torch.nn.Linear(2, 1)})
            >>> state = ftrain.TrainState.create(gan, {
            ...     "gen": torch.optim.SGD(gan.gen.parameters(), lr=0.1),
            ...     "disc": torch.optim.SGD(gan.disc.parameters(), lr=0.1)})
            >>> d = ftrain.make_step(lambda m, z: m.disc(m.gen(z).detach()).mean(), optimizer="disc")
            >>> g = ftrain.make_step(lambda m, z: -m.disc(m.gen(z)).mean(), optimizer="gen")
            >>> state, metrics = d.then(g)(state, torch.randn(4, 2))
            >>> state.step, sorted(metrics)
            (1, ['disc/loss', 'gen/loss'])
        """
        from ftrain.sequence import sequence

        return sequence(self, *steps)

    def __getitem__(self, name: str) -> Transform:
        for t in self.transforms:
            if t.name == name:
                return t
        raise KeyError(f"No {name!r} transform in {self!r}.")

    def __repr__(self) -> str:
        fn = getattr(self.loss_fn, "__qualname__", None) or repr(self.loss_fn)
        if self.bound:
            names = self.bound[0] if len(self.bound) == 1 else self.bound
            fn += f", optimizer={names!r}"
        return f"Step({fn})" + "".join(f"\n  | {t!r}" for t in self.transforms)

    def init(self, state: TrainState) -> TrainState:
        """``state`` with every transform's state created or restored (steps do it lazily)."""
        state.check_fresh()
        tstate = self._init_tstate(state)
        return state if tstate is state.transforms else state.replace(transforms=tstate)

    def _init_tstate(self, state: TrainState) -> Mapping[str, Any]:
        current = state.transforms
        missing = [
            (t, k) for t, k in self._keys if k not in current or isinstance(current[k], Unloaded)
        ]
        if not missing:
            return current
        out = dict(current)
        model = state.model
        binding = self._bind(state)
        optimizer = state.optimizer if binding is None else binding.optimizer
        for t, k in missing:
            value = current.get(k)
            if isinstance(value, Unloaded):
                out[k] = t.restore(value.saved, model, optimizer)
            else:
                out[k] = t.init(model, optimizer)
        return out

    def _local(self, tstate: Mapping[str, Any]) -> dict[str, Any]:
        """The transforms' state as the phases see it (by transform name)."""
        if not self.bound:
            return dict(tstate)
        return {t.name: tstate[k] for t, k in self._keys}

    def _merged(self, tstate: Mapping[str, Any], local: dict[str, Any]) -> dict[str, Any]:
        """``tstate`` with the phases' new state (``local``) under this step's keys."""
        if not self.bound:
            return {**tstate, **local}
        prefix = f"{self.name}/"
        return {**tstate, **{prefix + name: value for name, value in local.items()}}

    def _bind(self, state: TrainState) -> Binding | None:
        """A bound step's :class:`~ftrain.binding.Binding` over ``state`` (cached per model)."""
        if not self.bound:
            return None
        model = state.model
        binding = self._bindings.get(model)
        if binding is None or not binding.fits(state, self.bound):
            binding = self._bindings[model] = bind(state, self.bound)
        return binding

    def _context(
        self, state: TrainState, local: dict[str, Any], binding: Binding | None
    ) -> StepContext:
        if binding is None:
            opt = state.optimizer
            return StepContext(self, state, local, state.model, opt, (opt,))
        return StepContext(self, state, local, state.model, binding.optimizer, binding.optimizers)

    def observe(self, state: TrainState, metrics: Mapping[str, Any]) -> TrainState:
        """``state`` after an evaluation returned ``metrics``: each transform that watches
        evaluations (a plateau rule, ``with_schedule(plateau=...)``) updates its state.
        ``EvalHook`` calls it; ``state`` itself when nothing changed.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> step = ftrain.make_step(lambda m, b: m(b).mean())
            >>> step.observe(s, {"val_loss": 1.0}) is s
            True
        """
        watching = [(t, k) for t, k in self._keys if t.overrides("observe")]
        if not watching:
            return state
        tstate = dict(self._init_tstate(state))
        changed = False
        for t, k in watching:
            before = tstate[k]
            tstate[k] = t.observe(state, before, metrics)
            changed = changed or tstate[k] is not before
        return state.replace(transforms=tstate) if changed else state

    def pending(self, state: TrainState) -> int:
        """Micro-batches accumulated in ``state`` that wait for an update."""
        tstate = self._init_tstate(state)  # restores state loaded from a checkpoint
        return sum(t.pending(tstate.get(k)) for t, k in self._keys)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        if self._plain:
            model, opt = state.model, state.optimizer  # raise StaleStateError if consumed
            # inline: every line here is overhead next to a small model's forward and backward
            out = metrics = count = None
            try:
                out = self.loss_fn(model, batch)
                if type(out) is _Tensor:
                    loss = out
                else:
                    loss, metrics, count = parse_loss(out)
                loss.backward()
                if count is not None:
                    divide_by_count(_params_with_grad(opt), count, model)
            except BaseException as exc:
                clear_grads(opt)  # drop the half-done backward: state stays valid
                if isinstance(exc, RuntimeError) and type(out) is _Tensor:
                    parse_loss(out)  # a non-scalar loss, or one without grad: say which
                raise
            try:
                wait_readers(state)  # a background checkpoint copy still reading the tensors
                opt.step()
            except BaseException as exc:
                consume(state, f"a step call that failed in optimizer.step ({type(exc).__name__})")
                raise
            clear_grads(opt)
            if metrics is None:
                metrics = {"loss": loss.detach()}
            elif count is not None:
                _counted_metrics(metrics, loss, count)
            else:
                metrics["loss"] = loss.detach()
            return advance(
                state, _STEPPED, state.step + 1, state.micro_step + 1, state.transforms
            ), metrics
        return self._transformed(state, batch)

    def _transformed(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        ph = self._phases
        state.check_fresh()
        tstate = self._init_tstate(state)
        binding = self._bind(state)
        ctx = self._context(state, self._local(tstate), binding)
        pending_before = sum(t.pending(ctx.tstate.get(t.name)) for t in ph.all)
        boundary = True
        for t in ph.is_boundary:
            boundary = t.is_boundary(ctx) and boundary
        ctx.boundary = boundary
        try:
            self._isolated(ctx, batch, binding, window_start=pending_before == 0)
            if boundary:
                self._update(ctx)
        except BaseException as exc:
            return self._failed(ctx, pending_before, exc)
        n = state.step + 1 if boundary else state.step
        tstate = self._merged(tstate, ctx.tstate) if self.bound else ctx.tstate
        return advance(state, _STEPPED, n, state.micro_step + 1, tstate), ctx.metrics

    def _isolated(
        self, ctx: StepContext, batch: Any, binding: Binding | None, window_start: bool
    ) -> None:
        """The forward and backward; a bound step's backward touches only its own gradients."""
        if binding is None:
            self._forward_backward(ctx, batch)
            return
        kept = binding.isolate(window_start)
        try:
            self._forward_backward(ctx, batch)
        finally:
            binding.restore(kept)

    def _forward_backward(self, ctx: StepContext, batch: Any) -> None:
        ph = self._phases
        loss_fn = self.loss_fn if ph.executor is None else ph.executor.loss_fn(self, ctx)
        with contextlib.ExitStack() as outer:
            _enter(ph.outer, "outer_context", ctx, outer)
            if ph.forward:
                with contextlib.ExitStack() as inner:
                    _enter(ph.forward, "forward_context", ctx, inner)
                    out = loss_fn(ctx.model, batch)
            else:
                out = loss_fn(ctx.model, batch)
            loss, metrics, count = parse_loss(out)
            ctx.metrics = metrics
            ctx.loss_count = count
            for t in ph.after_forward:
                t.after_forward(ctx, loss)
            scaled = loss
            for t in ph.scale_loss:
                scaled = t.scale_loss(ctx, scaled)
            ctx.backward_started = True
            scaled.backward()
        if count is None:
            metrics["loss"] = loss.detach()
        else:
            _counted_metrics(metrics, loss, count)

    def _update(self, ctx: StepContext) -> None:
        ph = self._phases
        # the seam every update passes (eager, compiled, an fp16 updater, flush): a background
        # checkpoint copy still reading the weights finishes before they change in place
        wait_readers(ctx.state)
        if ctx.loss_count is not None:  # a summed loss, no accumulation window took it over
            divide_by_count(ctx.params_with_grad(), ctx.loss_count, ctx.model)
            ctx.loss_count = None
        if ph.executor is not None and ph.executor.update(self, ctx):
            return
        for t in ph.before_update:
            t.before_update(ctx)
        ctx.update_started = True
        if ph.updater is not None:
            ph.updater.update(ctx)
        elif not ctx.skip:
            for opt in ctx.optimizers:
                opt.step()
        for t in ph.after_update:
            t.after_update(ctx)
        for opt in ctx.optimizers:
            clear_grads(opt)

    def _failed(self, ctx: StepContext, pending_before: int, exc: BaseException):
        """Leave the input state valid when nothing irreversible happened."""
        state = ctx.state
        for t in self._phases.all:
            t.on_error(ctx)
        if ctx.update_started:
            consume(state, f"a step call that failed during the optimizer update ({exc!r})")
            raise exc
        if not ctx.backward_started:
            raise exc  # nothing touched the gradients: the input state stays valid
        for opt in ctx.optimizers:
            clear_grads(opt)
        if pending_before == 0 and not isinstance(exc, NonFiniteLossError):
            raise exc  # gradients were empty before this call: still valid
        # The accumulated window is lost: hand back a valid state without it.
        local = {t.name: t.discard_window(ctx.tstate[t.name]) for t in self._phases.all}
        tstate = self._merged(state.transforms, local)
        by = f"a step call that raised {type(exc).__name__} and discarded the accumulation window"
        recovered = advance(state, by, state.step, state.micro_step + 1, tstate)
        if isinstance(exc, NonFiniteLossError):
            exc.state = recovered
        else:
            exc.add_note(
                "ftrain: the partial accumulation window was lost with this error; the state "
                "passed to the step is consumed. Continue from the last state you saved with "
                "clone() or a checkpoint."
            )
        raise exc

    def flush(self, state: TrainState) -> tuple[TrainState, Metrics]:
        """Apply a partial accumulation window, scaled by its true size (``(state, {})`` if none).

        The loop calls it at the end of the data, so no micro-batch is dropped.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(3, 1)
            >>> s = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> step = ftrain.with_grad_accum(ftrain.make_step(lambda m, b: m(b).pow(2).mean()), every=4)
            >>> s, _ = step(s, torch.ones(2, 3))
            >>> s, _ = step.flush(s)
            >>> s.step, step.pending(s)
            (1, 0)
        """
        state.check_fresh()
        pending = self.pending(state)
        if pending == 0:
            return state, {}
        tstate = self._init_tstate(state)
        ctx = self._context(state, self._local(tstate), self._bind(state))
        ctx.flush = pending
        ctx.backward_started = True
        try:
            self._update(ctx)
        except BaseException as exc:
            return self._failed(ctx, pending, exc)
        by = f"flush() at step={state.step}"
        tstate = self._merged(tstate, ctx.tstate) if self.bound else ctx.tstate
        return advance(state, by, state.step + 1, state.micro_step, tstate), ctx.metrics


def make_step(loss_fn: LossFn, *, optimizer: str | Sequence[str] | None = None) -> Step:
    """The basic step: forward, backward, ``optimizer.step()``, ``zero_grad``.

    ``loss_fn(model, batch)`` returns a scalar loss, ``(loss, metrics_dict)`` or
    :class:`~ftrain.loss.SummedLoss` (the update is the mean over every item of
    the window and the ranks); ``(loss, number)`` is refused as ambiguous.

    ``optimizer``: on a state created with several optimizers by name, the one (or the
    names of those) this step updates; its transforms then apply to them alone, their
    state kept under the step's :attr:`Step.name` (see ``docs/multi_optimizer.md``).

    Example:
        >>> import torch, ftrain
        >>> def loss_fn(model, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> step = ftrain.make_step(loss_fn)
        >>> step
        Step(loss_fn)
    """
    if not callable(loss_fn):
        raise TypeError(
            f"make_step: loss_fn must be callable (model, batch) -> loss, got {loss_fn!r}"
        )
    return Step(loss_fn, bound=optimizer)
