"""The training loop: a generator of events you can drive from a notebook.

::

    lp = ftrain.Loop(step, state, data, hooks=ftrain.default_hooks(), epochs=3,
                     work_dir="runs/exp1", resume="auto")
    state = lp.run()                  # train to the end (a script), or:
    lp.run(steps=500)                 # 500 more updates, then pause (hooks stay open)
    for ev in lp:                     # every event, after all hooks saw it (a notebook)
        ...
    state = lp.state                  # the newest consistent state

What runs when (one call of ``next`` on the loop)::

    first iteration:   resume (state, data position, hook state) if asked
                       hooks start in priority order       (code before their loop)
                       RunBegin; then the loop reads the hooks' cadences
    each epoch:        sampler.set_epoch(epoch); EpochBegin
    each micro-batch:  batch = next(data)                  (data_time)
                       state, metrics = step(state, batch)
                       loop.totals counts it: times, metrics (no host sync)
                       StepEnd(state, metrics, is_update, data_time, iter_time)
                         (only at updates some hook's cadence is due at, unless
                         you iterate the loop yourself or a hook has no cadence;
                         always when a stop is held or max_steps is reached)
                       stop here if max_steps is reached or a hook asked to stop
                       (Evaluated: added by an evaluation hook, seen by later hooks)
    run(steps=N) done: Paused; the next event comes when run() continues
    end of the data:   step.flush(state) applies a partial accumulation window
                       (a StepEnd with is_update=True); state.epoch += 1; EpochEnd
    the end:           RunEnd; hooks finish in priority order (code after their loop)
                       (no RunEnd on an interruption: only each hook's ``finally``)

Interrupting (Ctrl-C, SIGTERM, SIGUSR1) stops at a safe point: the signal is
held while the loop or a hook runs and raised once the running step's event
has passed every hook, so ``lp.state`` is consistent, every hook's ``finally``
has run (the auto-checkpoint saved exactly there) and iterating ``lp`` again
continues. SIGTERM/SIGUSR1 raise :class:`TerminatedError`. Under
``torch.distributed`` the ranks vote (:class:`ftrain.dist.StopVote`), so all
stop after the same update.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ftrain import dist as _dist
from ftrain.errors import CheckpointError, NonFiniteLossError
from ftrain.events import EpochBegin, EpochEnd, Event, Paused, RunBegin, RunEnd, RunTotals, StepEnd
from ftrain.hooks.base import HookPlan, resolve_hooks
from ftrain.persist import state as persist_state
from ftrain.persist.rng import capture_rng, restore_rng
from ftrain.state import TrainState
from ftrain.step import Step

__all__ = ["Loop", "TerminatedError", "PREEMPTED_EXIT_CODE", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "ftrain.checkpoint/1"
_NEVER = 1 << 62  # an update number no run reaches
_END = object()  # the data ran out


#: The exit status of a run stopped by SIGTERM/SIGUSR1 after saving ``interrupted.pth``:
#: ``EX_TEMPFAIL`` (a job script requeues on it; docs/distributed.md, "Preemption").
PREEMPTED_EXIT_CODE = 75

# The signals the loop holds; several processes: what a rank proposes (the largest wins).
_STOP_CODES = {signal.SIGINT: 1, signal.SIGTERM: 3}
if hasattr(signal, "SIGUSR1"):
    _STOP_CODES[signal.SIGUSR1] = 2
_HELD_SIGNALS = tuple(_STOP_CODES)
_SIGNAL_OF_CODE = {code: signum for signum, code in _STOP_CODES.items()}


class TerminatedError(SystemExit):
    """Raised in place of SIGTERM or SIGUSR1 at the loop's next safe point.

    A ``SystemExit`` with :data:`PREEMPTED_EXIT_CODE` (raised once every hook's
    ``finally`` has run), so a scheduler can requeue the job; ``signum``: the signal.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum = signum


class _Signals:
    """Hold SIGINT/SIGTERM/SIGUSR1 while ``holding``; the loop raises ``pending`` at a safe point.

    While the caller's code runs a signal acts at once, and so does a second
    Ctrl-C (a hung loader can still be stopped). Several processes (``vote``):
    a signal is only ``requested``; ``pending`` is set when the ranks agree.
    """

    def __init__(self) -> None:
        self.holding = False
        self.pending: int | None = None
        self._old: dict[int, Any] = {}
        self.vote: Any = None  # several processes: the run's ftrain.dist.StopVote
        self.requested = 0

    def install(self) -> None:
        """Take the signals (SIGUSR1 only from its default action: a cluster tool's stays)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in _HELD_SIGNALS:
            with contextlib.suppress(ValueError, OSError):  # exotic environments
                current = signal.getsignal(sig)
                if sig in self._old and current == self._handler:
                    continue  # already ours: keep the handler we saved
                if sig not in (signal.SIGINT, signal.SIGTERM) and current != signal.SIG_DFL:
                    continue  # someone else's SIGUSR1 handler
                self._old[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Give back the saved handlers, unless someone has replaced ours since."""
        self.pending = None  # the run is ending on an exception already, or was raised
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old.items():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) == self._handler:
                    signal.signal(sig, old)
        self._old.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.vote is not None:  # several processes: held until the ranks agree
            code = _STOP_CODES.get(signum, 0)
            if code == self.requested == _STOP_CODES[signal.SIGINT]:
                raise KeyboardInterrupt  # a second Ctrl-C acts at once
            self.requested = max(self.requested, code)
            return
        if not self.holding or (signum == signal.SIGINT and self.pending == signal.SIGINT):
            self.pending = signum
            self.raise_pending()
        if self.pending is None or self.pending == signal.SIGINT:
            self.pending = signum  # a SIGTERM/SIGUSR1 outranks a held Ctrl-C

    def raise_pending(self) -> None:
        signum, self.pending = self.pending, None
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum is not None:
            raise TerminatedError(signum)

    def start_voting(self) -> None:
        """Several processes: signals stop every rank at the same update (see :meth:`agree`)."""
        self.requested = 0
        self.vote = None
        if _dist.world_size() > 1:
            try:
                self.vote = _dist.StopVote()
            except Exception as exc:  # no gloo (or no real process group)
                warnings.warn(
                    f"Ranks cannot vote on stopping ({exc}): a signal then stops only the rank "
                    "it reaches, and the interrupted checkpoint may not be agreed. Install a "
                    "torch build with gloo to have every rank stop at the same update.",
                    stacklevel=4,
                )

    def agree(self) -> None:
        """Every rank, at the same point: ``pending`` becomes the signal any rank holds."""
        if self.vote is not None:
            code = self.vote.settle(self.requested)
            if code:
                self.pending = _SIGNAL_OF_CODE[code]

    def stop_voting(self) -> None:
        vote, self.vote = self.vote, None
        if vote is not None:
            vote.close()


def _check_count(where: str, name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{where}: {name} must be a whole number >= 1 or None, got {value!r}.")


def _parts(data: Any) -> list[Any]:
    """The loader, its sampler, batch sampler and the batch sampler's sampler (deduplicated)."""
    batch_sampler = getattr(data, "batch_sampler", None)
    objs = (data, getattr(data, "sampler", None), batch_sampler)
    objs += (getattr(batch_sampler, "sampler", None),)
    return list({id(o): o for o in objs if o is not None}.values())


def _set_epoch(data: Any, epoch: int) -> None:
    """``set_epoch`` on a distributed sampler wherever the loader keeps it."""
    for obj in _parts(data):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


def _generators(data: Any) -> list[Any]:
    """The ``torch.Generator`` objects a loader shuffles with (deduplicated)."""
    import torch

    gens = (getattr(obj, "generator", None) for obj in _parts(data))
    return list({id(g): g for g in gens if isinstance(g, torch.Generator)}.values())


_RUNS: weakref.WeakSet[Iterator[Event]] = weakref.WeakSet()  # every loop generator made
_PAUSED: weakref.WeakSet[Loop] = weakref.WeakSet()  # loops paused by run(steps=...)


@atexit.register
def _close_open_runs() -> None:
    """At exit, close open loop generators while Python still works (so hooks clean up:
    ``interrupted.pth`` is saved; at interpreter shutdown TensorBoard's flush would hang)."""
    for gen in list(_RUNS):
        with contextlib.suppress(Exception):
            gen.close()


class Loop:
    """A resumable training run over ``data``: ``run()`` it, or iterate it for its events.

    Args:
        step: the training step (:func:`~ftrain.make_step` plus transforms).
        state: the initial :class:`~ftrain.TrainState` (consumed).
        data: a re-iterable of batches (a list, a ``DataLoader``), read again
            each epoch. One with ``state_dict``/``load_state_dict`` (torchdata
            ``StatefulDataLoader``) has its position saved and restored; any
            other is re-read up to the saved position on resume.
        hooks: hooks (see :mod:`ftrain.hooks`); ``None``: :func:`~ftrain.default_hooks`.
        max_steps: stop after this many optimizer updates.
        epochs: stop after this many passes over ``data`` (1 when neither is given).
        work_dir: where checkpoints and logs go.
        resume: ``"auto"``: the newest good checkpoint in ``work_dir`` (a fresh
            start when there is none), or a checkpoint path.
        reseed_data: seed the loader's shuffling ``generator`` with ``seed +
            epoch`` at each epoch start, so resume is exact (default True).

    Public attributes: ``state`` (the newest consistent state), ``hooks``
    (the resolved :class:`~ftrain.hooks.base.HookPlan`), ``totals``
    (:class:`~ftrain.events.RunTotals`), ``in_epoch``, ``batch_in_epoch``,
    ``stop_reason``, ``resumed_from``, ``work_dir``, ``max_steps``, ``epochs``.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
        >>> lp = ftrain.Loop(step, state, [torch.ones(4, 2)] * 3, hooks=[], epochs=2)
        >>> lp.run().step
        6
    """

    def __init__(
        self,
        step: Step,
        state: TrainState,
        data: Iterable[Any],
        hooks: Iterable[Any] | None = None,
        *,
        max_steps: int | None = None,
        epochs: int | None = None,
        work_dir: str | os.PathLike | None = None,
        resume: str | os.PathLike | bool | None = None,
        reseed_data: bool = True,
    ) -> None:
        if not isinstance(step, Step):
            raise TypeError(f"Loop: step must be an ftrain Step (make_step(...)), got {step!r}.")
        if not isinstance(state, TrainState):
            raise TypeError(f"Loop: state must be a TrainState, got {type(state).__name__}.")
        state.check_fresh()
        _check_count("Loop", "max_steps", max_steps)
        _check_count("Loop", "epochs", epochs)
        if not hasattr(data, "__iter__"):
            raise TypeError(f"Loop: data must be iterable (a DataLoader, a list...), got {data!r}.")
        if isinstance(data, Iterator) and epochs is not None and epochs > 1:
            raise ValueError(
                f"Loop: data is a one-shot iterator ({type(data).__name__}): it can be read once, "
                f"so epochs={epochs} would train one epoch. Pass something that can be read "
                "again each epoch (a list, a DataLoader, an object whose __iter__ makes a new "
                "generator), or train on it once with max_steps=."
            )
        from ftrain.persist.resume import resume_mode

        resume_mode(resume, work_dir)  # a bad value fails here, before anything runs
        if hooks is None:
            from ftrain.hooks.defaults import default_hooks

            hooks = default_hooks()
        self.step = step
        self.state = state
        self.data = data
        self.hooks: HookPlan = resolve_hooks(hooks)
        self.max_steps = max_steps
        self.epochs = epochs if epochs is not None or max_steps is not None else 1
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self.resume = resume
        self.reseed_data = reseed_data
        self._data_seed: int | None = None
        self.resumed_from: Path | None = None
        self.stop_reason: str | None = None
        self._iter: Iterator[Any] | None = None
        #: Micro-batches read so far in the current epoch.
        self.batch_in_epoch = 0
        self._skip = 0  # batches to re-read when the epoch starts (a plain iterable resumed)
        self._resume_in_epoch = False  # the next epoch start continues a resumed epoch
        self._resume_at_end = False  # resumed after the epoch's data ran out: end it first
        self._exhausted = False  # the current epoch's data ran out; its end is under way
        self._epoch_rng: dict[str, Any] | None = None  # the RNG when a plain iterable's epoch began
        self._started = False
        self._running = False
        self._signals = _Signals()
        #: Counts, times and metric sums of every micro-batch this loop ran.
        self.totals = RunTotals()
        self._all_steps = True  # the consumer wants every StepEnd (``for ev in lp``)
        self._pause_at = _NEVER  # run(steps=...): the update to pause at
        self._pause_steps: int | None = None  # run(steps=...) before the run has started
        self._paused: Iterator[Event] | None = None
        #: Identifies this run in checkpoint manifests (kept across resume).
        self.run_id = uuid.uuid4().hex[:12]
        #: How this run saves and loads (:class:`ftrain.persist.checkpointer.Checkpointer`), set when it starts.
        self.checkpointer: Any = None

    # ---------------------------------------------------------------- public
    def __iter__(self) -> Iterator[Event]:
        if self._paused is not None:
            raise RuntimeError(
                "This loop is paused by run(steps=...): continue it with lp.run(), or end it "
                "with lp.close(), before iterating it."
            )
        self._pause_at, self._pause_steps = _NEVER, None
        gen = self._iterate(all_steps=True)
        _RUNS.add(gen)
        return gen

    def run(self, steps: int | None = None) -> TrainState:
        """Train to the end, or ``steps`` more optimizer updates; return the state.

        With ``steps`` the run pauses with its hooks open (no ``RunEnd``): a
        later ``run()`` continues it exactly; :meth:`close` ends it early.
        Hooks see only the ``StepEnd`` events their cadence asks for.

        Example:
            >>> import torch, ftrain
            >>> m = torch.nn.Linear(2, 1)
            >>> state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
            >>> step = ftrain.make_step(lambda m, b: m(b).pow(2).mean())
            >>> lp = ftrain.Loop(step, state, [torch.ones(4, 2)] * 10, hooks=[])
            >>> lp.run(steps=3).step, lp.run().step
            (3, 10)
        """
        _check_count("Loop.run", "steps", steps)
        gen = self._paused
        if gen is None:
            self._pause_at = _NEVER
            self._pause_steps = steps  # counted from where the run starts (after a resume)
            gen = self._iterate(all_steps=False)
            _RUNS.add(gen)
        else:
            self._paused = None
            self._pause_at = _NEVER if steps is None else self.state.step + steps
        _PAUSED.discard(self)
        for ev in gen:
            if type(ev) is Paused:
                self._paused = gen  # hooks stay open; run() continues
                _PAUSED.add(self)
                break
        return self.state

    def close(self) -> None:
        """End a run paused by ``run(steps=...)`` as on Ctrl-C (a resumable checkpoint is saved)."""
        gen, self._paused = self._paused, None
        _PAUSED.discard(self)
        if gen is not None:
            gen.close()

    def request_stop(self, reason: str = "requested") -> None:
        """Ask the loop to stop after the current event (early stopping)."""
        self.stop_reason = reason

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch is under way (its data opened, or a resumed epoch to continue)."""
        return self._iter is not None or self._resume_in_epoch

    @property
    def batches_per_epoch(self) -> int | None:
        """``len(data)`` when the data has a usable length, else ``None`` (a generator, an
        iterable dataset): the end of an epoch then shows only when its data runs out."""
        try:
            n = len(self.data)  # type: ignore[arg-type]
        except Exception:  # no __len__, or an IterableDataset loader that raises
            return None
        return n if isinstance(n, int) and n > 0 else None

    @property
    def done(self) -> bool:
        """Whether the run reached its end (max_steps, epochs or a stop request)."""
        if self.stop_reason is not None:
            return True
        s = self.state
        if self.max_steps is not None and s.step >= self.max_steps and self.step.pending(s) == 0:
            return True
        return self.epochs is not None and s.epoch >= self.epochs and self._iter is None

    def checkpoint(self) -> dict[str, Any]:
        """Everything needed to resume this run exactly, as one dict: this process's view.

        Not a collective, except that an FSDP2 model's EMA state is gathered whole.
        """
        state_dict = getattr(self.data, "state_dict", None)
        return {
            "format": CHECKPOINT_FORMAT,
            "state": persist_state.state_dict(self.state),
            "loop": {
                "batch_in_epoch": self.batch_in_epoch,
                "in_epoch": self.in_epoch,
                "exhausted": self._exhausted,
                "epoch_rng": self._epoch_rng,
                "stop_reason": self.stop_reason,
                "data_seed": self._data_seed,
                "run_id": self.run_id,
                "data_len": self.batches_per_epoch,
                "totals": self.totals.state_dict(),
            },
            "data": state_dict() if callable(state_dict) else None,
            "hooks": {h.name: h.state_dict() for h in self.hooks if h.stateful},
            "time": time.time(),
            "dist": {
                "world_size": _dist.world_size(),
                "strategy": _dist.strategy(self.state.model),
            },
        }

    def load(self, saved: dict[str, Any], *, source: str = "checkpoint") -> None:
        """Restore a :meth:`checkpoint` dict into this loop (before iterating)."""
        if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{source} is not an ftrain loop checkpoint (format {CHECKPOINT_FORMAT!r}); for "
                "weights only use ftrain.checkpoint.load_weights(model, path)."
            )
        from ftrain.persist.resume import checkpointer_of

        checkpointer = checkpointer_of(self)
        if "ranks" in saved:  # every rank's part in one dict (ftrain 0.1.0)
            saved = dict(saved)
            saved = checkpointer.localize(saved, saved.pop("ranks"), source)
        sharded_dir = saved.get("sharded_dir")
        # an EMAHook's state (ftrain 0.1) becomes with_ema's
        state_dict = persist_state.adopt_hook_state(saved["state"], saved.get("hooks", {}))
        if sharded_dir is not None:  # FSDP2: model and optimizer are in the DCP shards
            state_dict = checkpointer.placeholders(state_dict, self.state)
        self.state = persist_state.load_state_dict(self.state, state_dict)
        if sharded_dir is not None:
            checkpointer.load_sharded(self.state, sharded_dir)
        position = saved.get("loop", {})
        if position.get("totals") is not None:  # (ftrain 0.1.0 saved none)
            self.totals.load_state_dict(position["totals"])
        self._data_seed = position.get("data_seed")
        self._restore_position(position, saved.get("data"))
        self.run_id = position.get("run_id") or self.run_id
        for h in self.hooks:
            saved_hook = saved.get("hooks", {}).get(h.name)
            if saved_hook is not None:
                h.load_state_dict(saved_hook)

    def _restore_position(self, position: dict[str, Any], data_state: Any) -> None:
        """Where in its data a resumed run continues.

        Mid-epoch, a loader with ``load_state_dict`` gets its saved position; any
        other iterable is re-read up to it (with the RNG as when the epoch began).
        Between epochs the loader's state is restored only if the loop does not reseed it.
        """
        in_epoch = bool(position.get("in_epoch"))
        at_end = in_epoch and bool(position.get("exhausted"))
        self.batch_in_epoch = int(position.get("batch_in_epoch", 0)) if in_epoch else 0
        self._epoch_rng = position.get("epoch_rng")
        self._resume_at_end = at_end
        self._resume_in_epoch = in_epoch and not at_end
        self._skip = 0
        loads = hasattr(self.data, "load_state_dict")
        # between epochs a loop reseeding the loader's generators sets the order itself
        reseeds = self.reseed_data and bool(_generators(self.data))
        if data_state is not None and loads and (self._resume_in_epoch or not reseeds):
            self.data.load_state_dict(data_state)
        elif self._resume_in_epoch:
            if data_state is not None:
                warnings.warn(
                    f"The checkpoint holds a data loader's position, but data has no "
                    f"load_state_dict: re-reading the epoch's first {self.batch_in_epoch} batches "
                    "instead (exact only if the data is read in the same order).",
                    stacklevel=4,
                )
            self._skip = self.batch_in_epoch

    def __repr__(self) -> str:
        limit = [
            f"{k}={v}" for k, v in (("max_steps", self.max_steps), ("epochs", self.epochs)) if v
        ]
        status = ", paused" if self._paused is not None else (", done" if self.done else "")
        return (
            f"Loop(step={self.state.step if not self.state.is_consumed else '?'}{status}, "
            f"{', '.join(limit)}, hooks={[h.name for h in self.hooks]}, work_dir={self.work_dir})"
        )

    # -------------------------------------------------------------- internal
    def _close_paused_runs_here(self) -> None:
        """Close other paused runs of this ``work_dir`` (a notebook cell run twice)."""
        if self.work_dir is None:
            return
        here = os.path.realpath(self.work_dir)
        for other in list(_PAUSED):
            if other is not self and other.work_dir and os.path.realpath(other.work_dir) == here:
                warnings.warn(
                    f"Closing a paused run in {self.work_dir} (step {other.state.step}) "
                    "before starting another there; it saves a resumable checkpoint.",
                    stacklevel=4,
                )
                other.close()

    def _cadences(self) -> list[Any] | None:
        """The hooks' cadences, or ``None``: every ``StepEnd`` (you iterate, or a hook needs all)."""
        cadences = [h.cadence for h in self.hooks]
        return None if self._all_steps or any(c.micro_batches for c in cadences) else cadences

    def _next_due(self, cadences: list[Any], step: int) -> int:
        """The first update after ``step`` whose ``StepEnd`` a hook, ``run`` or max_steps needs."""
        dues = (c.next_due(step) for c in cadences)
        return min([self._pause_at, self.max_steps or _NEVER, *(n for n in dues if n is not None)])

    def _source(self, resumed: bool) -> Iterator[Event]:
        """The events before any hook: the loop itself."""
        signals = self._signals
        signals.install()
        signals.start_voting()  # several processes only
        totals = self.totals
        add_metrics = totals.add
        try:
            yield RunBegin(self, self.state, resumed=resumed)
            signals.raise_pending()
            cadences = self._cadences()  # every hook has started (and seen RunBegin)
            if self._pause_steps is not None:  # run(steps=...): from here (after a resume)
                self._pause_at = self.state.step + self._pause_steps
                self._pause_steps = None
            if self._resume_at_end:  # saved after the epoch's data ran out: end that epoch
                self._resume_at_end = False
                yield from self._end_epoch()
            step_fn = self.step
            if signals.vote is not None:  # several processes: vote after each update
                step_fn = self._voting(step_fn)
            perf = time.perf_counter
            last = perf()
            while not self.done:
                if self.state.step >= self._pause_at and not self._epoch_exhausted():
                    # run(steps=...) is done. While paused the caller owns Ctrl-C
                    # (Jupyter resets it before each cell).
                    self._pause_at = _NEVER
                    signals.agree()
                    signals.raise_pending()
                    signals.uninstall()
                    try:
                        yield Paused(self, self.state)
                    finally:
                        signals.install()
                    last = perf()  # the pause is no step's time
                    continue
                if self._iter is None:
                    yield from self._start_epoch()
                    last = perf()
                it = self._iter
                # The update whose StepEnd is yielded; every StepEnd (-1) on a full stream.
                limit = -1 if cadences is None else self._next_due(cadences, self.state.step)
                # The hot loop: steps nobody asked for make no event and run no hook.
                # Sums and the position live in locals, stored back when it ends. A
                # signal landing while a batch is read lets that batch's step run.
                step = self.state.step
                position = self.batch_in_epoch
                n = updates = 0
                data_sum = iter_sum = 0.0
                t0 = perf()
                try:
                    while True:
                        try:
                            batch = next(it)
                        except StopIteration:
                            batch = _END
                            if position == 0:
                                raise self._no_batch() from None
                            break
                        except BaseException:
                            self.batch_in_epoch = position
                            self._data_interrupted()
                            raise
                        t1 = perf()
                        try:
                            self.state, metrics = step_fn(self.state, batch)
                            position += 1
                        except NonFiniteLossError as exc:
                            if exc.state is not None:
                                self.state = exc.state  # the last good update: hooks may save it
                            raise
                        t2 = perf()
                        n += 1
                        data_time = t1 - t0
                        iter_time = t2 - last
                        data_sum += data_time
                        iter_sum += iter_time
                        last = t0 = t2
                        before, step = step, self.state.step
                        if step != before:
                            updates += 1
                        add_metrics(metrics)
                        # A signal held during the read or the step is raised only after
                        # the hooks have seen this update (checkpoints, EMA...).
                        if (
                            step >= limit
                            or signals.pending is not None
                            or self.stop_reason is not None  # request_stop() from anywhere
                        ):
                            break
                finally:
                    self.batch_in_epoch = position
                    totals.micro_batches += n
                    totals.updates += updates
                    totals.data_time += data_sum
                    totals.iter_time += iter_sum
                if batch is _END:
                    yield from self._end_epoch()
                    last = perf()
                    continue
                yield StepEnd(
                    self, self.state, metrics, step != before, data_time, iter_time, batch
                )
                signals.raise_pending()
            if self.step.pending(self.state):
                yield self._flush()
                signals.raise_pending()
            yield RunEnd(self, self.state)
            signals.agree()  # several processes: a signal any rank holds stops them all
            signals.raise_pending()  # a signal held during RunEnd's hooks still stops the caller
        finally:
            signals.stop_voting()
            signals.uninstall()

    def _stopped_hook(self, gens: list[Any]) -> None:
        """The stream ended before ``RunEnd``: a hook stopped passing events on. Name it."""
        names = [h.name for h in self.hooks]  # (with no hook the stream always ends in RunEnd)
        i = next((i for i, g in enumerate(gens) if getattr(g, "gi_frame", 0) is None), 0)
        later = ", ".join(names[i + 1 :]) or "none"
        raise RuntimeError(
            f"Hook {names[i]!r} stopped passing events on (at step {self.state.step}): the hooks "
            f"after it ({later}) and the caller saw nothing from then on, checkpoints included. "
            "A hook must yield every event it receives (`for ev in events: ...; yield ev`)."
        )

    def _voting(self, step: Step) -> Any:
        """``step``, then (after an update) every rank's vote on stopping: all ranks read
        the result at the same later update, so all leave the hot loop there."""
        signals = self._signals
        vote = signals.vote.update

        def voting_step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
            before = state.step
            state, metrics = step(state, batch)
            if state.step != before:
                code = vote(signals.requested)
                if code:
                    signals.pending = _SIGNAL_OF_CODE[code]
            return state, metrics

        return voting_step

    def _start_epoch(self) -> Iterator[Event]:
        """``EpochBegin``, then open the data (after the hooks, so a loader shuffling from
        the global RNG draws at the same point in a resumed run)."""
        epoch = self.state.epoch
        _set_epoch(self.data, epoch)
        resuming = self._resume_in_epoch  # (a checkpoint during EpochBegin keeps the position)
        if self.reseed_data and (not resuming or self._skip):
            self._reseed(epoch)
        if not resuming:
            self.batch_in_epoch = 0
        yield EpochBegin(self, self.state, epoch)
        self._iter = self._open_data()
        self._resume_in_epoch = False

    def _open_data(self) -> Iterator[Any]:
        """``iter(data)``; for a plain iterable resumed mid-epoch, skip what was trained on."""
        skip, self._skip = self._skip, 0
        if hasattr(self.data, "load_state_dict"):
            self._epoch_rng = None  # the loader restores its own position
            return iter(self.data)
        if not skip:
            self._epoch_rng = capture_rng()  # what a resumed run replays this epoch's order with
            return iter(self.data)
        # Re-read from the epoch's start with the generators as they were then (a
        # DataLoader without a generator shuffles from the global RNG), then put back.
        now = capture_rng() if self._epoch_rng is not None else None
        try:
            if self._epoch_rng is not None:
                restore_rng(self._epoch_rng)
            it = iter(self.data)
            next(itertools.islice(it, skip - 1, None), None)
        finally:
            if now is not None:
                restore_rng(now)
        return it

    def _epoch_exhausted(self) -> bool:
        """Whether every batch of the current epoch is done (its end is still to come)."""
        n = self.batches_per_epoch  # None: the end shows only when the data runs out
        return self._iter is not None and n is not None and self.batch_in_epoch >= n

    def _reseed(self, epoch: int) -> None:
        """Seed the loader's shuffling generator with ``seed + epoch`` (as ``DistributedSampler``
        does), so a resumed run sees the same batches, also mid-epoch."""
        gens = _generators(self.data)
        if not gens:
            return
        if self._data_seed is None:
            self._data_seed = gens[0].initial_seed()
        for g in gens:
            g.manual_seed(self._data_seed + epoch)

    def _flush(self) -> StepEnd:
        # under DDP/FSDP2 the window's micro-batches skipped the all-reduce
        _dist.sync_pending_grads(self.state.model)
        self.state, metrics = self.step.flush(self.state)
        self.totals.micro_batches += 1
        self.totals.updates += 1
        self.totals.add(metrics)
        return StepEnd(self, self.state, metrics, True, 0.0, 0.0, None)

    def _no_batch(self) -> ValueError:
        kind = type(self.data).__name__
        return ValueError(
            f"Loop: the data ({kind}) gave no batch in epoch {self.state.epoch}, so the run "
            "cannot make progress. A one-shot iterator (a generator) is empty after its first "
            "pass: pass something that can be read again each epoch (a list, a DataLoader, an "
            "object whose __iter__ makes a new generator), or stop within one pass (max_steps=). "
            "An empty DataLoader: check the dataset's length, batch_size and drop_last."
        )

    def _data_interrupted(self) -> None:
        """``next(data)`` raised (Ctrl-C while loading): a dead generator is re-opened and
        re-read up to the position on the next iteration."""
        it = self._iter
        if it is None or getattr(it, "gi_frame", True) is not None:
            return  # not a generator, or one still alive
        self._iter = None
        self._resume_in_epoch = True
        if not hasattr(self.data, "load_state_dict"):
            self._skip = self.batch_in_epoch

    def _end_epoch(self) -> Iterator[Event]:
        """Apply a partial window, count the epoch, ``EpochEnd``. Meanwhile a checkpoint
        records ``exhausted``: a run resumed from the flush's ``StepEnd`` ends the epoch."""
        self._exhausted = True
        if self.step.pending(self.state):
            yield self._flush()
            self._signals.raise_pending()
        epoch = self.state.epoch
        self.state = self.state.replace(epoch=epoch + 1)
        self._iter = None
        self.batch_in_epoch = 0
        self._exhausted = False
        yield EpochEnd(self, self.state, epoch)
        self._signals.raise_pending()

    def _iterate(self, all_steps: bool) -> Iterator[Event]:
        if self._running:
            raise RuntimeError("This loop is already being iterated; use one iterator at a time.")
        self._running = True
        self._all_steps = all_steps
        resumed = self._started
        from ftrain.persist.resume import close_run, open_run

        if not self._started:
            self._close_paused_runs_here()
        try:
            open_run(self, first=not self._started)  # lock work_dir; resume on the first start
        except BaseException:
            self._running = False
            raise
        self._started = True
        if resumed:
            self.stop_reason = None
        source = self._source(resumed)
        gens: list[Any] = []
        stream: Iterator[Event] = source
        signals = self._signals
        signals.holding = True  # signals wait for a safe point while the loop or a hook runs
        try:
            # Start each hook in priority order: its set-up runs and RunBegin passes on.
            for h in self.hooks:
                gen = h(stream)
                if not isinstance(gen, Iterator):
                    raise TypeError(
                        f"Hook {h.name!r} returned {type(gen).__name__}, not an iterator of "
                        "events: a hook must yield the events it receives "
                        "(`for ev in events: ... yield ev`)."
                    )
                gens.append(gen)
                try:
                    first = next(gen)
                except StopIteration:
                    raise RuntimeError(
                        f"Hook {h.name!r} ended at the start of the run: a hook must yield the "
                        "events it receives (`for ev in events: ... yield ev`)."
                    ) from None
                stream = itertools.chain((first,), gen)
            ended = False
            for ev in stream:
                ended = type(ev) is RunEnd
                signals.holding = False  # the caller's code: signals act at once
                yield ev
                signals.holding = True
            if not ended:
                self._stopped_hook(gens)
        finally:
            signals.holding = False
            self._running = False
            try:
                for gen in reversed(gens):
                    gen.close()
                source.close()
            finally:
                close_run(self)  # the run's writes are done, its directory unlocked
