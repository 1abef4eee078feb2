"""Several steps on each batch, as one step: ``d_step.then(g_step)`` (a GAN's round).

Each step of a sequence is bound to its own optimizer(s) (``make_step(loss_fn,
optimizer="disc")``) and keeps its own transforms and their state (a loss scaler, a
schedule, clipping...). One call runs them in order on the same batch, each seeing the
updates of those before it, and counts one ``state.step`` and one ``state.micro_step``:
every step reads the round's counters (a schedule of the generator's step at round ``r``
uses ``r``, as the discriminator's does). Metrics are prefixed by each step's name
(``disc/loss``, ``gen/loss``). The :class:`~ftrain.loop.Loop` takes a sequence as any step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ftrain.state import TrainState
from ftrain.step import LossFn, Metrics, Step, parse_loss
from ftrain.transforms.accum import GradAccum
from ftrain.transforms.base import Transform

__all__ = ["StepSequence", "sequence"]


@attrs.frozen
class _TotalLoss:
    """The sum of the steps' losses: what tools that run a step's ``loss_fn`` once (the FLOP
    counter of ``Throughput``) see of a sequence; training never calls it."""

    steps: tuple[Step, ...]

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return sum(parse_loss(s.loss_fn(model, batch))[0] for s in self.steps)  # type: ignore[return-value]


@attrs.frozen(repr=False)
class StepSequence(Step):
    """Steps run in order on each batch, one round per call. Build with ``a.then(b, ...)``.

    ``steps``: the steps, each bound to its own optimizer(s). ``pending``, ``flush``,
    ``observe`` and ``init`` act on each. Transforms compose on each step, not on the
    sequence (:meth:`with_transform` refuses).
    """

    steps: tuple[Step, ...] = attrs.field(kw_only=True, converter=tuple)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        self._check_in_step(state)
        step, micro = state.step, state.micro_step
        metrics: Metrics = {}
        for i, member in enumerate(self.steps):
            if i:  # each step reads the round's counters
                state = state.replace(step=step, micro_step=micro)
            try:
                state, out = member(state, batch)
            except BaseException as exc:
                _note_applied(exc, self.steps[:i])
                raise
            _prefixed(metrics, member.name, out)
        return state, metrics

    def _check_in_step(self, state: TrainState) -> None:
        """Refuse a state whose steps' accumulation windows differ: a call that failed after
        an earlier step counted the batch left them apart, and they would update on
        alternate rounds from then on."""
        pending = [member.pending(state) for member in self.steps]
        if any(n != pending[0] for n in pending):
            held = ", ".join(f"{m.name} {n}" for m, n in zip(self.steps, pending))
            raise ValueError(
                f"The sequence's steps hold different partial accumulation windows ({held} "
                "micro-batches): a call failed after an earlier step counted its batch. Call "
                "seq.flush(state) to apply the partial windows, or resume from a checkpoint."
            )

    def flush(self, state: TrainState) -> tuple[TrainState, Metrics]:
        """Apply every step's partial accumulation window (``(state, {})`` if none)."""
        state.check_fresh()
        if self.pending(state) == 0:
            return state, {}
        step, micro = state.step, state.micro_step
        metrics: Metrics = {}
        for member in self.steps:
            state, out = member.flush(state.replace(step=step, micro_step=micro))
            _prefixed(metrics, member.name, out)
        return state.replace(step=step + 1, micro_step=micro), metrics

    def pending(self, state: TrainState) -> int:
        return max(member.pending(state) for member in self.steps)

    def observe(self, state: TrainState, metrics: Mapping[str, Any]) -> TrainState:
        for member in self.steps:
            state = member.observe(state, metrics)
        return state

    def init(self, state: TrainState) -> TrainState:
        for member in self.steps:
            state = member.init(state)
        return state

    def with_transform(self, transform: Transform) -> Step:
        raise TypeError(
            f"A sequence of steps takes no transform of its own: compose {transform!r} on the "
            "step(s) it applies to, then sequence them, e.g. "
            "ftrain.with_amp(d_step, 'fp16').then(ftrain.with_amp(g_step, 'fp16'))."
        )

    def without(self, name: str) -> Step:
        raise TypeError(
            f"A sequence of steps has no transform of its own ({name!r}): drop it from its "
            f"steps ({', '.join(s.name for s in self.steps)}) and sequence them again."
        )

    def then(self, *steps: Step) -> StepSequence:
        return sequence(*self.steps, *steps)

    def __repr__(self) -> str:
        inner = "".join(f"\n  {s.name}: " + repr(s).replace("\n", "\n  ") for s in self.steps)
        return f"StepSequence({inner}\n)"


def _prefixed(metrics: Metrics, name: str, out: Mapping[str, Any]) -> None:
    for key, value in out.items():
        metrics[f"{name}/{key}"] = value


def _note_applied(exc: BaseException, done: tuple[Step, ...]) -> None:
    if done:
        exc.add_note(
            f"ftrain: the sequence's step(s) {[s.name for s in done]} already updated their "
            "optimizers on this batch; state.latest() continues after them, with the counters "
            "of before this batch."
        )


def _window(step: Step) -> int:
    return next((t.every for t in step.transforms if isinstance(t, GradAccum)), 1)


def _check(steps: tuple[Step, ...]) -> None:
    """Refuse what a sequence cannot run: a step not bound, an optimizer twice, windows of
    different lengths."""
    owner: dict[str, str] = {}
    for s in steps:
        if not isinstance(s, Step):
            raise TypeError(f"Step.then: each step must be an ftrain Step, got {s!r}.")
        if not s.bound:
            raise ValueError(
                f"Step.then: every step of a sequence is bound to the optimizer(s) it updates, "
                f"and {s!r} is not: make_step(loss_fn, optimizer='gen')."
            )
        for name in s.bound:
            if name in owner:
                raise ValueError(
                    f"Step.then: optimizer {name!r} is updated by two steps of the sequence "
                    f"({owner[name]!r} and {s.name!r}). Each optimizer belongs to one step (its "
                    "window, loss scaler and schedule live there): add the two losses in one "
                    "loss_fn, or run the steps on separate batches."
                )
            owner[name] = s.name
    windows = {s.name: _window(s) for s in steps}
    if len(set(windows.values())) > 1:
        raise ValueError(
            f"Step.then: the steps accumulate over different windows {windows}; a sequence "
            "counts one update per round of all its steps: use the same with_grad_accum(every=) "
            "on each."
        )


def sequence(*steps: Step) -> StepSequence:
    """``steps`` in order as one :class:`StepSequence` (sequences are flattened); what
    :meth:`Step.then` returns."""
    flat: list[Step] = []
    for s in steps:
        flat.extend(s.steps if isinstance(s, StepSequence) else (s,))
    members = tuple(flat)
    _check(members)
    loss_fn: LossFn = _TotalLoss(members)
    return StepSequence(loss_fn, steps=members)
