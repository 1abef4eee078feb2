"""The background writer: one checkpoint write at a time, off the training thread.

Training blocks only while the state is copied to host memory; the write, ``fsync``,
rename and manifest update run on a thread that ends with the job. One save is in
flight at most (host memory holds one snapshot); a failure is raised at the next
check, submit or wait.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ftrain.errors import CheckpointError

__all__ = ["AsyncWriter", "to_host", "wait_for_writes"]

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


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    try:
        return torch.empty_like(t, device="cpu", pin_memory=True)
    except RuntimeError:  # no pinned memory (no CUDA driver)
        return torch.empty_like(t, device="cpu")


def to_host(obj: Any, pool: list[torch.Tensor] | None = None) -> Any:
    """A copy of a nested dict/list/tuple's tensors in (pinned) host memory; the rest shared.

    ``pool``: the previous snapshot's host buffers, reused where the tensors
    match (filling mapped memory is several times faster than fresh pages);
    pass it only once that snapshot is written. Views become separate copies.

    Example:
        >>> import torch
        >>> x = torch.ones(2); y = to_host({"x": x}); x += 1
        >>> y["x"].tolist()
        [1.0, 1.0]
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def buffer(x: torch.Tensor) -> torch.Tensor:
        i = len(copies)  # <= len(pool): each call fills or appends one slot
        old = pool[i] if pool is not None and i < len(pool) else None
        if old is not None and old.shape == x.shape and old.dtype == x.dtype:
            if old.stride() == x.stride():
                return old
        out = torch.empty_like(x) if x.device.type == "cpu" else _pinned_like(x)
        if pool is not None:
            pool[i : i + 1] = [out]
        return out

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            out = buffer(x)
            copies.append((out, x))
            return out
        if isinstance(x, dict):
            d = {k: walk(v) for k, v in x.items()}
            if isinstance(x, OrderedDict):  # a module's state dict: keep its _metadata
                d = OrderedDict(d)
                if hasattr(x, "_metadata"):
                    d._metadata = x._metadata  # type: ignore[attr-defined]
            return d
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(walk(v) for v in x)
        return x

    out = walk(obj)
    if pool is not None:
        del pool[len(copies) :]
    for dst, src in copies:
        dst.copy_(src, non_blocking=src.device.type == "cuda" and dst.is_pinned())
    if any(src.device.type == "cuda" for _, src in copies):
        torch.cuda.synchronize()  # the pinned copies are done before the writer reads them
    return out
