"""The stager of background FSDP2 saves: one pinned host buffer for the run, copies that overlap
the next step.

DCP's default staging for ``async_save`` copies every shard, synchronously, into fresh
pageable memory on every save. :class:`ShardStager` keeps one
:class:`~ftrain.persist.hostbuffer.HostBuffer` for the run (allocated at the first save,
reused by every later one) and copies in two parts:

* tensors only the optimizer update changes (the parameters' shards, the optimizer state):
  on a background thread (CUDA: on a side stream, into the pinned buffer), while the next
  forward and backward run. The step waits for them before its optimizer update changes
  them in place (:func:`ftrain.state.add_reader`);
* everything else (buffers such as BatchNorm statistics, which the next forward changes): at
  once, on the training thread (CUDA: queued on the current stream, ahead of that forward).

:meth:`ShardStager.stage` returns a future of the staged state dict (DTensors whose local
tensors are views of the buffer) for ``dcp.save`` to write.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ftrain.persist.hostbuffer import HostBuffer
from ftrain.persist.writer import record_copies

__all__ = ["ShardStager", "storages", "fence"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (host view, source)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise), detached."""
    to_local = getattr(t, "to_local", None)
    with torch.no_grad():
        return (to_local() if to_local is not None else t).detach()


def storages(tensors: Collection[torch.Tensor]) -> set[int]:
    """The addresses of the storages of ``tensors`` (DTensors: of their local shards).

    Example:
        >>> w = torch.ones(3)
        >>> storages([w]) == {w.untyped_storage().data_ptr()}
        True
    """
    return {_local(t).untyped_storage().data_ptr() for t in tensors}


def _leaves(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _leaves(v, out)


def _rebuild(x: Any, staged: Any) -> Any:
    """``x`` with its tensors replaced, in order, by ``next(staged)``."""
    if isinstance(x, torch.Tensor):
        return next(staged)
    if isinstance(x, dict):
        return {k: _rebuild(v, staged) for k, v in x.items()}
    if isinstance(x, list):
        return [_rebuild(v, staged) for v in x]
    if isinstance(x, tuple):
        return tuple(_rebuild(v, staged) for v in x)
    return x


def _shell(t: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A host tensor standing for ``t`` over ``view``: a DTensor (same mesh, placements and
    global shape) whose local tensor is ``view``, or ``view`` itself."""
    if not hasattr(t, "to_local"):
        return view
    with torch.no_grad():
        shell = torch.empty_like(t.detach(), device="cpu")  # its local tensor is replaced:
        shell.to_local().set_(view)  # the shell holds no memory of its own
    return shell


class ShardStager:
    """Copies a DCP state dict into one reused host buffer, partly in the background.

    ``buffer``: where the copies go (default: a :class:`HostBuffer`, pinned for GPU
    tensors). Stage again only once the previous staged dict has been written.

    Example:
        >>> stager = ShardStager()
        >>> w = torch.ones(3)
        >>> staged = stager.stage({"w": w}, deferred=storages([w])).result()
        >>> w += 1; staged["w"].tolist(), stager.buffer.allocations
        ([1.0, 1.0, 1.0], 1)
        >>> stager.close()
    """

    def __init__(self, buffer: HostBuffer | None = None) -> None:
        self.buffer = HostBuffer() if buffer is None else buffer
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._shells: tuple[tuple, list[torch.Tensor]] = ((), [])
        self._future: concurrent.futures.Future | None = None

    def __repr__(self) -> str:
        return f"ShardStager({self.buffer!r})"

    def stage(
        self, state_dict: dict[str, Any], *, deferred: Collection[int] = ()
    ) -> concurrent.futures.Future:
        """Start copying ``state_dict``; a future of its host copy, done once every copy is.

        ``deferred``: storage addresses (:func:`storages`) of the tensors only the optimizer
        update changes, copied in the background; the rest is copied before this returns.
        """
        tensors: list[torch.Tensor] = []
        _leaves(state_dict, tensors)
        sources = [_local(t) for t in tensors]
        views = self.buffer.views(sources)
        staged = _rebuild(state_dict, iter(self._shells_for(tensors, views)))
        now: list[Pair] = []
        later: list[Pair] = []
        for view, src in zip(views, sources, strict=True):
            (later if src.untyped_storage().data_ptr() in deferred else now).append((view, src))
        self.copy(now)  # what the next forward may change (buffers): before it runs
        ready = record_copies([s for _, s in now + later])  # the device's work so far
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "ftrain-staging")
        self._future = self._pool.submit(self._finish, later, ready, staged)
        return self._future

    def _shells_for(self, tensors: Sequence[torch.Tensor], views: list[torch.Tensor]) -> list:
        key = (*(id(v) for v in views), *(tuple(t.shape) for t in tensors))
        if self._shells[0] != key:
            self._shells = (key, [_shell(t, v) for t, v in zip(tensors, views, strict=True)])
        return self._shells[1]

    def _finish(self, later: list[Pair], ready: list[Any], staged: Any) -> Any:
        """On the staging thread: the deferred copies, then wait for every copy."""
        for event in ready:
            event.synchronize()  # the update that produced the values, and the copies now
        self.run_copies(later)
        return staged

    def copy(self, pairs: Sequence[Pair]) -> None:
        """Copy each source into its view (device sources asynchronously into pinned memory)."""
        pinned = self.buffer.pinned
        for view, src in pairs:
            view.copy_(src, non_blocking=pinned and src.device.type == "cuda")

    def run_copies(self, pairs: Sequence[Pair]) -> None:
        """The background copies (on CUDA: on a side stream, waited for here)."""
        if not any(src.device.type == "cuda" for _, src in pairs):
            self.copy(pairs)
            return
        stream = torch.cuda.Stream(device=next(s for _, s in pairs if s.is_cuda).device)
        with torch.cuda.stream(stream):
            self.copy(pairs)
        stream.synchronize()

    def wait(self) -> None:
        """Wait until the last :meth:`stage` finished copying (its failure is left to the
        writer that reads the future)."""
        if self._future is not None:
            concurrent.futures.wait([self._future])

    def close(self) -> None:
        """Wait for the copies, stop the thread, release the buffer."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._shells = ((), [])
        self._future = None
        self.buffer.release()


def fence(stager: ShardStager, clock: Callable[[], float], add: Callable[[float], None]):
    """A one-shot wait for ``stager``'s copies that reports the seconds it waited to ``add``."""

    def wait() -> None:
        start = clock()
        stager.wait()
        add(clock() - start)

    return wait
