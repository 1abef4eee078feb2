"""Throughput, model FLOP utilisation and memory, computed at log time only.

:class:`~ftrain.hooks.logging.LoggerHook` adds these from what the loop
counts anyway (``loop.totals``) and from the allocator's counters:

* ``perf/samples_per_s``, ``perf/tokens_per_s``: micro-batches x samples (tokens)
  per micro-batch / seconds (a metric's name, e.g. ``mask.sum()`` from your
  ``loss_fn``, counts every micro-batch exactly; a function of a batch sees the
  interval's last batch).
* ``perf/tflops``, ``perf/mfu``: FLOP/s, and that over the peak (:data:`PEAK_FLOPS`).
* ``memory/max_allocated_mib``, ``memory/max_reserved_mib`` (CUDA),
  ``memory/rss_peak_mib`` (the process's peak resident memory).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ftrain.run import Run

__all__ = ["Throughput", "count_flops", "peak_flops_for", "memory_stats", "PEAK_FLOPS"]

#: Dense bf16/fp16 tensor-core peak FLOP/s of known GPUs (vendor data sheets), matched
#: against ``torch.cuda.get_device_name()`` in this order.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.1e12),
    ("L4", 121.0e12),
    ("V100", 125.0e12),
)

_MIB = float(2**20)


def peak_flops_for(device_name: str) -> float | None:
    """The table's peak FLOP/s for a GPU name, or ``None`` when it is not listed.

    Example:
        >>> peak_flops_for("NVIDIA H100 80GB HBM3"), peak_flops_for("NVIDIA A100-SXM4-40GB")
        (989400000000000.0, 312000000000000.0)
        >>> peak_flops_for("cpu") is None
        True
    """
    for key, value in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def memory_stats(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory in MiB: CUDA's allocated and reserved (on CUDA) and the RSS; no sync.

    Example:
        >>> stats = memory_stats("cpu")
        >>> list(stats), stats["memory/rss_peak_mib"] > 0
        (['memory/rss_peak_mib'], True)
    """
    out: dict[str, float] = {}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        out["memory/max_allocated_mib"] = torch.cuda.max_memory_allocated(dev) / _MIB
        out["memory/max_reserved_mib"] = torch.cuda.max_memory_reserved(dev) / _MIB
    with contextlib.suppress(ImportError):  # no resource module on Windows
        import resource

        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # Linux: KiB
        out["memory/rss_peak_mib"] = (peak if sys.platform == "darwin" else peak * 1024) / _MIB
    return out


def first_dim(batch: Any) -> int | None:
    """The first dimension of the first tensor in a batch (tuples, lists, dicts), or ``None``.

    Example:
        >>> import torch
        >>> first_dim((torch.zeros(8, 3), torch.zeros(8))), first_dim({"x": [torch.zeros(5)]})
        (8, 5)
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return next((n for n in map(first_dim, batch) if n is not None), None)
    return None


def count_flops(loss_fn: Callable[[Any, Any], Any], model: torch.nn.Module, batch: Any) -> int:
    """Model FLOPs of one training micro-batch: ``loss_fn``'s forward and the weights' backward.

    Counted by :class:`torch.utils.flop_counter.FlopCounterMode` with
    ``torch.autograd.grad``: ``.grad``, the RNG and the buffers are left as they were.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(32, 16, bias=False)
        >>> count_flops(lambda m, b: m(b).sum(), m, torch.ones(8, 32)) == 2 * (2 * 8 * 32 * 16)
        True
    """
    from torch.utils.flop_counter import FlopCounterMode

    module = getattr(model, "module", model)  # DDP: the wrapped module (no collectives)
    params = [p for p in module.parameters() if p.requires_grad]
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    counter = FlopCounterMode(display=False)
    try:
        with torch.random.fork_rng(devices=devices), counter:
            out = loss_fn(module, batch)
            loss = out[0] if isinstance(out, (tuple, list)) else out
            if params and isinstance(loss, torch.Tensor) and loss.requires_grad:
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                saved = buffers.get(name)
                if saved is not None and saved.shape == b.shape:
                    b.copy_(saved)
    return int(counter.get_total_flops())


class Throughput:
    """What the logger measures besides the step's metrics (see :mod:`ftrain.hooks.monitor`).

    Args:
        batch_size: samples per micro-batch: an int, a function of a batch, a
            metric's name, ``None`` (inferred: :func:`first_dim`) or ``False`` (none).
        tokens: tokens per micro-batch: a function of a batch, a metric's name or
            an int; ``None``: no ``perf/tokens_per_s``.
        flops: FLOPs per micro-batch (forward and backward), ``"auto"`` or ``None``.
        peak_flops: the device's peak FLOP/s (``None``: :data:`PEAK_FLOPS`).
        memory: log the ``memory/*`` peaks.

    Example:
        >>> t = Throughput(batch_size=32, flops=1e9, peak_flops=1e12)
        >>> t.rates(micro_batches=10, seconds=2.0, batch=None, means={})
        {'perf/samples_per_s': 160.0, 'perf/tflops': 0.005, 'perf/mfu': 0.005}
    """

    def __init__(
        self,
        *,
        batch_size: int | str | Callable[[Any], int] | bool | None = None,
        tokens: int | str | Callable[[Any], int] | None = None,
        flops: float | str | None = None,
        peak_flops: float | None = None,
        memory: bool = True,
    ) -> None:
        for arg, value in (("batch_size", batch_size), ("tokens", tokens)):
            if value is True or not (
                value is None or value is False or isinstance(value, (int, str)) or callable(value)
            ):
                raise TypeError(
                    f"Throughput: {arg} must be a number, a metric's name or a function of a "
                    f"batch, got {value!r}."
                )
        if tokens is False:
            tokens = None
        if not (flops is None or flops == "auto" or isinstance(flops, (int, float))):
            raise TypeError(
                f"Throughput: flops must be FLOPs per micro-batch (a number), 'auto' or None, "
                f"got {flops!r}."
            )
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ValueError(
                f"Throughput: peak_flops must be the device's peak FLOP/s (> 0), got "
                f"{peak_flops!r}."
            )
        self.batch_size = batch_size
        self.tokens = tokens
        self.flops = flops
        self.peak_flops = peak_flops
        self.memory = memory
        self._batch_size: float | None = None
        self._flops: float | None = None if isinstance(flops, str) else flops
        self._peak: float | None = peak_flops

    def __repr__(self) -> str:
        return (
            f"Throughput(batch_size={self.batch_size!r}, tokens={self.tokens!r}, "
            f"flops={self.flops!r}, peak_flops={self.peak_flops!r}, memory={self.memory})"
        )

    @property
    def needs_batch(self) -> bool:
        """Whether a batch is still needed (to infer a size, apply a function, count FLOPs)."""
        return (
            (self.batch_size is None and self._batch_size is None)
            or callable(self.batch_size)
            or callable(self.tokens)
            or (self.flops == "auto" and self._flops is None)
        )

    # ------------------------------------------------------------ counts
    @staticmethod
    def _per_batch(spec: Any, batch: Any, means: Mapping[str, float]) -> float | None:
        if spec is None or spec is False:
            return None
        if isinstance(spec, str):
            return means.get(spec)
        if isinstance(spec, (int, float)):
            return float(spec)
        if batch is None:
            return None
        value = spec(batch)
        if isinstance(value, torch.Tensor):
            value = value.item()  # a function of the batch, once per log
        return float(value)

    def samples_per_batch(self, batch: Any, means: Mapping[str, float]) -> float | None:
        """Samples in one micro-batch (cached when inferred from a batch's shape)."""
        if self.batch_size is None:
            if self._batch_size is None and batch is not None:
                n = first_dim(batch)
                self._batch_size = None if n is None else float(n)
            return self._batch_size
        return self._per_batch(self.batch_size, batch, means)

    def prepare(self, loop: Run, batch: Any) -> None:
        """Count the model's FLOPs (``flops="auto"``) and find the peak, once per run."""
        state = loop.state
        if self.flops == "auto" and self._flops is None and batch is not None:
            with contextlib.suppress(Exception):  # a consumed state (a failed step)
                self._flops = float(count_flops(loop.step.loss_fn, state.model, batch))
        if self._peak is None and self._flops is not None and torch.cuda.is_available():
            device = model_device(state)
            if device is not None and device.type == "cuda":
                self._peak = peak_flops_for(torch.cuda.get_device_name(device))

    def rates(
        self, *, micro_batches: int, seconds: float, batch: Any, means: Mapping[str, float]
    ) -> dict[str, float]:
        """The ``perf/*`` tags for an interval of ``micro_batches`` taking ``seconds``."""
        out: dict[str, float] = {}
        if micro_batches <= 0 or not seconds > 0:
            return out
        per_s = micro_batches / seconds
        samples = self.samples_per_batch(batch, means)
        if samples is not None and math.isfinite(samples):
            out["perf/samples_per_s"] = samples * per_s
        tokens = self._per_batch(self.tokens, batch, means)
        if tokens is not None and math.isfinite(tokens):
            out["perf/tokens_per_s"] = tokens * per_s
        if self._flops is not None:
            achieved = self._flops * per_s
            out["perf/tflops"] = achieved / 1e12
            if self._peak:
                out["perf/mfu"] = achieved / self._peak
        return out


def model_device(state: Any) -> torch.device | None:
    """The device of the model's first parameter (``None`` without parameters)."""
    with contextlib.suppress(Exception):  # a consumed state
        return next(p.device for p in state.model.parameters())
    return None
