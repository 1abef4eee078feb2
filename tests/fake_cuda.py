"""A fake CUDA caching allocator on the CPU, for the planner's CUDA paths without a GPU.

:class:`FakeAllocator` is a ``TorchDispatchMode``: every storage an op creates (not a view
or an in-place result of an input) counts as allocated until it dies (a storage weak
reference), so ``allocated`` is the bytes of the live tensors made inside the mode, as
``torch.cuda.memory_allocated`` would be for a model on a GPU. ``reserved`` is the
high-water mark of ``fragmentation`` times ``allocated`` and never shrinks (until
:meth:`empty_cache`), like a caching allocator that cannot reuse all its blocks.
:func:`install` points ``torch.cuda``'s memory counters at it.
"""

from __future__ import annotations

import math

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FakeAllocator(TorchDispatchMode):
    def __init__(self, fragmentation: float = 1.0) -> None:
        super().__init__()
        self.fragmentation = fragmentation
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.reserved = 0
        self.peak = 0
        self.peak_reserved = 0
        self.resets = 0

    @property
    def allocated(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def _update(self) -> None:
        self.reserved = max(self.reserved, math.ceil(self.allocated * self.fragmentation))
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            held = self.live.get(ptr)
            if ptr and ptr not in inputs and (held is None or held[0].expired()):
                self.live[ptr] = (StorageWeakRef(s), s.nbytes())
        self._update()
        return out

    def reset_peak(self) -> None:
        self.resets += 1
        self.peak = self.allocated
        self.peak_reserved = self.reserved

    def empty_cache(self) -> None:
        self.reserved = self.allocated
        self.peak_reserved = max(self.peak_reserved, self.reserved)


def install(monkeypatch, alloc: FakeAllocator, *, available: bool = False) -> None:
    """Point ``torch.cuda``'s memory counters (device 0) at ``alloc``."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: alloc.allocated)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: alloc.reserved)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: alloc.peak)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: alloc.peak_reserved)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: alloc.reset_peak())
    if available:
        monkeypatch.setattr(cuda, "is_available", lambda: True)
