"""Memory: activation accounting, activation checkpointing plans, efficient conv-bn eval.

What a user calls: :func:`measure_activations` (an :class:`ActivationReport`), the plans
:func:`modules`, :func:`pattern`, :func:`selective` and :func:`dynamic` (with its
:class:`DynamicPlannerState`) for ``ftrain.with_activation_checkpoint``,
:func:`efficient_conv_bn_eval`; peak CUDA memory: the module :mod:`ftrain.memory.cuda_peak`.
The planner's parts stay in their modules (:mod:`ftrain.memory.plans`, :mod:`ftrain.memory.dynamic_plan`,
:mod:`ftrain.memory.accounting`, :mod:`ftrain.memory.apply`, :mod:`ftrain.memory.conv_bn`).
"""

from ftrain._moved import moved
from ftrain.memory import cuda_peak  # noqa: F401  (a submodule: ftrain.memory.cuda_peak)
from ftrain.memory.accounting import ActivationReport, measure_activations
from ftrain.memory.conv_bn import efficient_conv_bn_eval
from ftrain.memory.dynamic_plan import DynamicPlannerState
from ftrain.memory.plans import dynamic, modules, pattern, selective

__all__ = [
    "measure_activations", "ActivationReport", "modules", "pattern", "selective", "dynamic",
    "DynamicPlannerState", "efficient_conv_bn_eval",
]  # fmt: skip

# Names ftrain.memory exported before issue 21: the planner's and the accountant's parts.
_MOVED = {
    **dict.fromkeys(
        ["ActivationAccountant", "ModuleStats", "tensor_bytes"], "ftrain.memory.accounting"
    ),
    **dict.fromkeys(
        ["CheckpointSwitch", "checkpoint_call", "restore_running_stats"], "ftrain.memory.apply"
    ),
    **dict.fromkeys(
        ["EfficientConvBN", "efficient_conv_bn_eval_forward", "find_conv_bn_pairs"],
        "ftrain.memory.conv_bn",
    ),
    **dict.fromkeys(
        ["PlanSession", "plan_session", "choose_modules", "fit_poly", "poly_eval"],
        "ftrain.memory.dynamic_plan",
    ),
    **dict.fromkeys(
        ["DEFAULT_SAVE_OPS", "DynamicPlan", "ModulesPlan", "PatternPlan", "SelectivePlan",
         "as_plan", "resolve_plan"],
        "ftrain.memory.plans",
    ),
}  # fmt: skip


def __getattr__(name: str):
    raise moved("ftrain.memory", name, _MOVED)
