"""The machine a benchmark ran on, and the device it ran on.

Example:
    >>> resolve_device("cpu")
    device(type='cpu')
    >>> env = environment(torch.device("cpu"))
    >>> sorted(k for k in env if k in ("torch", "device", "threads", "ftrain"))
    ['device', 'ftrain', 'threads', 'torch']
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BenchError", "resolve_device", "environment", "numerics", "process_seconds"]


class BenchError(ValueError):
    """A bad benchmark setting; the CLI prints its message and exits with status 2."""


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Example:
        >>> resolve_device("auto").type in ("cpu", "cuda")
        True
        >>> resolve_device("tpu")
        Traceback (most recent call last):
        ...
        ftrain.bench.env.BenchError: --device 'tpu' is not understood; use auto, cpu, cuda or cuda:N
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = (
                "this torch build has no CUDA support (torch " + torch.__version__ + ")"
                if build is None
                else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
            )
            raise BenchError(
                f"--device {spec}: CUDA is not available: {why}. "
                "Use --device cpu (or --device auto, which falls back to the CPU)."
            )
        dev = torch.device(spec)
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise BenchError(
                f"--device {spec}: there are {count} CUDA device(s), cuda:0 to cuda:{count - 1}."
            )
        return dev
    raise BenchError(f"--device {spec!r} is not understood; use auto, cpu, cuda or cuda:N")


def environment(device: torch.device, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the figures depend on: versions, platform, device, threads, dtype, ``args``.

    Example:
        >>> environment(torch.device("cpu"), {"quick": True})["args"]
        {'quick': True}
    """
    import ftrain

    env: dict[str, Any] = {
        "ftrain": ftrain.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
        ),
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    env["numerics"] = numerics()
    if args is not None:
        env["args"] = dict(args)
    return env


def numerics() -> dict[str, Any]:
    """The settings that change GPU speed and rounding: TF32, matmul precision, cuDNN.

    Example:
        >>> n = numerics()
        >>> n["cuda_matmul_allow_tf32"] == torch.backends.cuda.matmul.allow_tf32
        True
    """
    cudnn = torch.backends.cudnn
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision": bool(
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda_matmul_allow_bf16_reduced_precision": bool(
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "cudnn_available": bool(cudnn.is_available()),
        "cudnn_version": cudnn.version() if cudnn.is_available() else None,
        "cudnn_enabled": bool(cudnn.enabled),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def process_seconds() -> float | None:
    """Wall seconds since this process started (Linux ``/proc``; ``None`` elsewhere): what a
    command costs including the interpreter's start and its imports.

    Example:
        >>> s = process_seconds()
        >>> s is None or s > 0
        True
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None
