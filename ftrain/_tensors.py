"""Tensors that may be sharded: a DTensor's local shard (used by the transforms and the saver).

Example:
    >>> import torch
    >>> from ftrain._tensors import local_tensor
    >>> t = torch.ones(2)
    >>> local_tensor(t) is t
    True
"""

from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the tensor), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
