"""Memory: activation accounting, activation checkpointing plans, efficient conv-bn eval.

* :mod:`~ftrain.memory.accounting` — :func:`measure_activations`: bytes saved
  for backward, deduplicated, per module, with forward times.
* :mod:`~ftrain.memory.apply` — :class:`CheckpointSwitch`: checkpoint modules
  per call without renaming parameters, BatchNorm-safe.
* :mod:`~ftrain.memory.plans` — :func:`modules`, :func:`pattern`,
  :func:`selective`, :func:`dynamic`.
* :mod:`~ftrain.memory.dynamic` — the dynamic planner and its state.
* :mod:`~ftrain.memory.conv_bn` — :func:`efficient_conv_bn_eval`.

The step transforms are :func:`ftrain.transforms.checkpoint.with_activation_checkpoint`
and :func:`ftrain.transforms.conv_bn.with_efficient_conv_bn_eval`.
"""

from ftrain.memory.accounting import (
    ActivationAccountant,
    ActivationReport,
    ModuleStats,
    measure_activations,
    tensor_bytes,
)
from ftrain.memory.apply import CheckpointSwitch, checkpoint_call, restore_running_stats
from ftrain.memory.conv_bn import (
    EfficientConvBN,
    efficient_conv_bn_eval,
    efficient_conv_bn_eval_forward,
    find_conv_bn_pairs,
)
from ftrain.memory.dynamic import (
    DynamicPlannerState,
    PlanSession,
    choose_modules,
    fit_poly,
    plan_session,
    poly_eval,
)
from ftrain.memory.plans import (
    DEFAULT_SAVE_OPS,
    DynamicPlan,
    ModulesPlan,
    PatternPlan,
    SelectivePlan,
    as_plan,
    dynamic,
    modules,
    pattern,
    resolve_plan,
    selective,
)

__all__ = [
    "ActivationAccountant",
    "ActivationReport",
    "ModuleStats",
    "measure_activations",
    "tensor_bytes",
    "CheckpointSwitch",
    "checkpoint_call",
    "restore_running_stats",
    "EfficientConvBN",
    "efficient_conv_bn_eval",
    "efficient_conv_bn_eval_forward",
    "find_conv_bn_pairs",
    "DynamicPlannerState",
    "PlanSession",
    "plan_session",
    "choose_modules",
    "fit_poly",
    "poly_eval",
    "DEFAULT_SAVE_OPS",
    "DynamicPlan",
    "ModulesPlan",
    "PatternPlan",
    "SelectivePlan",
    "as_plan",
    "dynamic",
    "modules",
    "pattern",
    "resolve_plan",
    "selective",
]
