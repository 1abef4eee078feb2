"""Warnings ftrain's users cannot act on, filtered narrowly at import: torchdata's
``StatefulDataLoader`` (0.8 - 0.11) calls ``torch.set_vital`` (deprecated in torch >= 2.6)
in its constructor; only that call's warning, from torchdata's modules, is muted.
"""

from __future__ import annotations

import warnings

__all__ = ["install"]


def install() -> None:
    """Add the filters (idempotent: ``warnings.filterwarnings`` drops duplicates)."""
    warnings.filterwarnings(
        "ignore",
        message="'set_vital' is deprecated",
        category=UserWarning,
        module=r"torchdata\.",
    )
