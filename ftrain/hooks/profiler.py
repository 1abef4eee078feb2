"""The profiler hook: ``torch.profiler`` over a window of optimizer updates.

Each ``active`` phase is written by :func:`torch.profiler.tensorboard_trace_handler`
as a Chrome trace, ``<out_dir>/rank<r>_<host>.<time>.pt.trace.json`` (one file
per rank and cycle), which TensorBoard's profiler plugin (``pip install
torch-tb-profiler``) and Perfetto (https://ui.perfetto.dev) open.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ftrain import dist as _dist
from ftrain._checks import flag, whole
from ftrain.events import Event, RunEnd, StepEnd
from ftrain.hooks.cadence import Every

if TYPE_CHECKING:
    from ftrain.run import Run

__all__ = ["ProfilerHook"]


@contextlib.contextmanager
def _quiet_cycles() -> Iterator[None]:
    """Silence torch's note that each cycle is reported on its own (one file per cycle is
    the design), for this call only (no process-wide filter)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning: Profiler clears events at the end of each")
        yield


class ProfilerHook:
    """Profile updates ``start + wait + warmup`` ... with ``torch.profiler``; write Chrome traces.

    The profiler starts right after update ``start - 1`` (``start`` counts like
    ``state.step``), then follows ``torch.profiler.schedule(wait, warmup, active, repeat)``,
    one schedule step per optimizer update (``repeat=0``: until the run ends). A run resumed
    past the window does not profile. ``out_dir`` defaults to ``work_dir/profile``;
    ``activities`` to CPU, plus CUDA for a model on CUDA; the other flags go to
    :class:`torch.profiler.profile`; ``use_gzip`` writes ``.json.gz``.

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
        self.start = whole("ProfilerHook: start", start, 1)
        self.wait = whole("ProfilerHook: wait", wait, 0)
        self.warmup = whole("ProfilerHook: warmup", warmup, 0)
        self.active = whole("ProfilerHook: active", active, 1)
        self.repeat = whole("ProfilerHook: repeat", repeat, 0)
        for arg, on in (("record_shapes", record_shapes), ("profile_memory", profile_memory),
                        ("with_stack", with_stack), ("with_flops", with_flops),
                        ("use_gzip", use_gzip)):  # fmt: skip
            flag(f"ProfilerHook: {arg}", on)
        self.out_dir, self.use_gzip = out_dir, use_gzip
        self.activities = None if activities is None else list(activities)
        self.record_shapes, self.profile_memory = record_shapes, profile_memory
        self.with_stack, self.with_flops = with_stack, with_flops
        window = self.window  # the updates of the window, or all from start - 1 (repeat=0)
        first = max(start - 1, 1)
        self.cadence = Every(steps=1) if window is None else Every(at=range(first, start + window))
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

    def _directory(self, loop: Run) -> Path:
        if self.out_dir is not None:
            path = Path(self.out_dir)
            if not path.is_absolute() and loop.log_dir is not None:
                path = Path(loop.log_dir) / path
            return path
        if loop.log_dir is None:
            raise ValueError(
                "ProfilerHook needs a directory for its traces: pass work_dir= to "
                "ftrain.Loop, or out_dir= to the hook."
            )
        return Path(loop.log_dir) / "profile"

    def _begin(self, loop: Run, directory: Path) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = self.activities
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if any(p.is_cuda for p in loop.state.model.parameters()):
                activities.append(ProfilerActivity.CUDA)
        directory.mkdir(parents=True, exist_ok=True)
        worker = f"rank{_dist.rank()}_{socket.gethostname()}"
        handler = torch.profiler.tensorboard_trace_handler(
            str(directory), worker_name=worker, use_gzip=self.use_gzip
        )

        def on_trace_ready(prof: Any) -> None:
            before = set(directory.iterdir())
            handler(prof)
            new = set(directory.glob(f"{worker}.*.json*")) - before
            self.traces.extend(sorted(p for p in new if p.name.endswith((".json", ".json.gz"))))

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
        step0, window = first.state.step, self.window
        last = None if window is None else self.start - 1 + window  # the window's last update
        if last is not None and step0 >= last:
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
                        if last is not None and (self._steps >= window or ev.state.step >= last):
                            self._end()  # (resumed inside the window: its end, by number)
                elif type(ev) is RunEnd and self._profiler is not None:
                    self._end()  # a cycle cut short by the run's end is written too
                yield ev
        finally:
            if self._profiler is not None:
                self._end()
