"""Activation checkpointing as a step transform: ``with_activation_checkpoint``."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain._checks import flag
from ftrain.dist import unwrap
from ftrain.memory.accounting import ActivationAccountant
from ftrain.memory.apply import CheckpointSwitch
from ftrain.memory.dynamic_plan import (
    DynamicPlannerState,
    PlanSession,
    complete_cuda_sample,
    cuda_device_of,
    sample_backward_start,
)
from ftrain.memory.plans import DynamicPlan, Plan, SelectivePlan, as_plan
from ftrain.transforms.base import Tracing, Transform

if TYPE_CHECKING:
    from ftrain.step import Step, StepContext

__all__ = ["with_activation_checkpoint", "ActivationCheckpoint", "CheckpointState"]


class CheckpointState:
    """The transform's state in ``TrainState.transforms["activation_checkpoint"]``.

    ``modules``: the resolved names (a dynamic plan's candidates); ``planner``: a dynamic
    plan's :class:`~ftrain.memory.DynamicPlannerState`; ``last``: what the last forward did.

    Example:
        >>> s = CheckpointState(("a", "b"))
        >>> CheckpointState.from_state_dict(s.state_dict()).modules
        ('a', 'b')
    """

    def __init__(
        self, modules: Sequence[str] = (), planner: DynamicPlannerState | None = None
    ) -> None:
        self.modules = tuple(modules)
        self.planner = planner
        self.last: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "planner": None if self.planner is None else self.planner.state_dict(),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.modules = tuple(saved.get("modules", self.modules))
        planner = saved.get("planner")
        if planner is not None:
            if self.planner is None:
                self.planner = DynamicPlannerState()
            self.planner.load_state_dict(planner)

    @classmethod
    def from_state_dict(cls, saved: Mapping[str, Any]) -> CheckpointState:
        new = cls()
        new.load_state_dict(saved)
        return new

    def __repr__(self) -> str:
        if self.planner is not None:
            return f"CheckpointState({self.planner!r})"
        return f"CheckpointState({len(self.modules)} modules)"


@attrs.frozen
class ActivationCheckpoint(Transform):
    """Checkpoint modules during the forward. See :func:`with_activation_checkpoint`."""

    plan: Plan
    monitor: bool = False
    name = "activation_checkpoint"

    @property
    def tracing(self) -> Tracing:  # type: ignore[override]
        """with_compile: monitoring and a dynamic plan measure eager activations."""
        if self.monitor or isinstance(self.plan, DynamicPlan):
            return Tracing(eager="measures eager activations (monitor=True or a dynamic plan)")
        return Tracing()

    def init(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointState:
        """The resolved module names (and a fresh dynamic planner), by the user's names."""
        names = _resolved(self.plan, unwrap(model))
        planner = DynamicPlannerState(names) if isinstance(self.plan, DynamicPlan) else None
        return CheckpointState(names, planner)

    @contextlib.contextmanager
    def forward_context(self, ctx: StepContext) -> Iterator[None]:
        st: CheckpointState = ctx.tstate[self.name]
        # the user's module: names without DDP's "module." prefix, the same under DDP,
        # FSDP2 (sharded in place) and one process, so saved plan state stays valid
        model = unwrap(ctx.model)
        plan = self.plan
        names = _resolved(plan, model)
        if names != st.modules:
            # state made by another plan (another step, or a checkpoint of a run
            # with a different plan): this plan's modules, and a fresh warm-up
            st = self.init(model, ctx.optimizer)
        if isinstance(plan, DynamicPlan):
            assert st.planner is not None
            with PlanSession(plan, model, st.planner, monitor=self.monitor) as session:
                yield
            new = CheckpointState(st.modules, session.state)
            new.last = {"checkpointed": session.checkpointed, "size": session.size}
            if session.report is not None:
                new.last["activation_bytes"] = session.report.total_bytes
            ctx.tstate[self.name] = new
            return
        context_fn = plan.context_fn() if isinstance(plan, SelectivePlan) else None
        last: dict[str, Any] = {"checkpointed": list(st.modules)}
        with CheckpointSwitch(model, st.modules, context_fn=context_fn):
            if self.monitor:
                with ActivationAccountant(model, time=False) as acc:
                    yield
                last["activation_bytes"] = acc.total
            else:
                yield
        new = CheckpointState(st.modules, st.planner)
        new.last = last
        ctx.tstate[self.name] = new

    @contextlib.contextmanager
    def outer_context(self, ctx: StepContext) -> Iterator[None]:
        yield
        # after the backward: a CUDA warm-up sample of a dynamic plan is complete now
        # (its peak covers the forward and the backward, not the optimizer step)
        planner = ctx.tstate[self.name].planner
        if planner is not None and planner.pending is not None and "sampled" in planner.pending:
            complete_cuda_sample(planner, cuda_device_of(unwrap(ctx.model)))

    def after_forward(self, ctx: StepContext, loss: torch.Tensor) -> None:
        planner = ctx.tstate[self.name].planner
        if planner is not None and planner.pending is not None and "sampled" in planner.pending:
            sample_backward_start(planner, loss, cuda_device_of(unwrap(ctx.model)))
        last = ctx.tstate[self.name].last
        ctx.metrics["checkpointed_modules"] = torch.tensor(len(last.get("checkpointed", ())))
        if "activation_bytes" in last:
            ctx.metrics["activation_bytes"] = torch.tensor(last["activation_bytes"])


_RESOLVED: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _resolved(plan: Plan, model: torch.nn.Module) -> tuple[str, ...]:
    """``plan.resolve(model)``, cached per model and plan (``model`` already unwrapped)."""
    per_model = _RESOLVED.setdefault(model, {})
    try:
        names = per_model.get(plan)
    except TypeError:  # an unhashable plan field
        return plan.resolve(model)
    if names is None:
        names = per_model[plan] = plan.resolve(model)
    return names


def with_activation_checkpoint(
    step: Step, plan: Any, *, monitor: bool = False, model: torch.nn.Module | None = None
) -> Step:
    """Recompute chosen modules' activations in the backward instead of keeping them.

    ``plan``: module names (MMEngine ``activation_checkpointing``), :func:`~ftrain.memory.pattern`,
    :func:`~ftrain.memory.selective` (per-op) or :func:`~ftrain.memory.dynamic` (per input size
    under a budget; its planner state resumes). Non-reentrant ``torch.utils.checkpoint``, RNG
    preserved, BatchNorm statistics updated once. Names are checked at the first step (or at
    once given ``model``). Metrics: ``checkpointed_modules``, ``activation_bytes`` (monitored).

    Example:
        >>> import torch, ftrain
        >>> from ftrain.transforms.remat import with_activation_checkpoint
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        >>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = with_activation_checkpoint(
        ...     ftrain.make_step(lambda m, b: m(b).pow(2).mean()), ["0", "1"], monitor=True)
        >>> state, metrics = step(state, torch.randn(16, 4))
        >>> int(metrics["checkpointed_modules"]), int(metrics["activation_bytes"])
        (2, 1344)
    """
    flag("with_activation_checkpoint: monitor", monitor)
    p = as_plan(plan)
    if model is not None:
        p.resolve(unwrap(model))
    return step.with_transform(ActivationCheckpoint(p, bool(monitor)))
