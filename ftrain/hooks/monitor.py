"""Throughput, model FLOP utilisation and memory, computed at log time only.

:class:`~ftrain.hooks.logging.LoggerHook` adds these from what the loop
counts anyway (``loop.totals``) and from the allocator's counters:

* ``perf/samples_per_s``, ``perf/tokens_per_s``: micro-batches x samples (tokens)
  per micro-batch / seconds (a metric's name, e.g. ``mask.sum()`` from your
  ``loss_fn``, counts every micro-batch exactly; a function of a batch sees the
  interval's last batch).
* ``perf/tflops``, ``perf/mfu``: FLOP/s, and that over the device's dense peak for the
  run's compute dtype (:data:`PEAK_FLOPS`, :func:`peak_flops_for`).
* ``memory/max_allocated_mib``, ``memory/max_reserved_mib`` (CUDA),
  ``memory/rss_peak_mib`` (the process's peak resident memory).
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ftrain import dist
from ftrain._checks import flag, number, whole

if TYPE_CHECKING:
    from ftrain.run import Run
    from ftrain.step import Step

__all__ = [
    "Throughput", "count_flops", "peak_flops_for", "memory_stats", "PEAK_FLOPS", "DevicePeak",
    "compute_dtype", "device_peak"
]  # fmt: skip


@attrs.frozen
class DevicePeak:
    """A GPU's dense peak FLOP/s per compute dtype (``None``: not supported).

    ``pattern`` is a regular expression matched against the lower-cased
    ``torch.cuda.get_device_name()``; ``tf32`` ``None`` means the device has no TF32 (an
    fp32 run then uses ``fp32``).
    """

    name: str
    pattern: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float


# Dense (not sparse) tensor-core figures from the vendor data sheets. Where a data sheet
# gives only the 2:4-sparsity figure (marked "*"), the dense one is half of it.
#: Known GPUs, matched in this order by :func:`device_peak`.
PEAK_FLOPS: tuple[DevicePeak, ...] = (
    # NVIDIA H200 NVL data sheet (2024): FP32 60 TF, TF32 835*, BF16/FP16 1,671*
    DevicePeak("H200 NVL", r"\bh200\b.*\bnvl\b", 835.5e12, 835.5e12, 417.5e12, 60e12),
    # NVIDIA H200 data sheet (2024): SXM FP32 67 TF, TF32 989*, BF16/FP16 1,979*; the same
    # GH100 SXM5 as H100 SXM: 989.4 / 494.7 / 66.9 TF dense (H100 whitepaper, 2022)
    DevicePeak("H200 SXM", r"\bh200\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12),
    # NVIDIA H100 NVL product brief (2023): FP32 60 TF, TF32 835*, BF16/FP16 1,671*
    DevicePeak("H100 NVL", r"\bh100\b.*\bnvl\b", 835.5e12, 835.5e12, 417.5e12, 60e12),
    # NVIDIA H100 whitepaper (2022), H100 PCIe: BF16/FP16 756 / 1,513*, TF32 378 / 756*,
    # FP32 51.2 TF ("H100 PCIe", "H100 80GB HBM2e")
    DevicePeak("H100 PCIe", r"\bh100\b.*(\bpcie\b|\bhbm2e\b)", 756e12, 756e12, 378e12, 51.2e12),
    # NVIDIA H100 whitepaper (2022), H100 SXM5: BF16/FP16 989.4 / 1,978.9*, TF32 494.7 /
    # 989.4*, FP32 66.9 TF ("H100 80GB HBM3")
    DevicePeak("H100 SXM", r"\bh100\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12),
    # NVIDIA H800 PCIe data sheet (2023): FP32 51 TF, TF32 756*, BF16/FP16 1,513* (H100 PCIe's)
    DevicePeak("H800 PCIe", r"\bh800\b.*\bpcie\b", 756e12, 756e12, 378e12, 51.2e12),
    # NVIDIA H800 SXM5 data sheet (2023): FP32 67 TF, TF32 989*, BF16/FP16 1,979* (H100 SXM's)
    DevicePeak("H800 SXM", r"\bh800\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12),
    # NVIDIA H20 product brief (2023): FP32 44 TF, TF32 74, BF16/FP16 148 (dense)
    DevicePeak("H20", r"\bh20\b", 148e12, 148e12, 74e12, 44e12),
    # NVIDIA A100 data sheet (2021), SXM4 and PCIe alike: FP32 19.5 TF, TF32 156 / 312*,
    # BF16/FP16 312 / 624*
    DevicePeak("A100", r"\ba100\b", 312e12, 312e12, 156e12, 19.5e12),
    # NVIDIA A800 40GB/80GB PCIe data sheet (2022): as the A100
    DevicePeak("A800", r"\ba800\b", 312e12, 312e12, 156e12, 19.5e12),
    # NVIDIA A10 data sheet (2021): FP32 31.2 TF, TF32 62.5 / 125*, BF16/FP16 125 / 250*;
    # the A10G (AWS) has no NVIDIA data sheet: the A10's figures
    DevicePeak("A10G", r"\ba10g\b", 125e12, 125e12, 62.5e12, 31.2e12),
    DevicePeak("A10", r"\ba10\b", 125e12, 125e12, 62.5e12, 31.2e12),
    # NVIDIA L40S data sheet (2023): FP32 91.6 TF, TF32 183 / 366*, BF16/FP16 362.05 / 733*
    DevicePeak("L40S", r"\bl40s\b", 362.05e12, 362.05e12, 183e12, 91.6e12),
    # NVIDIA L40 data sheet (2022): FP32 90.5 TF, TF32 90.5 / 181*, BF16/FP16 181.05 / 362.1*
    DevicePeak("L40", r"\bl40\b", 181.05e12, 181.05e12, 90.5e12, 90.5e12),
    # NVIDIA L4 data sheet (2023): FP32 30.3 TF, TF32 120*, BF16/FP16 242*
    DevicePeak("L4", r"\bl4\b", 121e12, 121e12, 60e12, 30.3e12),
    # NVIDIA HGX B200 data sheet (2024), per GPU (an eighth of HGX B200): FP32 75 TF,
    # TF32 2.25 PF*, BF16/FP16 4.5 PF*
    DevicePeak("B200", r"\bb200\b", 2.25e15, 2.25e15, 1.125e15, 75e12),
    # NVIDIA V100 data sheet (2020): SXM2 FP32 15.7 TF, FP16 tensor 125; PCIe 14 / 112;
    # no bf16 tensor cores, no TF32
    DevicePeak("V100 PCIe", r"\bv100\b.*\bpcie\b", None, 112e12, None, 14e12),
    DevicePeak("V100 SXM2", r"\bv100\b", None, 125e12, None, 15.7e12),
)

_MIB = float(2**20)
_DTYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32",
}  # fmt: skip


def _dtype_key(dtype: torch.dtype | str) -> str:
    key = _DTYPES.get(dtype)
    if key is None:
        raise ValueError(
            f"compute dtype must be torch.bfloat16, torch.float16, torch.float32 or one of "
            f"'bf16', 'fp16', 'tf32', 'fp32'; got {dtype!r}."
        )
    return key


def device_peak(device_name: str) -> DevicePeak | None:
    """The :data:`PEAK_FLOPS` entry of a GPU name, or ``None`` when it is not listed.

    Example:
        >>> device_peak("NVIDIA H100 NVL").name, device_peak("NVIDIA L40").name
        ('H100 NVL', 'L40')
        >>> device_peak("NVIDIA GeForce RTX 3090") is None
        True
    """
    name = device_name.lower()
    return next((p for p in PEAK_FLOPS if re.search(p.pattern, name)), None)


def peak_flops_for(device_name: str, dtype: torch.dtype | str = torch.bfloat16) -> float | None:
    """A GPU's dense peak FLOP/s for a compute dtype, or ``None`` when not known.

    ``dtype``: ``torch.bfloat16``/``"bf16"``, ``torch.float16``/``"fp16"``, ``"tf32"``
    (float32 matmuls on TF32 tensor cores) or ``torch.float32``/``"fp32"``.

    Example:
        >>> peak_flops_for("NVIDIA H100 80GB HBM3"), peak_flops_for("NVIDIA A100-SXM4-40GB")
        (989400000000000.0, 312000000000000.0)
        >>> peak_flops_for("NVIDIA H100 80GB HBM3", dtype=torch.float32)
        66900000000000.0
        >>> peak_flops_for("cpu") is None
        True
    """
    key = _dtype_key(dtype)
    peak = device_peak(device_name)
    if peak is None:
        return None
    if key == "tf32" and peak.tf32 is None:
        key = "fp32"  # no TF32 units: float32 matmuls run at the fp32 rate
    return getattr(peak, key)


def compute_dtype(step: Step | None, model: torch.nn.Module) -> str:
    """The dtype the step computes in: its ``with_amp`` dtype, else the parameters'
    (``"tf32"`` for float32 with TF32 matmuls enabled: ``torch.get_float32_matmul_precision()``
    not ``"highest"``).

    Example:
        >>> import torch, ftrain
        >>> step = ftrain.with_amp(ftrain.make_step(lambda m, b: m(b).sum()), dtype="bf16")
        >>> compute_dtype(step, torch.nn.Linear(2, 2)), compute_dtype(None, torch.nn.Linear(2, 2))
        ('bf16', 'fp32')
    """
    from ftrain.transforms.amp import Amp

    for t in step.transforms if step is not None else ():
        if isinstance(t, Amp):
            return _dtype_key(t.dtype)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    key = _DTYPES.get(dtype, "fp32")
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return key


def memory_stats(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory in MiB: CUDA's allocated and reserved (on CUDA) and the RSS; no sync.

    The CUDA peaks are the process's, across the resets of ftrain's own measurements
    (:mod:`ftrain.memory.cuda_peak`).

    Example:
        >>> stats = memory_stats("cpu")
        >>> list(stats), stats["memory/rss_peak_mib"] > 0
        (['memory/rss_peak_mib'], True)
    """
    out: dict[str, float] = {}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        # across the dynamic planner's resets of CUDA's counters (loaded on CUDA only)
        from ftrain.memory import cuda_peak

        out["memory/max_allocated_mib"] = cuda_peak.max_memory_allocated(dev) / _MIB
        out["memory/max_reserved_mib"] = cuda_peak.max_memory_reserved(dev) / _MIB
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


# ------------------------------------------------------------------ FLOPs
class _LossCall(torch.nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap the weights."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)


def _no_collectives() -> Any:
    """A dispatch mode that raises on any collective (c10d) op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
                raise RuntimeError(
                    f"count_flops: the loss function calls the collective {func} (SyncBatchNorm, "
                    "a hand-written all_reduce...); FLOPs are counted without collectives: "
                    "pass Throughput(flops=<FLOPs per micro-batch>) instead."
                )
            return func(*args, **(kwargs or {}))

    return NoCollectives()


def _batch_device(batch: Any) -> torch.device:
    from torch.utils._pytree import tree_leaves

    leaf = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
    return torch.device("cpu") if leaf is None else leaf.device


def _fake_inputs(mode: Any, module: torch.nn.Module, batch: Any) -> tuple[dict, list, Any]:
    """Fake weights (by ``_LossCall``'s names), the trainable ones, and the fake batch."""
    from torch.utils._pytree import tree_map

    device = _batch_device(batch)
    fake: dict[str, torch.Tensor] = {}
    trainable: list[torch.Tensor] = []
    with mode:
        for name, t in module.named_parameters(prefix="model"):
            where = device if t.device.type == "meta" else t.device
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=where)
            fake[name] = f.requires_grad_(t.requires_grad)
            if t.requires_grad:
                trainable.append(fake[name])
        for name, t in module.named_buffers(prefix="model"):
            where = device if t.device.type == "meta" else t.device
            fake[name] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=where)
    fake_batch = tree_map(
        lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch
    )
    return fake, trainable, fake_batch


def count_flops(loss_fn: Callable[[Any, Any], Any], model: torch.nn.Module, batch: Any) -> int:
    """Model FLOPs of one training micro-batch: ``loss_fn``'s forward and the weights' backward.

    Counted by :class:`torch.utils.flop_counter.FlopCounterMode` on fake tensors
    (``FakeTensorMode``): shapes only, so no real forward or backward, no device memory, and
    the weights, ``.grad``, buffers and RNG are left as they were. DDP is unwrapped; an
    FSDP2 (DTensor) model is counted on :func:`ftrain.dist.meta_copy` (full shapes, no
    gathers); a collective inside ``loss_fn`` is an error. A model on the meta device works.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(32, 16, bias=False)
        >>> count_flops(lambda m, b: m(b).sum(), m, torch.ones(8, 32)) == 2 * (2 * 8 * 32 * 16)
        True
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    module = dist.meta_copy(model) if dist.is_sharded(model) else dist.unwrap(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake, trainable, fake_batch = _fake_inputs(mode, module, batch)
    counter = FlopCounterMode(display=False)
    with mode, counter, _no_collectives():
        out = functional_call(_LossCall(loss_fn, module), fake, (fake_batch,))
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if trainable and isinstance(loss, torch.Tensor) and loss.requires_grad:
            torch.autograd.grad(loss, trainable, allow_unused=True)
    return int(counter.get_total_flops())


# ------------------------------------------------------------- throughput
def _check_throughput_args(
    batch_size: Any, tokens: Any, flops: Any, peak_flops: Any, dtype: Any
) -> None:
    for arg, value in (("batch_size", batch_size), ("tokens", tokens)):
        if value is True or not (
            value is None or value is False or isinstance(value, (int, str)) or callable(value)
        ):
            raise TypeError(
                f"Throughput: {arg} must be a number, a metric's name or a function of a "
                f"batch, got {value!r}."
            )
        if isinstance(value, int) and not isinstance(value, bool):
            whole(f"Throughput: {arg} (per micro-batch)", value, 1)
    if not (flops is None or flops == "auto" or isinstance(flops, (int, float))):
        raise TypeError(
            f"Throughput: flops must be FLOPs per micro-batch (a number), 'auto' or None, "
            f"got {flops!r}."
        )
    if isinstance(flops, (int, float)):
        number("Throughput: flops (per micro-batch)", flops, 0, low_open=True)
    if peak_flops is not None and not (
        isinstance(peak_flops, (int, float)) and 0 < peak_flops < math.inf
    ):
        raise ValueError(
            f"Throughput: peak_flops must be the device's peak FLOP/s (> 0), got {peak_flops!r}."
        )
    if dtype is not None:
        try:
            _dtype_key(dtype)
        except ValueError as e:
            raise ValueError(f"Throughput: dtype: {e}") from None


class Throughput:
    """What the logger measures besides the step's metrics (see :mod:`ftrain.hooks.monitor`).

    Args:
        batch_size: samples per micro-batch: an int, a function of a batch, a
            metric's name, ``None`` (inferred: :func:`first_dim`) or ``False`` (none).
        tokens: tokens per micro-batch: a function of a batch, a metric's name or
            an int; ``None``: no ``perf/tokens_per_s``.
        flops: FLOPs per micro-batch (forward and backward), ``"auto"`` (counted once on
            fake tensors: :func:`count_flops`) or ``None``.
        peak_flops: the device's peak FLOP/s (``None``: :func:`peak_flops_for` the GPU and
            the compute dtype; an unknown device gets no ``perf/mfu`` and one warning).
        dtype: the compute dtype for the peak (``None``: :func:`compute_dtype` of the step).
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
        dtype: torch.dtype | str | None = None,
        memory: bool = True,
    ) -> None:
        _check_throughput_args(batch_size, tokens, flops, peak_flops, dtype)
        flag("Throughput: memory", memory)
        self.batch_size = batch_size
        self.tokens = None if tokens is False else tokens
        self.flops = flops
        self.peak_flops = peak_flops
        self.dtype = dtype
        self.memory = memory
        #: the compute dtype the peak was looked up for ("bf16", "tf32"...), once known
        self.compute_dtype: str | None = None if dtype is None else _dtype_key(dtype)
        self._batch_size: float | None = None
        self._flops: float | None = None if isinstance(flops, str) else flops
        self._peak: float | None = peak_flops
        self._tried_flops = not isinstance(flops, str)
        self._tried_peak = peak_flops is not None

    def __repr__(self) -> str:
        return (
            f"Throughput(batch_size={self.batch_size!r}, tokens={self.tokens!r}, "
            f"flops={self.flops!r}, peak_flops={self.peak_flops!r}, dtype={self.dtype!r}, "
            f"memory={self.memory})"
        )

    @property
    def needs_batch(self) -> bool:
        """Whether a batch is still needed (to infer a size, apply a function, count FLOPs)."""
        return (
            (self.batch_size is None and self._batch_size is None)
            or callable(self.batch_size)
            or callable(self.tokens)
            or not self._tried_flops
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
        """Count the model's FLOPs (``flops="auto"``) and find the peak, once per run.

        A count that fails, or a device without a known peak, gives one warning and no
        ``perf/tflops`` (``perf/mfu``); nothing is retried."""
        state = loop.state
        if not self._tried_flops and batch is not None:
            self._tried_flops = True
            self._flops = _count_or_warn(loop.step.loss_fn, state.model, batch)
        if not self._tried_peak and self._flops is not None:
            self._tried_peak = True
            if self.compute_dtype is None:
                self.compute_dtype = compute_dtype(loop.step, state.model)
            self._peak = _peak_or_warn(model_device(state), self.compute_dtype)

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


def _count_or_warn(loss_fn: Callable[[Any, Any], Any], model: Any, batch: Any) -> float | None:
    try:
        return float(count_flops(loss_fn, model, batch))
    except Exception as e:  # reported once: the run goes on without perf/tflops
        warnings.warn(
            f"Throughput(flops='auto'): counting the FLOPs of a micro-batch failed "
            f"({type(e).__name__}: {e}); perf/tflops and perf/mfu are left out. Pass "
            "Throughput(flops=<FLOPs per micro-batch>).",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _peak_or_warn(device: torch.device | None, dtype: str) -> float | None:
    name = str(device)
    peak = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        peak = peak_flops_for(name, dtype)
    if peak is None:
        warnings.warn(
            f"Throughput: no {dtype} peak FLOP/s known for {name!r}, so no perf/mfu (known: "
            f"{', '.join(p.name for p in PEAK_FLOPS)}). Pass Throughput(peak_flops=...).",
            RuntimeWarning,
            stacklevel=3,
        )
    return peak


def model_device(state: Any) -> torch.device | None:
    """The device of the model's first parameter (``None`` without parameters)."""
    with contextlib.suppress(Exception):  # a consumed state
        return next(p.device for p in state.model.parameters())
    return None
