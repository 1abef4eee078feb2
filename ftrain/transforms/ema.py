"""Exponential moving average of the weights, kept in the state and updated in the step.

Evaluate or save with it through :func:`swap_ema`, :func:`use_ema`, :func:`ema_state_dict`::

    step = ftrain.with_ema(step, decay=0.9998)
    hooks = [ftrain.EvalHook(use_ema(evaluate)), ftrain.BestCheckpointHook("acc")]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain._checks import whole
from ftrain._tensors import local_tensor as _local
from ftrain.dist import unwrap
from ftrain.state import wait_readers
from ftrain.transforms.base import Transform

if TYPE_CHECKING:
    from ftrain.state import TrainState
    from ftrain.step import Step, StepContext

__all__ = [
    "with_ema",
    "EMA",
    "EMAState",
    "swap_ema",
    "use_ema",
    "ema_state_dict",
    "ema_key",
    "COUNTS",
]


class _Pairs:
    """The average's tensors and the model's, as local shards grouped for foreach ops."""

    def __init__(self, ema: EMAState, model: torch.nn.Module) -> None:
        src = dict(model.named_parameters())
        if not ema.params.keys() <= src.keys():  # (a bound step's average: a part of them)
            differ = sorted(set(ema.params) - set(src))[:5]
            raise ValueError(
                f"with_ema: the model's parameters do not match the average's (e.g. {differ}): "
                "the average was made from another model. Start the EMA anew (a new TrainState)."
            )
        self.avg, self.src, self.copy_dst, self.copy_src = [], [], [], []
        for name, e in ema.params.items():  # floating point: averaged; the rest: copied
            floating = e.dtype.is_floating_point or e.dtype.is_complex
            (self.avg if floating else self.copy_dst).append(_local(e))
            (self.src if floating else self.copy_src).append(_local(src[name].detach()))
        for name, b in model.named_buffers():
            if name in ema.buffers:
                self.copy_dst.append(_local(ema.buffers[name]))
                self.copy_src.append(_local(b))
        # swap_ema exchanges the parameters (the buffers are copies already)
        self.params_ema = [_local(e) for e in ema.params.values()]
        self.params_src = [_local(src[n].detach()) for n in ema.params]


class EMAState:
    """``params``, ``buffers``: name -> averaged tensor (FSDP2: sharded like the model's);
    ``updates``: optimizer updates counted from ``begin``."""

    def __init__(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], updates: int = 0
    ) -> None:
        self.params, self.buffers, self.updates = params, buffers, updates
        self._pairs: tuple[Any, _Pairs] | None = None  # (model, pairs), rebuilt for a new model

    def pairs(self, model: torch.nn.Module) -> _Pairs:
        if self._pairs is None or self._pairs[0] is not model:
            self._pairs = (model, _Pairs(self, unwrap(model)))
        return self._pairs[1]

    def __getstate__(self) -> dict[str, Any]:  # deepcopy (clone()) and pickling: no cache
        return {"params": self.params, "buffers": self.buffers, "updates": self.updates}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["params"], d["buffers"], d["updates"])

    @classmethod
    @torch.no_grad()
    def from_saved(cls, saved: Mapping[str, Any], model: torch.nn.Module) -> EMAState:
        """The average :meth:`state_dict` saved, over ``model``'s tensors: those it holds (a
        bound step's average holds the parameters of its optimizers), or all without weights."""
        src = unwrap(model)
        module = saved.get("module")
        named = src.named_parameters()
        if module is not None:
            named = ((n, p) for n, p in named if n in module)
        ema = cls({n: p.detach().clone() for n, p in named},
                  {n: b.detach().clone() for n, b in src.named_buffers()})  # fmt: skip
        ema.load_state_dict(saved)
        return ema

    def __repr__(self) -> str:
        return f"EMAState(updates={self.updates}, {len(self.params)} params)"

    def state_dict(self) -> dict[str, Any]:
        """``{"updates": n, "module": {name: tensor}}``; FSDP2: gathered whole to the CPU (a
        collective, one tensor at a time), so it resumes on any number of processes."""
        module = {}
        for name, t in {**self.params, **self.buffers}.items():
            full = getattr(t, "full_tensor", None)
            module[name] = full().cpu() if full is not None else t.detach().clone()
        return {"updates": self.updates, "module": module}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.updates = int(saved["updates"])
        module = saved.get("module")
        if module is None:
            return
        mine = {**self.params, **self.buffers}
        if mine.keys() != module.keys():
            raise ValueError(
                "with_ema: the saved average is of another model (its tensors are "
                f"{sorted(set(module) ^ set(mine))[:5]}...); resume with the model it was "
                "written with, or drop the 'ema' entry to start the average anew."
            )
        with torch.no_grad():
            for name, dst in mine.items():
                value = module[name]
                if hasattr(dst, "device_mesh") and not hasattr(value, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor

                    full, mesh = value.to(_local(dst).device), dst.device_mesh
                    try:  # torch >= 2.7: each rank slices its own copy, no communication
                        value = distribute_tensor(full, mesh, dst.placements, src_data_rank=None)
                    except TypeError:  # older torch: rank 0's copy is scattered
                        value = distribute_tensor(full, mesh, dst.placements)
                _local(dst).copy_(_local(value))


#: What ``with_ema``'s counters count: optimizer updates, or micro-batches (MMEngine's iterations).
COUNTS = ("updates", "micro_batches")


@contextlib.contextmanager
def _after_backward(fn: Callable[[], None]) -> Iterator[None]:
    yield  # (not reached when the forward or backward raised)
    fn()


@attrs.frozen
class EMA(Transform):
    """Average the weights after each optimizer update. See :func:`with_ema`."""

    decay: float = 0.9998
    every: int = 1
    warmup: float | None = None
    begin: int = 0
    count: str = "updates"
    #: the optimizers of the step it was composed on (``Step.bound``): it averages their
    #: parameters alone; ``()``: the whole model
    bound: tuple[str, ...] = attrs.field(default=(), repr=False)
    name = "ema"

    @torch.no_grad()
    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> EMAState:
        src = unwrap(model)  # the user's module inside DDP; FSDP2: DTensor shards
        named = src.named_parameters()
        if self.bound:  # the parameters its step updates (the generator's, for a GAN's)
            own = {id(p) for g in optimizer.param_groups for p in g["params"]}
            named = ((n, p) for n, p in named if id(p) in own)
        params = {n: p.detach().clone() for n, p in named}
        return EMAState(params, {n: b.detach().clone() for n, b in src.named_buffers()})

    def weight(self, n: int) -> float:
        """The weight of the model's weights in the ``n``-th EMA update (``torch.lerp``).

        Example:
            >>> EMA(0.99).weight(5), round(EMA(0.99, warmup=10).weight(0), 4)
            (0.010000000000000009, 0.9058)
        """
        if self.warmup is None:
            return 1.0 - self.decay
        return self.decay * math.exp(-(1 + n) / self.warmup) + (1.0 - self.decay)

    def outer_context(self, ctx: StepContext) -> contextlib.AbstractContextManager:
        """``count="micro_batches"``: a micro-batch without an update averages too (the
        weights it sees are the last update's), once its backward is done."""
        if self.count == "updates" or ctx.boundary:
            return contextlib.nullcontext()
        return _after_backward(lambda: self._average(ctx, ctx.state.micro_step))

    def after_update(self, ctx: StepContext) -> None:
        micro = self.count == "micro_batches"
        self._average(ctx, ctx.state.micro_step if micro else ctx.state.step, update=True)

    @torch.no_grad()
    def _average(self, ctx: StepContext, counted: int, update: bool = False) -> None:
        """The ``ema.updates``-th average, ``counted`` updates (micro-batches) in."""
        ema: EMAState = ctx.tstate["ema"]
        started = counted + 1 >= self.begin
        n = ema.updates
        if started:
            ema.updates = n + 1
        if update and ctx.skip:  # with_nonfinite_check skipped the update: nothing changed
            return
        pairs = ema.pairs(ctx.model)
        if pairs.avg and (not started or n == 0):  # before begin the copy follows the model
            torch._foreach_copy_(pairs.avg, pairs.src)
        elif pairs.avg and n % self.every == 0:
            w = self.weight(n)
            skipped = ctx.metrics.get("skipped") if update else None
            if isinstance(skipped, torch.Tensor):
                # an fp16 overflow skipped the update (a device flag): weight 0, no host sync
                wt = torch.where(skipped, 0.0, w)
                by_device = {t.device: wt.to(t.device) for t in pairs.avg}
                torch._foreach_lerp_(pairs.avg, pairs.src, [by_device[t.device] for t in pairs.avg])
            else:
                torch._foreach_lerp_(pairs.avg, pairs.src, w)
        if pairs.copy_dst:
            torch._foreach_copy_(pairs.copy_dst, pairs.copy_src)


def _check_args(decay: Any, every: Any, warmup: Any, begin: Any, count: Any) -> None:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
        raise ValueError(
            f"with_ema: decay must be a number in (0, 1), got {decay!r}. It is the weight of "
            "the old average (e.g. 0.9998); for MMEngine's EMAHook(momentum=m) pass decay=1 - m."
        )
    whole("with_ema: every", every, 1)
    whole("with_ema: begin", begin, 0)
    number = isinstance(warmup, (int, float)) and not isinstance(warmup, bool)
    if warmup is not None and not (number and math.isfinite(warmup) and warmup > 0):
        raise ValueError(
            f"with_ema: warmup must be None or a number of EMA updates > 0 (e.g. 2000), "
            f"got {warmup!r}."
        )
    if count not in COUNTS:
        raise ValueError(
            f"with_ema: count must be one of {COUNTS}, got {count!r}: 'micro_batches' "
            "averages after every micro-batch, as MMEngine's EMAHook under accumulative_counts."
        )


def with_ema(
    step: Step,
    decay: float = 0.9998,
    *,
    every: int = 1,
    warmup: float | None = None,
    begin: int = 0,
    count: str = "updates",
) -> Step:
    """Keep an exponential moving average of the weights in ``state.transforms["ema"]``.

    After the ``n``-th counted update: ``n == 0``: ``e = p``; else every ``every`` updates
    ``e = decay * e + (1 - decay) * p``. Buffers and integer parameters are copied. MMEngine's
    ``EMAHook`` (``ExpMomentumEMA`` with ``warmup``), whose ``momentum`` is ``1 - decay``.

    Args:
        decay: weight of the old average, in (0, 1) (timm, ``AveragedModel``).
        every: average every this many optimizer updates (MMEngine's ``interval``).
        warmup: ``None``, or a time constant in EMA updates (MMEngine's ``gamma``, e.g.
            2000): the new weights' weight is ``decay * exp(-(1 + n) / warmup) + 1 - decay``.
        begin: count from the update that reaches step ``begin``; before, the average
            follows the model (MMEngine's ``begin_iter``).
        count: ``"micro_batches"``: average after every micro-batch and count ``every``,
            ``warmup`` and ``begin`` in micro-batches, as MMEngine's ``EMAHook`` does under
            ``accumulative_counts=N`` (a window then multiplies the old average's weight by
            ``decay ** N``; the first window averages from its first micro-batch, before the
            first update, as MMEngine does).

    A skipped update counts in ``updates`` but is not averaged (decided on the device, no host
    sync). Under FSDP2 the average is sharded like the parameters and gathered whole in
    checkpoints. Evaluate with :func:`use_ema` / :func:`swap_ema`, save with
    :func:`ema_state_dict`. On a step bound to named optimizers (``make_step(loss_fn,
    optimizer="gen")``) it averages the parameters those optimizers hold (the generator's)
    after each of that step's updates, and copies the model's buffers; its state is
    ``state.transforms["gen/ema"]``, and ``swap_ema(state, "gen")`` swaps that part in.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.with_ema(ftrain.make_step(lambda m, b: m(b).pow(2).mean()), decay=0.5)
        >>> for _ in range(3):
        ...     state, _ = step(state, torch.ones(4, 2))
        >>> state.transforms["ema"]
        EMAState(updates=3, 2 params)
    """
    _check_args(decay, every, warmup, begin, count)
    return step.with_transform(EMA(float(decay), every, warmup, begin, count, step.bound))


def ema_key(transforms: Mapping[str, Any], name: str | None = None) -> str:
    """The key of the average in ``state.transforms``: ``"ema"``, or ``"<name>/ema"`` for the
    step bound to optimizer(s) ``name``; ``None``: the state's only one.

    Example:
        >>> ema_key({"ema": 0}), ema_key({"disc/amp": 0, "gen/ema": 0}), ema_key({}, "gen")
        ('ema', 'gen/ema', 'gen/ema')
    """
    if name is not None:
        return f"{name}/ema" if name else "ema"
    keys = [k for k in transforms if k == "ema" or k.endswith("/ema")]
    if len(keys) > 1:
        names = [k.rpartition("/")[0] for k in keys]
        raise ValueError(
            f"This state keeps several weight averages ({keys}): say whose, e.g. "
            f"swap_ema(state, {names[0]!r}) (the name of the step, its optimizer's)."
        )
    return keys[0] if keys else "ema"


def _ema_of(state: TrainState, name: str | None = None) -> EMAState:
    from ftrain.state import Unloaded

    ema = state.transforms.get(ema_key(state.transforms, name))
    if isinstance(ema, Unloaded):  # loaded from a checkpoint, the step not run yet
        ema = EMAState.from_saved(ema.saved, state.model)
    if not isinstance(ema, EMAState):
        raise ValueError(
            "This state has no weight average: build the step with ftrain.with_ema(step, ...) "
            "and call it at least once (or step.init(state)) before evaluating with the EMA."
        )
    return ema


@contextlib.contextmanager
def swap_ema(state: TrainState, name: str | None = None) -> Iterator[torch.nn.Module]:
    """The averaged weights in ``state.model`` for the ``with`` block, its own put back after
    (also on errors). Under FSDP2 each rank swaps its own shards (no communication).
    ``name``: whose average, when several steps keep one (:func:`ema_key`); a bound step's
    average swaps in the parameters of its optimizers alone.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> state = ftrain.with_ema(ftrain.make_step(lambda m, b: m(b).sum())).init(state)
        >>> with swap_ema(state) as model:
        ...     torch.equal(model.weight, state.transforms["ema"].params["weight"])
        True
    """
    pairs = _ema_of(state, name).pairs(state.model)
    wait_readers(state)  # a background checkpoint copy still reading the weights
    with torch.no_grad():
        backup = [p.clone() for p in pairs.params_src]
        torch._foreach_copy_(pairs.params_src, pairs.params_ema)
    try:
        yield state.model
    finally:
        with torch.no_grad():
            torch._foreach_copy_(pairs.params_src, backup)


def use_ema(fn: Callable[[Any], Any], name: str | None = None) -> Callable[[Any], Any]:
    """``fn(state)`` run with the averaged weights swapped in (for ``EvalHook``); ``name``:
    as :func:`swap_ema`'s.

    Example:
        >>> f = use_ema(lambda state: {"acc": 1.0})
        >>> f.__name__
        'ema_<lambda>'
    """

    def evaluate_ema(state: Any) -> Any:
        with swap_ema(state, name):
            return fn(state)

    evaluate_ema.__name__ = evaluate_ema.__qualname__ = f"ema_{getattr(fn, '__name__', 'fn')}"
    return evaluate_ema


def ema_state_dict(state: TrainState, name: str | None = None) -> dict[str, torch.Tensor]:
    """The averaged weights as a model state dict (full tensors; a collective under FSDP2):
    ``model.load_state_dict(ema_state_dict(state))`` gives a model with them. A bound
    step's average (``name``, as :func:`swap_ema`'s) covers its optimizers' parameters: the
    model's other weights are its live ones.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> state = ftrain.with_ema(ftrain.make_step(lambda m, b: m(b).sum())).init(state)
        >>> sorted(ema_state_dict(state))
        ['bias', 'weight']
    """
    module = _ema_of(state, name).state_dict()["module"]
    model = unwrap(state.model)
    if {n for n, _ in model.named_parameters()} <= module.keys():
        return module
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {**live, **module}
