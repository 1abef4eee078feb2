"""Transforms: each takes a step and returns a step with more behaviour.

The order of composition does not change training: every transform acts at
its phase (see :mod:`ftrain.transforms.base`).
"""

from ftrain.transforms.accum import with_grad_accum
from ftrain.transforms.amp import with_amp
from ftrain.transforms.base import Transform
from ftrain.transforms.clip import with_clip
from ftrain.transforms.compile import with_compile
from ftrain.transforms.nonfinite import with_nonfinite_check
from ftrain.transforms.unused import find_unused_parameters, with_unused_check

__all__ = [
    "Transform",
    "with_amp",
    "with_grad_accum",
    "with_clip",
    "with_compile",
    "with_nonfinite_check",
    "with_unused_check",
    "find_unused_parameters",
]
