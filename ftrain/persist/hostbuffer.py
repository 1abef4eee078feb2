"""One host allocation holding a checkpoint's copy of many tensors: pinned for GPU tensors, reused.

Pinning tensor by tensor goes through PyTorch's pinned caching allocator, which rounds every
request up to a power of two (up to 2x the bytes) and keeps the blocks for the whole run. A
:class:`HostBuffer` maps one anonymous region of the bytes needed (rounded to a page), pins
it once (``cudaHostRegister``, when the tensors are on a GPU) and hands out one view per
tensor. Each view has its own storage of exactly the tensor's bytes inside that region, so
``torch.save`` and DCP write each tensor's bytes and nothing else. The next save of tensors
of the same dtypes, shapes and strides gets the same views back: no allocation.
"""

from __future__ import annotations

import math
import mmap
import warnings
import weakref
from collections.abc import Callable, Sequence

import attrs
import torch

__all__ = ["HostBuffer", "Pin", "cuda_pin", "dense_stride", "MAX_SLACK"]

#: ``(address, nbytes) -> unpin``: lock host memory for asynchronous device copies.
Pin = Callable[[int, int], Callable[[], None]]

#: A buffer is reused while it holds at most this many times the bytes needed.
MAX_SLACK = 1.25


def cuda_pin(address: int, nbytes: int) -> Callable[[], None]:
    """Page-lock ``nbytes`` at ``address`` for the CUDA driver; returns the unpin call."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(address, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {err}")
    return lambda: cudart.cudaHostUnregister(address)


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when its elements fill a block without gaps or overlaps (any order of
    dimensions: channels-last, transposed), else the contiguous ones.

    Example:
        >>> dense_stride(torch.ones(2, 3).t()), dense_stride(torch.ones(4, 4)[:, :2])
        ((1, 3), (2, 1))
    """
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return torch.empty(t.shape, device="meta").stride()
        expected *= size
    return tuple(t.stride())


@attrs.frozen
class _Slot:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int


def _layout(keys: Sequence[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], bool]]):
    """Slots for ``keys`` (dtype, shape, strides, on a GPU; in their order) packed without
    padding: widest items first, so every offset is a multiple of its item size; and the
    bytes they take."""
    slots: list[_Slot | None] = [None] * len(keys)
    offset = 0
    order = sorted(range(len(keys)), key=lambda i: -keys[i][0].itemsize)
    for i in order:
        dtype, shape, stride, _ = keys[i]
        numel = math.prod(shape)
        slots[i] = _Slot(offset, dtype, shape, stride, numel)
        offset += numel * dtype.itemsize
    return slots, offset


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what a mapping of them holds)."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class HostBuffer:
    """Views into one host allocation for copies of ``tensors``; reused while they match.

    ``pin``: ``"auto"`` pins with CUDA for copies of GPU tensors (a CPU model's copy is not
    pinned, and CUDA is not initialised for it); ``None`` never; or a :data:`Pin` function,
    always used. ``capacity`` is the bytes held (whole pages; kept while at most
    :data:`MAX_SLACK` times the pages needed), ``allocations`` how many allocations it
    made, ``pinned`` whether the current one is page-locked.

    Example:
        >>> buf = HostBuffer()
        >>> a = buf.views([torch.ones(3), torch.zeros(2, dtype=torch.int64)])
        >>> b = buf.views([torch.ones(3), torch.zeros(2, dtype=torch.int64)])
        >>> a is b, buf.allocations, [tuple(v.shape) for v in a]
        (True, 1, [(3,), (2,)])
    """

    def __init__(self, pin: Pin | str | None = "auto") -> None:
        if isinstance(pin, str) and pin != "auto":
            raise ValueError(f"HostBuffer: pin must be 'auto', None or a function, got {pin!r}")
        self._pin = pin
        self.capacity = 0
        self.allocations = 0
        self.pinned = False
        self._map: mmap.mmap | None = None
        self._unpin: weakref.finalize | None = None
        self._key: tuple | None = None
        self._views: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return (
            f"HostBuffer(capacity={self.capacity}, allocations={self.allocations}, "
            f"pinned={self.pinned})"
        )

    @property
    def current(self) -> list[torch.Tensor]:
        """The views handed out last (``[]`` once released)."""
        return list(self._views)

    @property
    def nbytes(self) -> int:
        """The bytes the current views take (at most ``capacity``)."""
        return sum(v.numel() * v.element_size() for v in self._views)

    def views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One host tensor per tensor of ``tensors`` (same dtype, shape and, when dense,
        strides), all in one allocation; the same ones as last time when they match."""
        key = tuple((t.dtype, tuple(t.shape), dense_stride(t), t.is_cuda) for t in tensors)
        if key == self._key:
            return self._views
        slots, total = _layout(key)
        need = _pages(total)
        pin = self._pinner(any(k[3] for k in key))
        if not need <= self.capacity <= MAX_SLACK * need or (pin is not None and not self.pinned):
            self._allocate(need, pin)
        self._views = [self._view(s) for s in slots]
        self._key = key
        return self._views

    def release(self) -> None:
        """Unpin and drop the allocation (freed once no view of it is left)."""
        if self._unpin is not None:
            self._unpin()
        self._map, self._unpin, self._key, self._views = None, None, None, []
        self.capacity, self.pinned = 0, False

    def _pinner(self, device_sources: bool) -> Pin | None:
        if self._pin == "auto":
            return cuda_pin if device_sources and torch.cuda.is_available() else None
        return self._pin  # type: ignore[return-value]

    def _allocate(self, nbytes: int, pin: Pin | None) -> None:
        self.release()
        if nbytes == 0:
            return
        region = mmap.mmap(-1, nbytes)  # page-aligned, pages filled on first write
        self._map, self.capacity = region, nbytes
        self.allocations += 1
        if pin is None:
            return
        address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
        try:
            unpin = pin(address, len(region))
        except RuntimeError as exc:  # locked-memory limit, no driver: copies stay synchronous
            warnings.warn(f"Checkpoint host buffer not pinned ({exc}).", stacklevel=4)
            return
        self.pinned = True
        # unpinned before the region can be unmapped: at release(), or when this buffer goes
        self._unpin = weakref.finalize(self, unpin)

    def _view(self, s: _Slot) -> torch.Tensor:
        if s.numel == 0:
            return torch.empty_strided(s.shape, s.stride, dtype=s.dtype)
        flat = torch.frombuffer(self._map, dtype=s.dtype, count=s.numel, offset=s.offset)
        return flat.as_strided(s.shape, s.stride)
