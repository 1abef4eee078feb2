"""Memory: activation accounting, activation checkpointing plans, efficient conv-bn eval."""

from ftrain.memory import cuda_peak
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
from ftrain.memory.dynamic_plan import (
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
    "ActivationAccountant", "ActivationReport", "ModuleStats", "measure_activations",
    "tensor_bytes", "CheckpointSwitch", "checkpoint_call", "restore_running_stats",
    "EfficientConvBN", "efficient_conv_bn_eval", "efficient_conv_bn_eval_forward",
    "find_conv_bn_pairs", "DynamicPlannerState", "PlanSession", "plan_session", "choose_modules",
    "fit_poly", "poly_eval", "DEFAULT_SAVE_OPS", "DynamicPlan", "ModulesPlan", "PatternPlan",
    "SelectivePlan", "as_plan", "dynamic", "modules", "pattern", "resolve_plan", "selective",
    "cuda_peak"
]  # fmt: skip
