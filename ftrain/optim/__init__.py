"""Optimizer helpers.

>>> import torch
>>> from ftrain.optim import param_groups
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
>>> opt = torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.05, norm_decay_mult=0.0))
>>> [g["weight_decay"] for g in opt.param_groups]
[0.05, 0.0]
"""

from ftrain._moved import moved
from ftrain.optim.groups import param_groups

__all__ = ["param_groups"]

# Names ftrain.optim exported before issue 21: what param_groups matches by.
_MOVED = {"NORM_LAYERS": "ftrain.optim.groups", "CUSTOM_KEY_FIELDS": "ftrain.optim.groups"}


def __getattr__(name: str):
    raise moved("ftrain.optim", name, _MOVED)
