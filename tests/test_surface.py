"""Names and surface (issue 21 item 8): a small public surface, and every name that left a
namespace says where it lives now.

The reference is the data below: the ``__all__`` lists of the nine documented namespaces
before the change (180 names, written out here), checked against the modules as they are.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

NAMESPACES = ("ftrain", "ftrain.schedules", "ftrain.hooks", "ftrain.checkpoint", "ftrain.dist",
              "ftrain.memory", "ftrain.transforms", "ftrain.optim", "ftrain.events")  # fmt: skip

OLD_ALL = {
    "ftrain": """events Loop PREEMPTED_EXIT_CODE TerminatedError Hook Hooks hook every Every once on
        resolve_hooks default_hooks CheckpointHook BestCheckpointHook AutoCheckpointHook LoggerHook
        TimerHook TrainState Step StepContext make_step SummedLoss Transform with_amp
        with_grad_accum with_clip with_compile with_nonfinite_check with_unused_check
        find_unused_parameters with_activation_checkpoint with_efficient_conv_bn_eval
        with_schedule with_ema param_groups lr_find EvalHook EmptyCacheHook EarlyStoppingHook
        ProfilerHook memory schedules dist StaleStateError NonFiniteLossError CheckpointError""",
    "ftrain.schedules": """Schedule constant step_decay multistep exponential cosine polynomial
        cyclic cyclic_momentum onecycle onecycle_momentum cosine_restarts plateau warmup join
        by_epoch apply_schedules""",
    "ftrain.hooks": """Every EVERY_MICRO_BATCH PRIORITIES Hook HookPlan Hooks hook every once on
        get_priority resolve_hooks default_hooks CheckpointHook BestCheckpointHook
        AutoCheckpointHook LoggerHook TimerHook ConsoleSink JsonlSink TensorBoardSink EvalHook
        EmptyCacheHook EarlyStoppingHook ProfilerHook""",
    "ftrain.checkpoint": """state_dict load_state_dict load_weights export_weights
        load_sharded_weights load_checkpoint find_resumable Manifest save_atomic capture_rng
        restore_rng CheckpointError""",
    "ftrain.dist": """DistInfo init shutdown info is_distributed is_main rank world_size local_rank
        barrier broadcast_object wrap unwrap strategy is_sharded reduce_metrics sync_buffers
        sync_pending_grads all_arrive gather_object copy_wrapped SLURM_PORT_BASE StopVote
        local_tensor side_group hsdp_mesh param_dtypes skip_init meta_copy""",
    "ftrain.memory": """ActivationAccountant ActivationReport ModuleStats measure_activations
        tensor_bytes CheckpointSwitch checkpoint_call restore_running_stats EfficientConvBN
        efficient_conv_bn_eval efficient_conv_bn_eval_forward find_conv_bn_pairs
        DynamicPlannerState PlanSession plan_session choose_modules fit_poly poly_eval
        DEFAULT_SAVE_OPS DynamicPlan ModulesPlan PatternPlan SelectivePlan as_plan dynamic modules
        pattern resolve_plan selective cuda_peak""",
    "ftrain.transforms": """Transform with_amp with_grad_accum with_clip with_compile
        with_nonfinite_check with_unused_check find_unused_parameters""",
    "ftrain.optim": "param_groups NORM_LAYERS CUSTOM_KEY_FIELDS",
    "ftrain.events": "Event RunBegin EpochBegin StepEnd Evaluated EpochEnd Paused RunEnd RunTotals",
}
OLD = [(ns, name) for ns, names in OLD_ALL.items() for name in names.split()]

# Names that stay attributes of their namespace without being listed: a submodule (reached as
# ``ftrain.memory.cuda_peak`` like any submodule), and TrainState.clone's helper for wrapped
# models, which shares ftrain.dist's private copying code.
UNLISTED = {("ftrain.memory", "cuda_peak"), ("ftrain.dist", "copy_wrapped")}


def test_the_old_lists_are_the_180_names_of_before():
    assert len(OLD) == 180 and len(set(OLD)) == 180
    assert {ns: len(n.split()) for ns, n in OLD_ALL.items()} == {
        "ftrain": 47, "ftrain.schedules": 17, "ftrain.hooks": 25, "ftrain.checkpoint": 12,
        "ftrain.dist": 29, "ftrain.memory": 30, "ftrain.transforms": 8, "ftrain.optim": 3,
        "ftrain.events": 9,
    }  # fmt: skip


def test_the_surface_is_small():
    counts = {ns: len(importlib.import_module(ns).__all__) for ns in NAMESPACES}
    total = sum(counts.values())
    print("before: ftrain 47, the nine 180; now:", counts, "total", total)
    assert counts["ftrain"] <= 34, counts
    assert total <= 130, counts


def _resolve(dotted: str) -> object:
    """``a.b.c.Name``: import the longest module prefix, then read the attribute."""
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize(("namespace", "name"), OLD, ids=[f"{ns}.{n}" for ns, n in OLD])
def test_every_old_name_is_exported_or_says_where_it_went(namespace, name):
    module = importlib.import_module(namespace)
    if name in module.__all__ or (namespace, name) in UNLISTED:
        assert getattr(module, name) is not None
        return
    with pytest.raises(AttributeError) as info:
        getattr(module, name)
    message = str(info.value)
    old = re.escape(namespace) + r"\." + name
    found = re.fullmatch(rf"{old} moved: use ([\w.]+)", message) or re.fullmatch(
        rf"{old} is internal now \((ftrain\._[\w.]+)\) and no longer part of the public "
        rf"API; see {re.escape(namespace)}\.__all__ for what {re.escape(namespace)} offers\.",
        message,
    )
    assert found, message
    replacement = found.group(1)
    assert replacement.endswith(f".{name}") and replacement != f"{namespace}.{name}"
    assert _resolve(replacement) is not None  # the replacement itself resolves


def test_every_top_level_name_also_lives_in_a_namespace():
    import ftrain

    modules = {"events", "schedules", "memory", "dist"}
    homes = ("ftrain.hooks", "ftrain.transforms", "ftrain.checkpoint", "ftrain.optim",
             "ftrain.state", "ftrain.step", "ftrain.loop", "ftrain.loss", "ftrain.errors",
             "ftrain.lr_finder", "ftrain.transforms.schedule", "ftrain.transforms.ema",
             "ftrain.transforms.remat")  # fmt: skip
    for name in set(ftrain.__all__) - modules:
        found = [h for h in homes if getattr(importlib.import_module(h), name, None) is not None]
        assert any(getattr(ftrain, name) is getattr(importlib.import_module(h), name)
                   for h in found), name  # fmt: skip


def test_unknown_names_are_plain_attribute_errors():
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
            module.not_a_name  # noqa: B018


def test_activation_checkpointing_is_remat_and_the_old_module_names_it():
    from ftrain.transforms import remat

    assert remat.with_activation_checkpoint.__module__ == "ftrain.transforms.remat"
    code = "import ftrain.transforms.checkpoint"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "ImportError: ftrain.transforms.checkpoint was renamed: use ftrain.transforms.remat" in (
        out.stderr
    )
