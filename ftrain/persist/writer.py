"""The background writer: one checkpoint write at a time, off the training thread.

Training blocks only while the state's copy to host memory is queued: host tensors are
copied at once, device tensors asynchronously into one pinned allocation
(:class:`~ftrain.persist.hostbuffer.HostBuffer`), and the writer thread waits for the
event recorded after those copies (not for the whole device) before the write, ``fsync``,
rename and manifest update. One save is in flight at most (host memory holds one
snapshot, reused by the next); a failure is raised at the next check, submit or wait.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ftrain.errors import CheckpointError
from ftrain.persist.hostbuffer import HostBuffer

__all__ = [
    "AsyncWriter", "HostCopy", "copy_to_host", "to_host", "record_copies", "wait_for_writes"
]  # fmt: skip

_LIVE: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()


class AsyncWriter:
    """Runs write jobs one at a time on a short-lived thread; remembers a failure.

    Example:
        >>> w = AsyncWriter()
        >>> w.submit(lambda: None)
        >>> w.wait()
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._on_error: Callable[[BaseException], BaseException] | None = None
        _LIVE.add(self)

    @property
    def busy(self) -> bool:
        """Whether a job is running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self,
        job: Callable[[], Any],
        on_error: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        """Run ``job()`` once the previous job ended (raising its failure, if any)."""
        self.wait()
        self._on_error = on_error

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # kept for the training thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="ftrain-checkpoint", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the failure of a finished job (without waiting for a running one)."""
        if self.busy:
            return
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            self._raise(error)

    def wait(self) -> None:
        """Wait for the running job; raise its failure."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self.check()

    def _raise(self, error: BaseException) -> None:
        if self._on_error is not None:
            converted = self._on_error(error)
            if converted is not error:
                raise converted from error
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(
            f"A background checkpoint write failed ({type(error).__name__}: {error}). The "
            "checkpoints written before it are intact; fix the cause and resume from the newest."
        ) from error


def wait_for_writes() -> None:
    """Wait for every background checkpoint write of this process.

    Example:
        >>> wait_for_writes()
    """
    for writer in list(_LIVE):
        writer.wait()


def record_copies(sources: Sequence[torch.Tensor]) -> list[Any]:
    """One CUDA event per device among ``sources``, recorded on its current stream after the
    copies queued there (none for host tensors): what the writer waits for before it reads."""
    devices = {t.device for t in sources if t.device.type == "cuda"}
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


@attrs.frozen
class HostCopy:
    """A copy in host memory (:func:`copy_to_host`): ``value`` is safe to read once
    :meth:`wait` returned (it waits for the events recorded after the device copies, not
    for the whole device)."""

    value: Any
    events: tuple[Any, ...] = ()

    def wait(self) -> Any:
        """Wait for the copies; return ``value``."""
        for event in self.events:
            event.synchronize()
        return self.value


def _rebuild(x: Any, leaf: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x``'s dicts, lists and tuples rebuilt with ``leaf(t)`` for each tensor ``t``."""
    if isinstance(x, torch.Tensor):
        return leaf(x)
    if isinstance(x, dict):
        d = {k: _rebuild(v, leaf) for k, v in x.items()}
        if isinstance(x, OrderedDict):  # a module's state dict: keep its _metadata
            d = OrderedDict(d)
            if hasattr(x, "_metadata"):
                d._metadata = x._metadata  # type: ignore[attr-defined]
        return d
    if isinstance(x, list):
        return [_rebuild(v, leaf) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_rebuild(v, leaf) for v in x)
    return x


def copy_to_host(obj: Any, buffer: HostBuffer | None = None) -> HostCopy:
    """Queue a copy of a nested dict/list/tuple's tensors into ``buffer`` (one host allocation,
    pinned for GPU tensors; its views are reused by the next copy of the same tensors); the
    rest is shared. Host tensors are copied now; device tensors asynchronously on their
    current stream (so later work there cannot change them first), with an event recorded
    after them for :meth:`HostCopy.wait`. Views become separate copies.

    Example:
        >>> import torch
        >>> x = torch.ones(2); host = copy_to_host({"x": x}); x += 1
        >>> host.wait()["x"].tolist()
        [1.0, 1.0]
    """
    sources: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        sources.append(t.detach())
        return t

    _rebuild(obj, collect)
    buffer = HostBuffer() if buffer is None else buffer
    dst = buffer.views(sources)
    views = iter(dst)
    out = _rebuild(obj, lambda _: next(views))
    for d, s in zip(dst, sources, strict=True):
        d.copy_(s, non_blocking=buffer.pinned and s.device.type == "cuda")
    return HostCopy(out, tuple(record_copies(sources)))


def to_host(obj: Any, buffer: HostBuffer | None = None) -> Any:
    """:func:`copy_to_host`, waited for: a copy of ``obj``'s tensors in host memory.

    Example:
        >>> import torch
        >>> x = torch.ones(2); y = to_host({"x": x}); x += 1
        >>> y["x"].tolist()
        [1.0, 1.0]
    """
    return copy_to_host(obj, buffer).wait()
