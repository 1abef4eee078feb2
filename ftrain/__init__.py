"""ftrain: functional, compositional training for PyTorch.

>>> import torch, ftrain
>>> model = torch.nn.Linear(3, 1)
>>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
>>> step = ftrain.with_clip(ftrain.make_step(lambda m, b: m(b).pow(2).mean()), "norm", max_norm=1.0)
>>> state, metrics = step(state, torch.ones(4, 3))
>>> state.step
1

``import ftrain`` loads what it exports at the top: the state, the step and its
transforms, the loop with its events and built-in hooks, and the two edges the loop
saves and scales out with, ``ftrain.persist`` and ``ftrain.dist``. Everything else
loads on first use: ``with_schedule``/``with_ema`` and ``ftrain.schedules``, the
memory planner (``with_activation_checkpoint``, ``ftrain.memory``), ``ftrain.optim``,
the learning-rate finder ``lr_find``, the optional hooks (``EvalHook``,
``ProfilerHook``...), ``ftrain.checkpoint``, ``ftrain.bench`` and ``ftrain.demo``; so do
the optional trackers (TensorBoard, MLflow, W&B). ``tests/test_api.py`` pins this list.
"""

from ftrain import _warnings, events
from ftrain import hooks as _hooks
from ftrain.errors import CheckpointError, NonFiniteLossError, StaleStateError
from ftrain.hooks import (
    AutoCheckpointHook,
    BestCheckpointHook,
    CheckpointHook,
    Every,
    Hook,
    Hooks,
    LoggerHook,
    TimerHook,
    default_hooks,
    every,
    hook,
    on,
    once,
    resolve_hooks,
)
from ftrain.loop import PREEMPTED_EXIT_CODE, Loop, TerminatedError
from ftrain.loss import SummedLoss
from ftrain.state import TrainState
from ftrain.step import Step, StepContext, make_step
from ftrain.transforms import (
    Transform,
    find_unused_parameters,
    with_amp,
    with_clip,
    with_compile,
    with_grad_accum,
    with_nonfinite_check,
    with_unused_check,
)

__version__ = "0.2.0"

# Imported on first use (PEP 562): see the module docstring for what loads when.
_LAZY = {
    "with_activation_checkpoint": "ftrain.transforms.remat",
    "with_efficient_conv_bn_eval": "ftrain.transforms.conv_bn",
    "param_groups": "ftrain.optim",
    "with_schedule": "ftrain.transforms.schedule",
    "with_ema": "ftrain.transforms.ema",
    "lr_find": "ftrain.lr_finder",
    **_hooks.LAZY,  # EvalHook, ... (ftrain.hooks loads them lazily)
}
_LAZY_MODULES = ("memory", "schedules", "optim", "checkpoint", "demo", "bench")


# Removed in 0.2 (one way for each thing): what to use instead.
_REMOVED = {
    "fit": "ftrain.Loop(step, state, data, ...).run()",
    "ScheduleHook": "the step transform ftrain.with_schedule(step, lr=...)",
    "EMAHook": "the step transform ftrain.with_ema(step, decay=...)",
    "InvalidLossHook": "the step transform ftrain.with_nonfinite_check(step)",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"ftrain.{name}")
    elif name in _REMOVED:
        raise AttributeError(f"ftrain.{name} was removed in ftrain 0.2: use {_REMOVED[name]}.")
    else:
        raise AttributeError(f"module 'ftrain' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


__all__ = [
    "events",
    "Loop",
    "PREEMPTED_EXIT_CODE",
    "TerminatedError",
    "Hook",
    "Hooks",
    "hook",
    "every",
    "Every",
    "once",
    "on",
    "resolve_hooks",
    "default_hooks",
    "CheckpointHook",
    "BestCheckpointHook",
    "AutoCheckpointHook",
    "LoggerHook",
    "TimerHook",
    "TrainState",
    "Step",
    "StepContext",
    "make_step",
    "SummedLoss",
    "Transform",
    "with_amp",
    "with_grad_accum",
    "with_clip",
    "with_compile",
    "with_nonfinite_check",
    "with_unused_check",
    "find_unused_parameters",
    "with_activation_checkpoint",
    "with_efficient_conv_bn_eval",
    "with_schedule",
    "with_ema",
    "param_groups",
    "lr_find",
    "EvalHook",
    "EmptyCacheHook",
    "EarlyStoppingHook",
    "ProfilerHook",
    "memory",
    "schedules",
    "dist",
    "StaleStateError",
    "NonFiniteLossError",
    "CheckpointError",
]

_warnings.install()  # torchdata's set_vital deprecation (see ftrain._warnings)
