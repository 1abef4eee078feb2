"""ftrain: functional, compositional training for PyTorch.

>>> import torch, ftrain
>>> model = torch.nn.Linear(3, 1)
>>> state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
>>> step = ftrain.with_clip(ftrain.make_step(lambda m, b: m(b).pow(2).mean()), "norm", max_norm=1.0)
>>> state, metrics = step(state, torch.ones(4, 3))
>>> state.step
1

``ftrain.__all__`` is the convenience subset a training script needs: the state, the step
and the transforms users compose, the loop, the common hooks, the errors users catch and
the namespaces ``ftrain.events``, ``ftrain.schedules``, ``ftrain.memory`` and ``ftrain.dist``.
Every name also lives in its namespace (``ftrain.hooks``, ``ftrain.transforms``,
``ftrain.checkpoint``, ``ftrain.optim``...); a name that left the top level says where
it lives (``ftrain.once`` -> ``ftrain.hooks.once``).

``import ftrain`` loads the state, the step and its transforms, the loop with its events
and built-in hooks (with ``ftrain.metric_names``, the one naming rule for evaluated
metrics), and the two edges the loop saves and scales out with, ``ftrain.persist`` and
``ftrain.dist``. Everything else loads on first use:
``with_schedule``/``with_ema`` and ``ftrain.schedules``, the memory planner
(``with_activation_checkpoint``, ``ftrain.memory``), ``ftrain.optim``, the learning-rate
finder ``lr_find``, the optional hooks (``EvalHook``, ``EarlyStoppingHook``...),
``ftrain.checkpoint``, ``ftrain.bench`` and ``ftrain.demo``; so do the optional trackers
(TensorBoard, MLflow, W&B). ``tests/test_api.py`` pins this list.
"""

from ftrain import _warnings, events
from ftrain._moved import moved
from ftrain.errors import CheckpointError, NonFiniteLossError, StaleStateError
from ftrain.hooks import (
    BestCheckpointHook,
    CheckpointHook,
    Every,
    LoggerHook,
    TimerHook,
    default_hooks,
    every,
    hook,
)
from ftrain.loop import Loop
from ftrain.loss import SummedLoss
from ftrain.state import TrainState
from ftrain.step import make_step
from ftrain.transforms import (
    with_amp,
    with_clip,
    with_compile,
    with_grad_accum,
    with_nonfinite_check,
)

__version__ = "0.3.0"

# Imported on first use (PEP 562): see the module docstring for what loads when.
_LAZY = {
    "with_activation_checkpoint": "ftrain.transforms.remat",
    "param_groups": "ftrain.optim",
    "with_schedule": "ftrain.transforms.schedule",
    "with_ema": "ftrain.transforms.ema",
    "lr_find": "ftrain.lr_finder",
    "EvalHook": "ftrain.hooks.evaluation",
    "EarlyStoppingHook": "ftrain.hooks.misc",
}
_LAZY_MODULES = ("memory", "schedules", "optim", "checkpoint", "demo", "bench")

# Top-level names of ftrain 0.2 that live only in their namespace now (issue 21).
_MOVED = {
    "PREEMPTED_EXIT_CODE": "ftrain.loop",
    "TerminatedError": "ftrain.loop",
    "Hook": "ftrain.hooks",
    "Hooks": "ftrain.hooks.base",
    "AutoCheckpointHook": "ftrain.hooks",
    "once": "ftrain.hooks",
    "on": "ftrain.hooks",
    "resolve_hooks": "ftrain.hooks",
    "EmptyCacheHook": "ftrain.hooks",
    "ProfilerHook": "ftrain.hooks",
    "Step": "ftrain.step",
    "StepContext": "ftrain.step",
    "Transform": "ftrain.transforms",
    "with_unused_check": "ftrain.transforms",
    "find_unused_parameters": "ftrain.transforms",
    "with_efficient_conv_bn_eval": "ftrain.transforms.conv_bn",
}

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
        raise moved("ftrain", name, _MOVED)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


# The convenience subset a training script needs; each name also lives in its namespace.
__all__ = [
    "events",
    "schedules",
    "memory",
    "dist",
    "TrainState",
    "make_step",
    "Loop",
    "with_amp",
    "with_grad_accum",
    "with_clip",
    "with_compile",
    "with_nonfinite_check",
    "with_schedule",
    "with_ema",
    "with_activation_checkpoint",
    "default_hooks",
    "CheckpointHook",
    "BestCheckpointHook",
    "LoggerHook",
    "TimerHook",
    "EvalHook",
    "EarlyStoppingHook",
    "hook",
    "every",
    "Every",
    "param_groups",
    "lr_find",
    "SummedLoss",
    "CheckpointError",
    "NonFiniteLossError",
    "StaleStateError",
]

_warnings.install()  # torchdata's set_vital deprecation (see ftrain._warnings)
