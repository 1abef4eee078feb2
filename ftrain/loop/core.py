"""``Loop``: the run's events and the hot loop. Its helpers are modules of their own:
:mod:`~ftrain.loop.signals` (held interrupts), :mod:`~ftrain.loop.data` (the data
position), :mod:`~ftrain.loop.registry` (open and paused loops); what hooks read of it is
:class:`ftrain.run.Run`.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrain import dist as _dist
from ftrain._checks import directory_arg, flag, whole
from ftrain.errors import CheckpointError, NonFiniteLossError
from ftrain.events import EpochBegin, EpochEnd, Event, Paused, RunBegin, RunEnd, RunTotals, StepEnd
from ftrain.hooks.base import HookPlan, resolve_hooks
from ftrain.hooks.cadence import Every
from ftrain.loop import registry
from ftrain.loop.data import DataPosition
from ftrain.loop.empty_batch import EmptyBatches
from ftrain.loop.signals import Signals
from ftrain.persist import state as persist_state
from ftrain.persist.checkpointer import Checkpointer
from ftrain.persist.location import Location, StoreURL, as_location, is_url
from ftrain.persist.resume import check_fits, collect_orphans, find_start, resume_mode
from ftrain.persist.snapshot import Snapshot
from ftrain.state import TrainState
from ftrain.step import Step

if TYPE_CHECKING:
    from ftrain.persist.mirror import LogMirror

__all__ = ["Loop", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "ftrain.checkpoint/1"
_NEVER = 1 << 62  # an update number no run reaches

StepFn = Callable[[TrainState, Any], tuple[TrainState, Any]]


def _check_count(where: str, name: str, value: Any) -> None:
    whole(f"{where}: {name}", value, 1, none=True)


def _check_args(step: Any, state: Any, data: Any, max_steps: Any, epochs: Any) -> None:
    """``Loop``'s arguments, checked before anything runs."""
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
        work_dir: where checkpoints and logs go: a local path, or a URL on an object
            store (``"s3://bucket/run"``, ``gs://``, ``memory://``; see
            :mod:`ftrain.persist.store`; the logs are written locally in ``log_dir`` and
            uploaded there).
        resume: ``"auto"``: the newest good checkpoint in ``work_dir`` (a fresh
            start when there is none), or a checkpoint path (or URL).
        reseed_data: seed the loader's shuffling ``generator`` with ``seed +
            epoch`` at each epoch start, so resume is exact (default True).
        storage_options: for a URL ``work_dir`` (and ``resume``), the options of its fsspec
            filesystem: credentials, endpoint (s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``); default: the environment's.

    Public attributes: ``state`` (the newest consistent state), ``hooks``
    (the resolved :class:`~ftrain.hooks.base.HookPlan`), ``totals``
    (:class:`~ftrain.events.RunTotals`), ``in_epoch``, ``batch_in_epoch``,
    ``stop_reason``, ``resumed_from``, ``work_dir``, ``log_dir``, ``max_steps``, ``epochs``,
    ``run_id``, ``checkpointer``: the :class:`ftrain.run.Run` that hooks read (``ev.loop``).

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
        work_dir: str | os.PathLike | StoreURL | None = None,
        resume: str | os.PathLike | StoreURL | bool | None = None,
        reseed_data: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        _check_args(step, state, data, max_steps, epochs)
        work_dir = directory_arg("Loop: work_dir", work_dir, storage_options)
        flag("Loop: reseed_data", reseed_data)
        if isinstance(resume, str) and is_url(resume):  # reached with work_dir's options
            resume = as_location(resume, storage_options)
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
        self.work_dir = work_dir
        self.resume = resume
        self.reseed_data = reseed_data
        self.resumed_from: Location | None = None
        self.stop_reason: str | None = None
        #: Counts, times and metric sums of every micro-batch this loop ran.
        self.totals = RunTotals()
        #: Identifies this run in checkpoint manifests (kept across resume).
        self.run_id = uuid.uuid4().hex[:12]
        #: How this run writes and reads checkpoints (one per run and process).
        self.checkpointer = Checkpointer(state.model)
        self._data = DataPosition(data, reseed=reseed_data)
        self._empty_batches = EmptyBatches()  # the run's first empty batch warns
        self._signals = Signals()
        self._started = self._running = False
        self._all_steps = True  # the consumer wants every StepEnd (``for ev in lp``)
        self._pause_at = _NEVER  # run(steps=...): the update to pause at
        self._pause_steps: int | None = None  # run(steps=...) before the run has started
        self._paused: Iterator[Event] | None = None
        self._mirror: LogMirror | None = None  # a work_dir on a store: the local logs

    # ---------------------------------------------------------------- public
    def __iter__(self) -> Iterator[Event]:
        if self._paused is not None:
            raise RuntimeError(
                "This loop is paused by run(steps=...): continue it with lp.run(), or end it "
                "with lp.close(), before iterating it."
            )
        self._pause_at, self._pause_steps = _NEVER, None
        return registry.track(self._iterate(all_steps=True))

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
            gen = registry.track(self._iterate(all_steps=False))
        else:
            self._paused = None
            self._pause_at = _NEVER if steps is None else self.state.step + steps
        registry.mark_paused(self, False)
        for ev in gen:
            if type(ev) is Paused:
                self._paused = gen  # hooks stay open; run() continues
                registry.mark_paused(self, True)
                break
        return self.state

    def close(self) -> None:
        """End a run paused by ``run(steps=...)`` as on Ctrl-C (a resumable checkpoint is saved)."""
        gen, self._paused = self._paused, None
        registry.mark_paused(self, False)
        if gen is not None:
            gen.close()

    def request_stop(self, reason: str = "requested") -> None:
        """Ask the loop to stop after the current event (early stopping)."""
        self.stop_reason = reason

    @property
    def log_dir(self) -> Path | None:
        """The local directory hooks write their files to (logs, traces): ``work_dir``; for
        a ``work_dir`` on a store, while the run is open, a local copy uploaded into it
        after each checkpoint and at the end (:mod:`ftrain.persist.mirror`)."""
        if self._mirror is not None:
            return self._mirror.local
        return self.work_dir if isinstance(self.work_dir, Path) else None

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch is under way (its data opened, or a resumed epoch to continue)."""
        return self._data.in_epoch

    @property
    def batch_in_epoch(self) -> int:
        """Micro-batches of the current epoch that reached the step."""
        return self._data.batch

    @property
    def batches_per_epoch(self) -> int | None:
        """``len(data)`` when the data has a usable length, else ``None`` (a generator, an
        iterable dataset): the end of an epoch then shows only when its data runs out."""
        return self._data.batches_per_epoch

    @property
    def done(self) -> bool:
        """Whether the run reached its end (max_steps, epochs or a stop request)."""
        if self.stop_reason is not None:
            return True
        s = self.state
        if self.max_steps is not None and s.step >= self.max_steps and self.step.pending(s) == 0:
            return True
        return self.epochs is not None and s.epoch >= self.epochs and self._data.it is None

    def checkpoint(self) -> dict[str, Any]:
        """Everything needed to resume this run exactly, as one dict: this process's view.

        Not a collective, except that an FSDP2 model's EMA state is gathered whole.
        Taking it never changes the data order (the loader's ``state_dict()`` is read only
        from an iterator of the current epoch).
        """
        state = persist_state.state_dict(self.state)
        position, data = self._data.checkpoint()
        return {
            "format": CHECKPOINT_FORMAT,
            "state": state,
            "loop": {
                **position,
                "stop_reason": self.stop_reason,
                "run_id": self.run_id,
                "data_len": self.batches_per_epoch,
                "totals": self.totals.state_dict(),
            },
            "data": data,
            "hooks": {h.name: h.state_dict() for h in self.hooks if h.stateful},
            "time": time.time(),
            "dist": {
                "world_size": _dist.world_size(),
                "strategy": _dist.strategy(self.state.model),
            },
        }

    def snapshot(self) -> Snapshot:
        """The run now, as :meth:`Checkpointer.save
        <ftrain.persist.checkpointer.Checkpointer.save>` takes it: :meth:`checkpoint`'s dict
        and what a save needs besides (the state, the pending window, rank-local hook keys)."""
        payload = self.checkpoint()  # (a consumed state raises StaleStateError here)
        s = self.state
        return Snapshot(
            payload, s.step, s.micro_step, s.epoch, self.run_id, s,
            self.step.pending(s), self.hooks.local_state_keys(),
        )  # fmt: skip

    def load(self, saved: dict[str, Any], *, source: str = "checkpoint") -> None:
        """Restore a :meth:`checkpoint` dict into this loop (before iterating)."""
        if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{source} is not an ftrain loop checkpoint (format {CHECKPOINT_FORMAT!r}); for "
                "weights only use ftrain.checkpoint.load_weights(model, path)."
            )
        ckpt = self.checkpointer
        if "ranks" in saved:  # every rank's part in one dict (ftrain 0.1.0)
            saved = dict(saved)
            saved = ckpt.localize(saved, saved.pop("ranks"), source)
        sharded_dir = saved.get("sharded_dir")
        # an EMAHook's state (ftrain 0.1) becomes with_ema's
        state_dict = persist_state.adopt_hook_state(saved["state"], saved.get("hooks", {}))
        if sharded_dir is not None:  # FSDP2: model and optimizer are in the DCP shards
            state_dict = ckpt.placeholders(state_dict, self.state)
        self.state = persist_state.load_state_dict(self.state, state_dict)
        if sharded_dir is not None:
            ckpt.load_sharded(self.state, sharded_dir)
        position = saved.get("loop", {})
        if position.get("totals") is not None:  # (ftrain 0.1.0 saved none)
            self.totals.load_state_dict(position["totals"])
        self._data.load(position, saved.get("data"))
        self.run_id = position.get("run_id") or self.run_id
        for h in self.hooks:
            saved_hook = saved.get("hooks", {}).get(h.name)
            if saved_hook is not None:
                h.load_state_dict(saved_hook)

    def __repr__(self) -> str:
        limit = [
            f"{k}={v}" for k, v in (("max_steps", self.max_steps), ("epochs", self.epochs)) if v
        ]
        status = ", paused" if self._paused is not None else (", done" if self.done else "")
        return (
            f"Loop(step={self.state.step if not self.state.is_consumed else '?'}{status}, "
            f"{', '.join(limit)}, hooks={[h.name for h in self.hooks]}, work_dir={self.work_dir})"
        )

    # ------------------------------------------------------ starting and ending
    def _iterate(self, all_steps: bool) -> Iterator[Event]:
        resumed = self._enter(all_steps)
        source = self._source(resumed)
        gens: list[Iterator[Event]] = []
        signals = self._signals
        signals.holding = True  # signals wait for a safe point while the loop or a hook runs
        try:
            stream = self._start_hooks(source, gens)
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
                self._mirror = None  # closed by the checkpointer: the logs uploaded
                self.checkpointer.close()  # the run's writes are done, its directories unlocked

    def _enter(self, all_steps: bool) -> bool:
        """Before the first event: one iteration at a time, the run's directories locked and,
        on the first start, the resume. Returns whether this continues a started run."""
        if self._running:
            raise RuntimeError("This loop is already being iterated; use one iterator at a time.")
        self._check_not_replaced()
        self._data.check_can_continue()  # a one-shot iterator that lost a batch: refused
        self._running, self._all_steps = True, all_steps
        resumed = self._started
        if not self._started:
            registry.close_paused_in(self.work_dir, self)
        try:
            self._open_run(first=not self._started)
        except BaseException:
            self._running = False
            raise
        self._started = True
        if resumed:
            self.stop_reason = None
        return resumed

    def _directories(self) -> list[Location]:
        """Every directory the run writes to: ``work_dir`` and the hooks' ``output_dirs``."""
        base = self.work_dir
        return [*([] if base is None else [base]),
                *(d.path for h in self.hooks for d in h.output_dirs(base))]  # fmt: skip

    def _check_not_replaced(self) -> None:
        """A newer loop of this process ran in one of this loop's directories since this one
        did (a notebook cell run again): this one may no longer run or write there."""
        where = registry.replaced_in(self)
        if where is not None:
            raise RuntimeError(
                f"This Loop was closed by a newer run in {where} (a Loop built again on that "
                "directory, e.g. a notebook cell run twice): it no longer runs or writes "
                "there, its state is older than that directory's files. Use the newer Loop, "
                "or build a new one with resume='auto' to continue from the newest checkpoint."
            )

    def _open_run(self, first: bool) -> None:
        """Lock every directory the run writes to; on the run's first start, continue from
        the checkpoint ``resume`` names (checked to fit the run before step 1), then delete
        the run's orphans (files a kill left that no manifest lists)."""
        ckpt = self.checkpointer
        dirs = self._directories()
        try:
            holder = None if self.work_dir is None else f"work_dir {self.work_dir}"
            for d in dirs:
                ckpt.lock(d, holder)
            if first:
                self._resume()
            self._open_mirror()
        except BaseException:
            ckpt.close()
            raise
        registry.claim(self, dirs)

    def _open_mirror(self) -> None:
        """For a ``work_dir`` on a store: the local copy of its log files (downloaded) that
        hooks write to, uploaded by the checkpointer after each commit and at the end."""
        if not isinstance(self.work_dir, StoreURL) or self._mirror is not None:
            return
        from ftrain.persist.mirror import LogMirror

        mirror = LogMirror(self.checkpointer.dir(self.work_dir), main=_dist.is_main())
        self.checkpointer.attach_mirror(mirror)  # closed with the checkpointer, even if pull fails
        mirror.pull()
        self._mirror = mirror

    def _resume(self) -> None:
        ckpt, dirs = self.checkpointer, self.hooks.checkpoint_dirs(self.work_dir)
        mode = resume_mode(self.resume, self.work_dir)
        found = find_start(ckpt, dirs, mode)
        if found is not None:
            path, saved = found
            check_fits(self.state, self.batches_per_epoch, saved, str(path))
            self.load(saved, source=str(path))
            self.resumed_from = path
        collect_orphans(dirs, self.run_id)

    def _start_hooks(self, source: Iterator[Event], gens: list[Iterator[Event]]) -> Iterator[Event]:
        """Start each hook in priority order (its set-up runs and RunBegin passes on);
        returns the stream the caller sees."""
        stream = source
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
        return stream

    def _stopped_hook(self, gens: list[Iterator[Event]]) -> None:
        """The stream ended before ``RunEnd``: a hook stopped passing events on. Name it."""
        names = [h.name for h in self.hooks]  # (with no hook the stream always ends in RunEnd)
        i = next((i for i, g in enumerate(gens) if getattr(g, "gi_frame", 0) is None), 0)
        later = ", ".join(names[i + 1 :]) or "none"
        raise RuntimeError(
            f"Hook {names[i]!r} stopped passing events on (at step {self.state.step}): the hooks "
            f"after it ({later}) and the caller saw nothing from then on, checkpoints included. "
            "A hook must yield every event it receives (`for ev in events: ...; yield ev`)."
        )

    # ------------------------------------------------------------- the events
    def _source(self, resumed: bool) -> Iterator[Event]:
        """The events before any hook: the loop itself."""
        signals = self._signals
        signals.install()
        signals.start_voting()  # several processes only
        try:
            yield RunBegin(self, self.state, resumed=resumed)
            signals.raise_pending()
            yield from self._epochs(self._cadences())  # every hook has started (and seen RunBegin)
            if self.step.pending(self.state):
                yield self._flush()
                signals.raise_pending()
            yield RunEnd(self, self.state)
            signals.agree()  # several processes: a signal any rank holds stops them all
            signals.raise_pending()  # a signal held during RunEnd's hooks still stops the caller
        finally:
            signals.stop_voting()
            signals.uninstall()

    def _epochs(self, cadences: list[Every] | None) -> Iterator[Event]:
        """Epochs of steps until the run is done; a pause where ``run(steps=...)`` asks."""
        data, signals, perf = self._data, self._signals, time.perf_counter
        if self._pause_steps is not None:  # run(steps=...): from here (after a resume)
            self._pause_at = self.state.step + self._pause_steps
            self._pause_steps = None
        if data.resume_at_end:  # saved after the epoch's data ran out: end that epoch
            data.resume_at_end = False
            yield from self._end_epoch()
        step_fn = self.step if signals.vote is None else self._voting(self.step)
        last = perf()
        while not self.done:
            if self.state.step >= self._pause_at and not self._epoch_exhausted():
                yield from self._pause()
                last = perf()  # the pause is no step's time
                continue
            if data.it is None:
                yield from self._start_epoch()
                last = perf()
            # The update whose StepEnd is yielded; every StepEnd (-1) on a full stream.
            limit = -1 if cadences is None else self._next_due(cadences, self.state.step)
            ev, last = self._train(data.it, step_fn, limit, last)
            if ev is None:
                yield from self._end_epoch()
                last = perf()
                continue
            yield ev
            signals.raise_pending()

    def _train(
        self, it: Iterator[Any], step_fn: StepFn, limit: int, last: float
    ) -> tuple[StepEnd | None, float]:
        """The hot loop: steps nobody asked for make no event and run no hook. Trains up to
        update ``limit``, a held signal or a stop request (returns that step's ``StepEnd``)
        or the data's end (``None``); sums and the position are locals until it returns."""
        signals, totals, data, perf = self._signals, self.totals, self._data, time.perf_counter
        add_metrics = totals.add
        step, position, empty = self.state.step, data.batch, self._empty_batches
        start, updates, data_sum, iter_sum = position, 0, 0.0, 0.0
        t0 = perf()
        try:
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    if position == 0:
                        raise self._no_batch() from None
                    return None, last
                except BaseException:
                    data.failed()  # the batch never reached the step: the position stays
                    raise
                t1 = perf()
                empty(batch, position, self.state.epoch)  # shapes only: no device sync
                try:
                    self.state, metrics = step_fn(self.state, batch)
                    position += 1
                except NonFiniteLossError as exc:
                    if exc.state is not None:
                        self.state = exc.state  # the last good update: hooks may save it
                    raise
                t2 = perf()
                data_time, iter_time = t1 - t0, t2 - last
                data_sum += data_time
                iter_sum += iter_time
                last = t0 = t2
                before, step = step, self.state.step
                updates += step != before
                add_metrics(metrics)
                # held signals (the batch read is trained on) wait for the hooks to see this update
                if step >= limit or signals.pending is not None or self.stop_reason is not None:
                    is_update = step != before
                    ev = StepEnd(self, self.state, metrics, is_update, data_time, iter_time, batch)
                    return ev, last
        finally:
            data.batch = position
            totals.micro_batches += position - start
            totals.updates += updates
            totals.data_time += data_sum
            totals.iter_time += iter_sum

    def _pause(self) -> Iterator[Event]:
        """``run(steps=...)`` is done. While paused the caller owns Ctrl-C (Jupyter resets it
        before each cell)."""
        signals = self._signals
        self._pause_at = _NEVER
        signals.agree()
        signals.raise_pending()
        signals.uninstall()
        try:
            yield Paused(self, self.state)
        finally:
            signals.install()

    def _start_epoch(self) -> Iterator[Event]:
        """``EpochBegin``, then open the data (after the hooks, so a loader shuffling from
        the global RNG draws at the same point in a resumed run)."""
        epoch = self.state.epoch
        self._data.begin(epoch)
        yield EpochBegin(self, self.state, epoch)
        self._data.open()

    def _end_epoch(self) -> Iterator[Event]:
        """Apply a partial window, count the epoch, ``EpochEnd``. Meanwhile a checkpoint
        records ``exhausted``: a run resumed from the flush's ``StepEnd`` ends the epoch."""
        self._data.ran_out()
        if self.step.pending(self.state):
            yield self._flush()
            self._signals.raise_pending()
        epoch = self.state.epoch
        self.state = self.state.replace(epoch=epoch + 1)
        self._data.end()
        yield EpochEnd(self, self.state, epoch)
        self._signals.raise_pending()

    def _flush(self) -> StepEnd:
        # under DDP/FSDP2 the window's micro-batches skipped the all-reduce
        _dist.sync_pending_grads(self.state.model)
        self.state, metrics = self.step.flush(self.state)
        self.totals.micro_batches += 1
        self.totals.updates += 1
        self.totals.add(metrics)
        return StepEnd(self, self.state, metrics, True, 0.0, 0.0, None)

    # -------------------------------------------------------------- internal
    def _cadences(self) -> list[Every] | None:
        """The hooks' cadences, or ``None``: every ``StepEnd`` (you iterate, or a hook needs all)."""
        cadences = [h.cadence for h in self.hooks]
        return None if self._all_steps or any(c.micro_batches for c in cadences) else cadences

    def _next_due(self, cadences: list[Every], step: int) -> int:
        """The first update after ``step`` whose ``StepEnd`` a hook, ``run`` or max_steps needs."""
        dues = (c.next_due(step) for c in cadences)
        return min([self._pause_at, self.max_steps or _NEVER, *(n for n in dues if n is not None)])

    def _epoch_exhausted(self) -> bool:
        """Whether every batch of the current epoch is done (its end is still to come)."""
        n = self.batches_per_epoch  # None: the end shows only when the data runs out
        return self._data.it is not None and n is not None and self._data.batch >= n

    def _voting(self, step: Step) -> StepFn:
        """``step``, then (after an update) every rank's vote on stopping: all ranks read
        the result at the same later update, so all leave the hot loop there."""
        vote = self._signals.vote_after_update

        def voting_step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
            before = state.step
            state, metrics = step(state, batch)
            if state.step != before:
                vote()
            return state, metrics

        return voting_step

    def _no_batch(self) -> ValueError:
        kind = type(self.data).__name__
        return ValueError(
            f"Loop: the data ({kind}) gave no batch in epoch {self.state.epoch}, so the run "
            "cannot make progress. A one-shot iterator (a generator) is empty after its first "
            "pass: pass something that can be read again each epoch (a list, a DataLoader, an "
            "object whose __iter__ makes a new generator), or stop within one pass (max_steps=). "
            "An empty DataLoader: check the dataset's length, batch_size and drop_last."
        )
