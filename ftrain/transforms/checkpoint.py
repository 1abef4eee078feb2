"""Renamed: activation checkpointing lives in :mod:`ftrain.transforms.remat`.

"checkpoint" in ftrain means saving (:mod:`ftrain.checkpoint`); recomputing activations in
the backward pass is ``remat``.
"""

raise ImportError(
    "ftrain.transforms.checkpoint was renamed: use ftrain.transforms.remat "
    "(from ftrain.transforms.remat import with_activation_checkpoint, or ftrain.with_activation_checkpoint)"
)
