"""CUDA's peak-memory counters, shared between ftrain's measurements and everyone else.

The dynamic planner resets CUDA's peak counters at each warm-up sample (so an earlier,
higher peak cannot hide the sample's). Resetting through :func:`reset_peak_memory_stats`
first folds the peaks so far into a running maximum that ftrain keeps per device, and
:func:`max_memory_allocated` / :func:`max_memory_reserved` report the larger of that and
CUDA's counter: the peak since the process started (or since :func:`clear_peaks`), as
if nothing had been reset. The logger's ``memory/max_*_mib`` read these. Code that reads
``torch.cuda.max_memory_allocated`` directly sees the peak since the last reset.

Example:
    >>> import torch
    >>> from ftrain.memory import cuda_peak
    >>> peak = cuda_peak.max_memory_allocated() if torch.cuda.is_available() else 0
    >>> peak >= 0
    True
"""

from __future__ import annotations

import torch

__all__ = ["reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved", "clear_peaks"]

#: device index -> (allocated, reserved): the peaks folded in before ftrain's resets
_FOLDED: dict[int, tuple[int, int]] = {}

Device = torch.device | str | int | None


def _index(device: Device) -> int:
    """The CUDA device index (``None``: the current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    return torch.cuda.current_device() if dev.index is None else dev.index


def reset_peak_memory_stats(device: Device = None) -> None:
    """Reset CUDA's peak counters on ``device``, keeping the peaks so far in ftrain's maximum."""
    i = _index(device)
    held = _FOLDED.get(i, (0, 0))
    _FOLDED[i] = (
        max(held[0], int(torch.cuda.max_memory_allocated(device))),
        max(held[1], int(torch.cuda.max_memory_reserved(device))),
    )
    torch.cuda.reset_peak_memory_stats(device)


def max_memory_allocated(device: Device = None) -> int:
    """Peak bytes allocated on ``device``, across ftrain's resets."""
    held = _FOLDED.get(_index(device), (0, 0))[0]
    return max(held, int(torch.cuda.max_memory_allocated(device)))


def max_memory_reserved(device: Device = None) -> int:
    """Peak bytes reserved by the caching allocator on ``device``, across ftrain's resets."""
    held = _FOLDED.get(_index(device), (0, 0))[1]
    return max(held, int(torch.cuda.max_memory_reserved(device)))


def clear_peaks(device: Device = None) -> None:
    """Forget the running maximum and reset CUDA's counters: a fresh peak from now on."""
    _FOLDED.pop(_index(device), None)
    torch.cuda.reset_peak_memory_stats(device)
