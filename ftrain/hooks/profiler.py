"""The profiler hook: ``torch.profiler`` over a window of optimizer updates.

:class:`ProfilerHook` starts :class:`torch.profiler.profile` when the run
reaches update ``start`` and steps its schedule (``wait``, ``warmup``,
``active``, ``repeat``: :func:`torch.profiler.schedule`) once per optimizer
update, so the traced updates are chosen by their number. Each ``active``
phase is written by :func:`torch.profiler.tensorboard_trace_handler` as a
Chrome trace, ``<out_dir>/rank<r>.<time>.pt.trace.json`` (one file per
rank and cycle), which both TensorBoard's profiler plugin
(``pip install torch-tb-profiler``; ``tensorboard --logdir <work_dir>``: the
run ``profile``) and Perfetto (https://ui.perfetto.dev, "Open trace file")
open.

Outside its window the hook asks for no events (no per-step cost); inside
it, it sees every update's ``StepEnd``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ftrain import dist as _dist
from ftrain.events import Event, RunEnd, StepEnd

__all__ = ["ProfilerHook"]


def _whole(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"ProfilerHook: {what} must be a whole number >= {minimum}, got {value!r}."
        )
    return value



@contextlib.contextmanager
def _quiet_cycles() -> Iterator[None]:
    """Silence torch's note that each profiling cycle is reported on its own (by design,
    with ``repeat > 1``: one file per cycle), for this call only (no global filter)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "Warning: Profiler clears events at the end of each cycle"
        )
        yield

class ProfilerHook:
    """Profile updates ``start + wait + warmup`` ... with ``torch.profiler``; write Chrome traces.

    The profiler starts right after update ``start - 1`` (at the run's start
    when it is already there), then follows ``torch.profiler.schedule(wait,
    warmup, active, repeat)``, one schedule step per optimizer update: with
    the defaults, updates ``start + 2`` to ``start + 4`` are traced. With
    gradient accumulation every micro-batch of a traced update is in it.
    A run that resumes past the window does not profile.

    Args:
        start: the first update of the window (counted like ``state.step``:
            the first update is 1).
        wait: schedule steps (updates) skipped at the window's start.
        warmup: updates profiled but not recorded (the profiler warms up).
        active: updates recorded in each cycle.
        repeat: cycles (``0``: cycle until the run ends).
        out_dir: where traces go; default ``work_dir/profile``.
        activities: ``torch.profiler.ProfilerActivity`` values; default CPU,
            plus CUDA when the model is on CUDA.
        record_shapes: passed to :class:`torch.profiler.profile` (input shapes).
        profile_memory: passed to the profiler (tensor allocations).
        with_stack: passed to the profiler (Python stacks).
        with_flops: passed to the profiler (FLOP estimates of some ops).
        use_gzip: write ``.pt.trace.json.gz`` (both viewers read it).

    Under ``torch.distributed`` every rank profiles the same updates and
    writes its own files (``rank<r>.`` ...).

    Example:
        >>> ProfilerHook(start=10, active=5)
        ProfilerHook(start=10, wait=1, warmup=1, active=5, repeat=1, out_dir=None)
    """

    priority = "VERY_HIGH"  # the traced span holds the other hooks' work too
    name = "profiler"

    def __init__(
        self,
        start: int = 1,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        out_dir: str | os.PathLike | None = None,
        activities: Sequence[Any] | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        use_gzip: bool = False,
    ) -> None:
        self.start = _whole(start, "start", 1)
        self.wait = _whole(wait, "wait", 0)
        self.warmup = _whole(warmup, "warmup", 0)
        self.active = _whole(active, "active", 1)
        self.repeat = _whole(repeat, "repeat", 0)
        self.out_dir = out_dir
        self.activities = None if activities is None else list(activities)
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.with_flops = with_flops
        self.use_gzip = use_gzip
        self._profiler: Any = None
        self._steps = 0  # schedule steps taken
        self._done = False
        #: The trace files written (this process), in order.
        self.traces: list[Path] = []

    def __repr__(self) -> str:
        return (
            f"ProfilerHook(start={self.start}, wait={self.wait}, warmup={self.warmup}, "
            f"active={self.active}, repeat={self.repeat}, out_dir={self.out_dir!r})"
        )

    @property
    def window(self) -> int | None:
        """Schedule steps in the whole window (``None``: until the run ends)."""
        return (self.wait + self.warmup + self.active) * self.repeat if self.repeat else None

    def next_step(self, step: int) -> int | None:
        """Before the window: update ``start - 1``; inside it: every update; after: none."""
        if self._done:
            return None
        if self._profiler is None:
            return self.start - 1 if self.start - 1 > step else step + 1
        return step + 1

    def _directory(self, loop: Any) -> Path:
        if self.out_dir is not None:
            path = Path(self.out_dir)
            if not path.is_absolute() and loop.work_dir is not None:
                path = Path(loop.work_dir) / path
            return path
        if loop.work_dir is None:
            raise ValueError(
                "ProfilerHook needs a directory for its traces: pass work_dir= to "
                "ftrain.loop/fit, or out_dir= to the hook."
            )
        return Path(loop.work_dir) / "profile"

    def _begin(self, loop: Any, directory: Path) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = self.activities
        if activities is None:
            activities = [ProfilerActivity.CPU]
            model = getattr(loop.state, "model", None)
            on_cuda = model is not None and any(p.is_cuda for p in model.parameters())
            if on_cuda:
                activities.append(ProfilerActivity.CUDA)
        directory.mkdir(parents=True, exist_ok=True)
        worker = f"rank{_dist.rank()}_{socket.gethostname()}"
        handler = torch.profiler.tensorboard_trace_handler(
            str(directory), worker_name=worker, use_gzip=self.use_gzip
        )

        def on_trace_ready(prof: Any) -> None:
            before = set(directory.iterdir())
            handler(prof)
            self.traces.extend(
                sorted(
                    p
                    for p in set(directory.iterdir()) - before
                    if p.name.startswith(worker + ".") and p.name.endswith((".json", ".json.gz"))
                )
            )

        self._profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
        )
        with _quiet_cycles():
            self._profiler.start()
        self._steps = 0

    def _end(self) -> None:
        prof, self._profiler = self._profiler, None
        self._done = True
        if prof is not None:
            prof.stop()

    def __call__(self, events: Iterator[Event]) -> Iterator[Event]:
        first = next(events)  # RunBegin
        loop = first.loop
        directory = self._directory(loop)
        self._done = False
        self.traces = []
        step0 = first.state.step
        window = self.window
        if window is not None and step0 >= self.start - 1 + window:
            self._done = True  # resumed past the window
        elif step0 >= self.start - 1:
            self._begin(loop, directory)
        try:
            yield first
            for ev in events:
                if type(ev) is StepEnd and ev.is_update and not self._done:
                    if self._profiler is None:
                        if ev.state.step >= self.start - 1:
                            self._begin(loop, directory)
                    else:
                        with _quiet_cycles():  # a new cycle starts inside step()
                            self._profiler.step()
                        self._steps += 1
                        if window is not None and self._steps >= window:
                            self._end()
                elif type(ev) is RunEnd and self._profiler is not None:
                    self._end()  # a cycle cut short by the run's end is written too
                yield ev
        finally:
            if self._profiler is not None:
                self._end()
