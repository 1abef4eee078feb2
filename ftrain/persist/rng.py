"""Random generator states: Python, NumPy, torch CPU, and CUDA per device.

One process saves every visible CUDA device's generator; under
``torch.distributed`` each rank saves its own device's and restores it into
its ``LOCAL_RANK``'s. States that cannot be restored are named in a warning.
"""

from __future__ import annotations

import random
import sys
import warnings
from array import array
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def capture_rng() -> dict[str, Any]:
    """The states of every random generator a run draws from (Mersenne Twisters as bytes).

    Example:
        >>> import random
        >>> saved = capture_rng(); a = random.random()
        >>> restore_rng(saved); random.random() == a
        True
    """
    version, words, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": (version, array("Q", words).tobytes(), gauss),
        "torch": torch.get_rng_state(),
    }
    if _cuda_ready():
        if _distributed():
            device = torch.cuda.current_device()
            out["cuda_device"] = {"index": device, "state": torch.cuda.get_rng_state(device)}
        else:
            out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = (kind, keys.astype("<u4").tobytes(), int(pos), int(has_gauss), float(cached))
    return out


def restore_rng(saved: Mapping[str, Any], *, local_rank: int | None = None) -> None:
    """Restore :func:`capture_rng`'s states; a rank's CUDA state goes to ``local_rank``'s device."""
    if "python" in saved:
        version, words, gauss = saved["python"]
        if isinstance(words, bytes):
            words = tuple(array("Q", words))
        random.setstate((version, tuple(words), gauss))
    if "torch" in saved:
        torch.set_rng_state(saved["torch"])
    _restore_cuda(saved, local_rank)
    if "numpy" in saved:
        import numpy as np

        state = saved["numpy"]
        if isinstance(state[1], bytes):
            kind, keys, pos, has_gauss, cached = state
            state = (kind, np.frombuffer(keys, dtype="<u4").copy(), pos, has_gauss, cached)
        np.random.set_state(state)


def _restore_cuda(saved: Mapping[str, Any], local_rank: int | None) -> None:
    if "cuda" not in saved and "cuda_device" not in saved:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "cuda_device" in saved:  # one device's state (a rank of a distributed run)
        if local_rank is None:
            import os

            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if available == 0:
            warnings.warn(
                f"The CUDA generator state of device {saved['cuda_device']['index']} is not "
                "restored: no CUDA device here. CUDA random numbers (dropout on GPU) differ "
                "from the saved run.",
                stacklevel=3,
            )
            return
        device = local_rank % available
        torch.cuda.set_rng_state(saved["cuda_device"]["state"], device)
        return
    states = list(saved["cuda"])
    n = min(len(states), available)
    for i in range(n):
        torch.cuda.set_rng_state(states[i], i)
    if len(states) != available:
        if len(states) > available:
            what = f"the states of devices {list(range(n, len(states)))} are not restored"
        else:
            what = f"devices {list(range(n, available))} keep their current states"
        warnings.warn(
            f"The checkpoint holds CUDA generator states for {len(states)} device(s), and "
            f"{available} are visible: {what}. Resume with the same visible devices "
            "(CUDA_VISIBLE_DEVICES) for exact CUDA random numbers.",
            stacklevel=3,
        )
