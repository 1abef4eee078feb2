"""Bad input fails before training with an error naming the argument, the problem and the fix
(or warns, where the input can be legitimate): issue 23 item 4.

Each test builds the bad call and checks both the refusal and, where it matters, that a good
call still trains like a plain PyTorch loop.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import inspect
import math
import warnings

import numpy as np
import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain import _checks
from ftrain.events import Evaluated, StepEnd
from ftrain.hooks.misc import EarlyStoppingHook
from ftrain.loop.empty_batch import EmptyBatchWarning, is_empty

NAN, INF = math.nan, math.inf


def sgd_state(seed=0, lr=0.1):
    model = make_model(seed)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=lr))


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def plain_sgd(batches, lr=0.1, seed=0):
    """The reference: the same model trained by a plain PyTorch loop."""
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for b in batches:
        mse_loss(model, b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params_of(model)


@contextlib.contextmanager
def raises(error, *fragments):
    """``pytest.raises(error)`` whose message must contain every fragment."""
    with pytest.raises(error) as info:
        yield info
    text = str(info.value)
    missing = [f for f in fragments if f not in text]
    assert not missing, f"{missing} not in: {text}"


# ------------------------------------------------------------- EarlyStoppingHook
@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        ({"stopping_threshold": "a"}, TypeError, ["stopping_threshold", "finite number", "'a'"]),
        ({"stopping_threshold": NAN}, ValueError, ["stopping_threshold", "nan"]),
        ({"stopping_threshold": INF}, ValueError, ["stopping_threshold", "inf"]),
        ({"stopping_threshold": True}, TypeError, ["stopping_threshold", "bool"]),
        ({"min_delta": "0.1"}, TypeError, ["min_delta", "pass min_delta=0.1"]),
        ({"min_delta": -0.1}, ValueError, ["min_delta", ">= 0"]),
        ({"min_delta": INF}, ValueError, ["min_delta"]),
        ({"patience": 1.5}, ValueError, ["patience", "whole number >= 1"]),
        ({"patience": True}, ValueError, ["patience"]),
        ({"strict": "no"}, TypeError, ["strict", "True or False", "Pass strict=False"]),
        ({"check_finite": 1}, TypeError, ["check_finite", "True or False"]),
        ({"mode": "up"}, ValueError, ["mode", "'max' or 'min'"]),
    ],
)
def test_early_stopping_arguments_are_named_when_bad(kwargs, error, fragments):
    with raises(error, "EarlyStoppingHook", *fragments):
        EarlyStoppingHook("acc", **kwargs)


def test_early_stopping_takes_good_numbers_of_any_real_kind():
    hook = EarlyStoppingHook("acc", patience=np.int64(2), min_delta=np.float32(0.5),
                             stopping_threshold=1, strict=np.bool_(True))  # fmt: skip
    assert (hook.patience, hook.min_delta, hook.stopping_threshold) == (2, 0.5, 1.0)
    assert hook.strict is True and type(hook.patience) is int


def _loop(hooks, epochs=2, data=None, **kw):
    return ftrain.Loop(
        ftrain.make_step(mse_loss), sgd_state(), data or make_batches(2), hooks, epochs=epochs, **kw
    )


def test_early_stopping_without_an_evaluation_warns_once_before_the_first_step():
    seen_at_first_step = []

    def watch(events):
        for ev in events:
            if type(ev) is StepEnd and not seen_at_first_step:
                seen_at_first_step.append(len(record))
            yield ev

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _loop([EarlyStoppingHook("val_loss"), ftrain.hook(watch)], epochs=3).run()
    mine = [w for w in record if "EarlyStoppingHook('val_loss')" in str(w.message)]
    assert len(mine) == 1
    text = str(mine[0].message)
    assert "never stopped early" in text and "ftrain.EvalHook(evaluate)" in text
    assert "emits = (ftrain.events.Evaluated,)" in text
    assert seen_at_first_step == [len(record)]  # it came before the first step's event


class DeclaredEval:
    """A hook of the user's own that evaluates, and declares it (``EmitsEvents``)."""

    emits = (Evaluated,)

    def __init__(self, values):
        self.values = iter(values)

    def __call__(self, events):
        for ev in events:
            yield ev
            if type(ev).__name__ == "EpochEnd":
                yield Evaluated(ev.run, ev.state, {"val_loss": next(self.values)})


def test_early_stopping_with_an_evaluation_is_silent_and_stops():
    for evaluator in (ftrain.EvalHook(lambda s: {"val_loss": 1.0}), DeclaredEval([1.0] * 9)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning at all
            lp = _loop([evaluator, EarlyStoppingHook("val_loss", patience=2)], epochs=9)
            state = lp.run()
        # 1.0 first (best), then two evaluations without improvement: stops after epoch 3
        assert state.epoch == 3 and lp.stop_reason.startswith("early stopping")


def test_an_undeclared_evaluating_hook_still_works_but_is_warned_about():
    undeclared = DeclaredEval([1.0] * 9)
    plain = ftrain.hook(lambda events: undeclared(events), name="evaluate")
    with pytest.warns(UserWarning, match="no hook of this run evaluates"):
        lp = _loop([plain, EarlyStoppingHook("val_loss", patience=2)], epochs=9)
        assert lp.run().epoch == 3


def test_emits_events_is_a_typed_protocol():
    from ftrain.hooks.base import EmitsEvents

    assert isinstance(ftrain.EvalHook(lambda s: {}), EmitsEvents)
    assert isinstance(DeclaredEval([]), EmitsEvents)
    assert not isinstance(EarlyStoppingHook("acc"), EmitsEvents)


# ------------------------------------------------------------------------- Every
@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"start": -1}, ValueError, "Every: start must be a whole number >= 0, got -1."),
        ({"start": True}, ValueError, "Every: start must be a whole number >= 0, got True."),
        ({"start": 1.5}, ValueError, "Every: start must be a whole number >= 0"),
        ({"steps": 0}, ValueError, "Every: steps must be a whole number >= 1 or None, got 0."),
        ({"steps": "10"}, ValueError, "Every: steps must be a whole number >= 1 or None"),
        ({"epochs": 2.5}, ValueError, "Every: epochs must be a whole number >= 1 or None"),
        ({"at": 5}, TypeError, "at= must be a collection of update numbers, e.g. at=(1,)"),
        ({"at": "12"}, TypeError, "at= must be a collection"),
        ({"at": [0, 3]}, ValueError, "at= must hold whole update numbers >= 1"),
        ({"micro_batches": "no"}, TypeError, "Every: micro_batches must be True or False"),
    ],
)
def test_every_arguments_are_named_when_bad(kwargs, error, fragment):
    with raises(error, fragment):
        ftrain.Every(**kwargs)


def test_every_still_takes_good_values():
    c = ftrain.Every(steps=np.int64(10), start=5, at=[1])
    assert (c.next_due(0), c.next_due(1), c.due(25)) == (1, 5, True)


# ---------------------------------------------------------------- SummedLoss count
def _summed_step(count):
    return ftrain.make_step(lambda m, b: ftrain.SummedLoss(m(b[0]).pow(2).sum(), count))


@pytest.mark.parametrize(
    "count", [-4, -0.5, NAN, INF, torch.tensor(-4), torch.tensor(NAN), torch.tensor([-1.0])]
)
def test_a_negative_or_non_finite_count_is_refused_before_the_update(count):
    state = sgd_state()
    before = params_of(state.model)
    with pytest.raises(ValueError, match="count must be"):
        _summed_step(count)(state, make_batches(1)[0])
    # nothing was trained and the state is still usable
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    assert not state.is_consumed


def test_the_count_message_names_the_fix():
    with raises(ValueError, "SummedLoss(total, count)", "got -4", "sign flipped", "mask.sum()"):
        _summed_step(-4)(sgd_state(), make_batches(1)[0])


def test_good_counts_train_like_the_mean_in_plain_pytorch():
    batches = make_batches(3)
    for count in (8, 8.0, torch.tensor(8), torch.tensor(8.0)):
        state = sgd_state()
        step = ftrain.make_step(
            lambda m, b, c=count: ftrain.SummedLoss(
                torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="sum") / 4, c
            )
        )
        for b in batches:
            state, _ = step(state, b)
        for a, b in zip(params_of(state.model), plain_sgd(batches)):
            torch.testing.assert_close(a, b)  # sum / (4 * 8) == the mean over 8 x 4 values


def test_a_zero_count_gives_no_gradient():
    state = sgd_state()
    before = params_of(state.model)
    state, m = _summed_step(0)(state, make_batches(1)[0])
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))


def test_a_tensor_count_is_checked_on_its_device_never_read_on_the_host(monkeypatch):
    """``torch._assert_async``: queued on an accelerator (no sync); on the CPU it raises at
    once, which shows the check and its message."""
    from ftrain.loss import assert_count_on_device, check_count_tensor

    with pytest.raises(RuntimeError, match="count must be a finite number >= 0"):
        assert_count_on_device(torch.tensor(-1.0))
    real = torch._assert_async
    calls = []

    def recording(ok, msg):
        calls.append(ok)
        real(ok, msg)

    monkeypatch.setattr(torch, "_assert_async", recording)
    for name in ("item", "__bool__", "__float__", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a: pytest.fail("read on the host"))
    for good in (torch.tensor(3), torch.tensor(2.5), torch.tensor(0.0), torch.tensor([7])):
        check_count_tensor(good)
    assert len(calls) == 4 and all(ok.dtype is torch.bool for ok in calls)


# ------------------------------------------------------- booleans must be bools
def _step():
    return ftrain.make_step(mse_loss)


def _factories():
    """Every public constructor or function taking a flag: how to call it with ``value``."""
    from ftrain import schedules as S
    from ftrain.checkpoint import export_weights, load_state_dict, load_weights, state_dict
    from ftrain.hooks.logging import ConsoleSink
    from ftrain.hooks.monitor import Throughput
    from ftrain.hooks.profiler import ProfilerHook
    from ftrain.memory import dynamic, measure_activations, pattern
    from ftrain.memory.accounting import ActivationAccountant
    from ftrain.memory.dynamic_plan import PlanSession
    from ftrain.persist.weights import load_sharded_weights

    m = torch.nn.Linear(2, 1)
    data = [torch.ones(1, 2)]

    def plan_session(v):
        plan = dynamic(1e9)
        return PlanSession(plan, m, None, monitor=v)

    return {
        ("Loop", "reseed_data"): lambda v: ftrain.Loop(_step(), sgd_state(), data, [], reseed_data=v),
        ("every", "first"): lambda v: ftrain.every(2, print, first=v),
        ("Every", "micro_batches"): lambda v: ftrain.Every(micro_batches=v),
        ("default_hooks", "progress"): lambda v: ftrain.default_hooks(progress=v),
        ("default_hooks", "summary"): lambda v: ftrain.default_hooks(summary=v),
        **{("CheckpointHook", k): (lambda v, k=k: ftrain.CheckpointHook(**{k: v}))
           for k in ("by_epoch", "save_last", "optional", "background")},
        ("BestCheckpointHook", "by_epoch"): lambda v: ftrain.BestCheckpointHook("acc", by_epoch=v),
        ("AutoCheckpointHook", "optional"): lambda v: ftrain.hooks.AutoCheckpointHook(optional=v),
        **{("LoggerHook", k): (lambda v, k=k: ftrain.LoggerHook(**{k: v}))
           for k in ("progress", "console", "console_epoch_end", "summary", "epoch_end")},
        **{("ConsoleSink", k): (lambda v, k=k: ConsoleSink(**{k: v}))
           for k in ("progress", "epoch_end")},
        **{("EvalHook", k): (lambda v, k=k: ftrain.EvalHook(lambda s: {}, **{k: v}))
           for k in ("by_epoch", "at_end")},
        **{("EmptyCacheHook", k): (lambda v, k=k: ftrain.hooks.EmptyCacheHook(**{k: v}))
           for k in ("after_epoch", "after_step", "before_epoch")},
        **{("EarlyStoppingHook", k): (lambda v, k=k: EarlyStoppingHook("acc", **{k: v}))
           for k in ("strict", "check_finite")},
        **{("ProfilerHook", k): (lambda v, k=k: ProfilerHook(**{k: v}))
           for k in ("record_shapes", "profile_memory", "with_stack", "with_flops", "use_gzip")},
        ("Throughput", "memory"): lambda v: Throughput(memory=v),
        ("with_compile", "fullgraph"): lambda v: ftrain.with_compile(_step(), fullgraph=v),
        ("with_compile", "dynamic_batch"): lambda v: ftrain.with_compile(_step(), dynamic_batch=v),
        ("with_unused_check", "once"): lambda v: ftrain.transforms.with_unused_check(_step(), once=v),
        ("with_activation_checkpoint", "monitor"): lambda v: ftrain.with_activation_checkpoint(
            _step(), [], monitor=v),
        ("with_schedule", "by_epoch"): lambda v: ftrain.with_schedule(
            _step(), lr=S.constant(1.0), by_epoch=v),
        **{("param_groups", k): (lambda v, k=k: ftrain.param_groups(m, lr=0.1, **{k: v}))
           for k in ("bypass_duplicate", "merge")},
        ("warmup", "inverse"): lambda v: S.warmup(S.constant(1.0), iters=3, inverse=v),
        ("onecycle", "three_phase"): lambda v: S.onecycle(1.0, total=10, three_phase=v),
        ("onecycle_momentum", "three_phase"): lambda v: S.onecycle_momentum(
            total=10, three_phase=v),
        ("pattern", "leaves"): lambda v: pattern(under="x", leaves=v),
        ("dynamic", "warmup_checkpoint"): lambda v: dynamic(1e9, warmup_checkpoint=v),
        ("state_dict", "rng"): lambda v: state_dict(sgd_state(), rng=v),
        ("load_state_dict", "rng"): lambda v: load_state_dict(sgd_state(), {}, rng=v),
        ("load_state_dict", "strict"): lambda v: load_state_dict(sgd_state(), {}, strict=v),
        ("load_weights", "strict"): lambda v: load_weights(m, "/nowhere.pth", strict=v),
        ("load_sharded_weights", "strict"): lambda v: load_sharded_weights(m, "/x", strict=v),
        ("export_weights", "ema"): lambda v: export_weights(m, "/nowhere.safetensors", ema=v),
        **{("ActivationAccountant", k): (lambda v, k=k: ActivationAccountant(m, **{k: v}))
           for k in ("time", "tap_checkpoints", "sync")},
        **{("measure_activations", k): (
            lambda v, k=k: measure_activations(m, lambda: m(torch.ones(1, 2)).sum(), **{k: v}))
           for k in ("backward", "tap_checkpoints", "time")},
        ("PlanSession", "monitor"): plan_session,
        ("plan_session", "monitor"): lambda v: ftrain.memory.dynamic_plan.plan_session(
            dynamic(1e9), m, monitor=v).__enter__(),
    }  # fmt: skip


#: Flags not checked, and why: records built by the checked functions above, the event
#: types and internals hooks receive, paths that may also be True/False.
EXEMPT = {
    ("OutputDir", "checkpoints"),  # a record a hook returns
    ("StepContext", "boundary"), ("StepContext", "skip"),  # the step's own record
    ("StepContext", "backward_started"), ("StepContext", "update_started"),
    ("DynamicPlan", "warmup_checkpoint"), ("PatternPlan", "leaves"),  # made by dynamic(), pattern()
    ("Manifest", "main"), ("Manifest", "rebuild"),  # the checkpointer's own file list
    ("LoggerHook", "jsonl"), ("LoggerHook", "tensorboard"),  # True/False/None or a path (str)
    ("LoggerHook", "throughput"),  # a Throughput, True or False: checked on its own
}  # fmt: skip

PUBLIC = (
    "ftrain", "ftrain.hooks", "ftrain.hooks.base", "ftrain.hooks.logging", "ftrain.hooks.monitor",
    "ftrain.schedules", "ftrain.checkpoint", "ftrain.dist", "ftrain.memory", "ftrain.optim",
    "ftrain.transforms",
)  # fmt: skip


def _flag_parameters():
    """(owner, parameter) of every public constructor/function parameter that is a flag."""
    found = set()
    for module in map(importlib.import_module, PUBLIC):
        for name in module.__all__:
            obj = getattr(module, name)
            fn = obj.__init__ if inspect.isclass(obj) else obj
            if inspect.ismodule(obj) or not callable(fn):
                continue
            try:
                params = inspect.signature(fn).parameters.values()
            except (TypeError, ValueError):
                continue
            for p in params:
                annotation = str(p.annotation)
                optional_flag = p.default is None and annotation.startswith("bool |")
                if isinstance(p.default, bool) or optional_flag:
                    found.add((obj.__name__, p.name))
    return found


def test_every_public_flag_is_checked_here():
    """A new flag argument must be added to the table (and checked) or exempted, with why."""
    assert _flag_parameters() - set(_factories()) - EXEMPT == set()


@pytest.mark.parametrize("key", sorted(_factories()), ids=lambda k: f"{k[0]}({k[1]})")
@pytest.mark.parametrize("bad", ["no", "False", 1, 0, None])
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(key, bad):
    owner, arg = key
    if bad is None and (owner, arg) in {("BestCheckpointHook", "by_epoch"),
                                        ("ActivationAccountant", "sync"),
                                        ("with_compile", "dynamic_batch")}:  # fmt: skip
        _factories()[key](None)  # None is a documented value of this flag: accepted
        return
    with raises(TypeError, f"{owner}: {arg}", "must be True", f"got {bad!r}", f"Pass {arg}=False"):
        _factories()[key](bad)


def test_the_issue_flags_that_meant_true_are_refused():
    with raises(TypeError, "Loop: reseed_data must be True or False, got 'no'",
                "'no' and 'False' included, is true in Python"):  # fmt: skip
        ftrain.Loop(_step(), sgd_state(), make_batches(1), [], reseed_data="no")
    with raises(TypeError, "CheckpointHook: by_epoch must be True or False, got 'yes'"):
        ftrain.CheckpointHook(by_epoch="yes")
    with raises(TypeError, "CheckpointHook: background must be True or False, got 'no'"):
        ftrain.CheckpointHook(background="no")


def test_numpy_bools_are_taken_as_what_they_say():
    hook = ftrain.CheckpointHook(background=np.bool_(False))
    assert hook.background == False  # noqa: E712 (a numpy bool)
    lp = ftrain.Loop(_step(), sgd_state(), make_batches(1), [], reseed_data=np.bool_(False))
    assert not lp.reseed_data


# ----------------------------------------------------------- AutoCheckpointHook
@pytest.mark.parametrize(
    "timeout, error", [(-1, ValueError), (0, ValueError), (NAN, ValueError), (INF, ValueError),
                       ("10", TypeError), (True, TypeError), (None, TypeError)]
)  # fmt: skip
def test_agree_timeout_must_be_a_positive_finite_number(timeout, error):
    with raises(error, "AutoCheckpointHook: agree_timeout", "finite number > 0", "seconds"):
        ftrain.hooks.AutoCheckpointHook(agree_timeout=timeout)
    assert ftrain.hooks.AutoCheckpointHook(agree_timeout=np.float64(2.5)).agree_timeout == 2.5


# --------------------------------------------------------------------- dist.wrap
def test_wrap_refuses_unknown_keywords_in_one_process_listing_the_valid_ones():
    model = torch.nn.Linear(2, 1)
    with raises(TypeError, "wrap(strategy='ddp') got an unexpected keyword argument 'bogus'",
                "find_unused_parameters", "static_graph"):  # fmt: skip
        ftrain.dist.wrap(model, "ddp", bogus=1)
    with raises(TypeError, "'static_grph' (did you mean 'static_graph'?)"):
        ftrain.dist.wrap(model, "ddp", static_grph=True)
    with raises(TypeError, "wrap(strategy='fsdp2')", "'device_ids'", "reshard_after_forward"):
        ftrain.dist.wrap(model, "fsdp2", device_ids=[0])
    # the real options pass (unused in one process)
    assert ftrain.dist.wrap(model, "ddp", find_unused_parameters=True) is model
    assert ftrain.dist.wrap(model, "fsdp2", reshard_after_forward=False) is model


# ----------------------------------------------------------------------- with_clip
@pytest.mark.parametrize(
    "mode, kwargs, error, fragments",
    [
        ("norm", {"max_norm": NAN}, ValueError, ["max_norm must be a number > 0"]),
        ("norm", {"max_norm": -1.0}, ValueError, ["max_norm must be a number > 0"]),
        ("norm", {"max_norm": 0.0}, ValueError, ["max_norm must be a number > 0"]),
        ("value", {"clip_value": -INF}, ValueError, ["clip_value must be a number > 0"]),
        ("average", {"tolerance": NAN}, ValueError, ["tolerance must be a number > 0"]),
        ("value", {"clip_value": 1.0, "max_norm": 2.0}, ValueError,
         ["with_clip(mode='value') does not use max_norm=2.0", "use mode='norm'"]),
        ("norm", {"max_norm": 1.0, "clip_value": 0.1}, ValueError, ["does not use clip_value"]),
        ("norm", {"max_norm": 1.0, "tolerance": 2.0}, ValueError,
         ["does not use tolerance", "mode='average' or 'moving_average'"]),
        ("average", {"momentum": 0.5}, ValueError,
         ["with_clip(mode='average') does not use momentum", "mode='moving_average'"]),
    ],
)  # fmt: skip
def test_with_clip_refuses_meaningless_values(mode, kwargs, error, fragments):
    with raises(error, *fragments):
        ftrain.with_clip(_step(), mode, **kwargs)


@pytest.mark.parametrize(
    "mode, kwargs", [("norm", {"max_norm": INF}), ("value", {"clip_value": INF}),
                     ("average", {"tolerance": INF})]
)  # fmt: skip
def test_an_infinite_threshold_warns_and_trains_unclipped_like_plain_pytorch(mode, kwargs):
    """Legitimate (it still reports grad_norm), so a warning, not an error."""
    with pytest.warns(UserWarning, match="never clips: the step only reports grad_norm"):
        step = ftrain.with_clip(_step(), mode, **kwargs)
    batches = [(x * 100, y) for x, y in make_batches(3)]  # large gradients
    state = sgd_state(lr=1e-4)
    for b in batches:
        state, metrics = step(state, b)
    assert torch.isfinite(metrics["grad_norm"])
    for a, b in zip(params_of(state.model), plain_sgd(batches, lr=1e-4)):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------- TrainState.create
def test_an_optimizer_over_another_models_parameters_is_refused_for_a_parameter_free_model():
    other = torch.nn.Linear(2, 2)
    with raises(ValueError, "TrainState.create: the optimizer holds none of the model's "
                "parameters (ReLU has none", "shapes (2, 2), (2,)",
                "torch.optim.AdamW(model.parameters()"):  # fmt: skip
        ftrain.TrainState.create(torch.nn.ReLU(), torch.optim.SGD(other.parameters(), lr=0.1))
    model = make_model()
    with raises(ValueError, "none of the model's parameters"):
        ftrain.TrainState.create(model, torch.optim.SGD(other.parameters(), lr=0.1))


@pytest.mark.parametrize("kwargs", [{"step": -1}, {"epoch": 1.5}, {"step": "3"}, {"epoch": True}])
def test_train_state_counters_must_be_whole_numbers(kwargs):
    model = make_model()
    (name,) = kwargs
    with raises(ValueError, f"TrainState.create: {name} must be a whole number >= 0"):
        ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with raises(ValueError, f"TrainState.replace: {name} must be a whole number >= 0"):
        state.replace(**kwargs)
    assert state.replace(epoch=2).epoch == 2


# ------------------------------------------------------------------ empty batches
@pytest.mark.parametrize(
    "batch, empty",
    [
        ((torch.ones(0, 8), torch.ones(0, 4)), True),
        ([torch.ones(0, 8), torch.ones(0, 4), torch.tensor(3)], True),  # 0-d tensors aside
        ({"x": torch.ones(0, 8), "y": torch.ones(0)}, True),
        (torch.ones(0, 8), True),
        ((torch.ones(2, 8), torch.ones(0, 4)), False),  # images beside no boxes: not empty
        ((torch.ones(2, 8), torch.ones(2, 4)), False),
        ((1, 2), False),
        ("text", False),
    ],
)
def test_an_empty_batch_is_known_from_shapes(batch, empty):
    assert is_empty(batch) is empty


def test_an_empty_batch_warns_once_before_its_step_naming_it():
    batches = make_batches(4)
    empty = (torch.ones(0, 8), torch.ones(0, 4))
    data = [batches[0], empty, batches[1], empty]
    order = []

    def loss_fn(model, batch):
        order.append(("step", batch[0].shape[0], len(record)))
        return mse_loss(model, batch)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lp = ftrain.Loop(ftrain.make_step(loss_fn), sgd_state(), data, [], epochs=2)
        state = lp.run()
    found = [w for w in record if w.category is EmptyBatchWarning]
    assert len(found) == 1  # the run's first only
    text = str(found[0].message)
    assert "batch 1 of epoch 0" in text and "[(0, 8), (0, 4)]" in text
    assert "drop_last=True" in text and "filter empty samples" in text
    assert order[1] == ("step", 0, 1)  # the warning came before that batch's step
    # the step itself is unchanged: the mean over no samples is NaN, as in plain PyTorch
    assert torch.isnan(torch.nn.functional.mse_loss(torch.ones(0, 4), torch.ones(0, 4)))
    assert state.step == 8


def test_normal_batches_never_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmptyBatchWarning)
        ftrain.Loop(_step(), sgd_state(), make_batches(3), [], epochs=2).run()


# ------------------------------------------------------ two CheckpointHooks, one directory
def test_two_checkpoint_hooks_in_one_directory_are_refused_before_any_file(tmp_path):
    hooks = [ftrain.CheckpointHook(interval=2, max_keep=1), ftrain.CheckpointHook(interval=3)]
    with raises(ValueError, "Two CheckpointHooks save into", str(tmp_path),
                "max_keep of one would delete the other's", "out_dir="):  # fmt: skip
        ftrain.Loop(_step(), sgd_state(), make_batches(7), hooks, work_dir=tmp_path).run()
    assert list(tmp_path.glob("*.pth")) == []
    same = [ftrain.CheckpointHook(interval=2, out_dir=tmp_path / "a"),
            ftrain.CheckpointHook(interval=3, out_dir=tmp_path / "b" / ".." / "a")]  # fmt: skip
    with pytest.raises(ValueError, match="Two CheckpointHooks"):
        ftrain.Loop(_step(), sgd_state(), make_batches(7), same, work_dir=tmp_path).run()


def test_two_checkpoint_hooks_in_their_own_directories_keep_their_files(tmp_path):
    hooks = [ftrain.CheckpointHook(interval=2, max_keep=1),
             ftrain.CheckpointHook(interval=3, out_dir=tmp_path / "keep")]  # fmt: skip
    ftrain.Loop(_step(), sgd_state(), make_batches(7), hooks, work_dir=tmp_path).run()
    assert sorted(p.name for p in tmp_path.glob("*.pth")) == ["iter_7.pth"]
    kept = sorted(p.name for p in (tmp_path / "keep").glob("*.pth"))
    assert kept == ["iter_3.pth", "iter_6.pth", "iter_7.pth"]


# ---------------------------------------------------------------- the wider audit
@pytest.mark.parametrize(
    "make, error, fragments",
    [
        (lambda: ftrain.CheckpointHook(out_dir=123), TypeError,
         ["CheckpointHook: out_dir must be a directory path", "123"]),
        (lambda: ftrain.CheckpointHook(out_dir=""), ValueError,
         ["out_dir='' is empty", "current directory"]),
        (lambda: ftrain.BestCheckpointHook("acc", out_dir=""), ValueError, ["out_dir"]),
        (lambda: ftrain.hooks.AutoCheckpointHook(out_dir=5), TypeError, ["AutoCheckpointHook: out_dir"]),
        (lambda: ftrain.BestCheckpointHook(123, mode="max"), TypeError,
         ["BestCheckpointHook: metric must be a non-empty string"]),
        (lambda: ftrain.Loop(_step(), sgd_state(), [1], 5), TypeError,
         ["hooks must be a list of hooks", "got 5"]),
        (lambda: ftrain.with_amp(_step(), "fp16", loss_scale=INF), ValueError,
         ["loss_scale must be a finite number > 0"]),
        (lambda: ftrain.hooks.monitor.Throughput(batch_size=-8), ValueError,
         ["Throughput: batch_size (per micro-batch) must be a whole number >= 1"]),
        (lambda: ftrain.hooks.monitor.Throughput(flops=NAN), ValueError, ["flops"]),
        (lambda: ftrain.hooks.monitor.Throughput(peak_flops=INF), ValueError, ["peak_flops"]),
        (lambda: ftrain.LoggerHook(every=0), ValueError, ["LoggerHook: every"]),
        (lambda: ftrain.every(0, print), ValueError, ["every: n must be a whole number >= 1"]),
        (lambda: ftrain.dist.SyncBuffersHook(every=0), ValueError, ["SyncBuffersHook: every"]),
        (lambda: ftrain.memory.pattern(under="x", every=0), ValueError, ["pattern: every"]),
        (lambda: ftrain.with_ema(_step(), decay=0.9, begin=-1), ValueError, ["with_ema: begin"]),
        (lambda: ftrain.Loop(_step(), sgd_state(), [1], [], max_steps=0), ValueError,
         ["Loop: max_steps must be a whole number >= 1 or None"]),
        (lambda: ftrain.dist.init(backend=5), TypeError, ["init: backend must be a backend name"]),
        (lambda: ftrain.dist.init(timeout=-1), ValueError, ["init: timeout (seconds)", "> 0"]),
    ],
)  # fmt: skip
def test_other_bad_values_are_refused_naming_them(make, error, fragments):
    with raises(error, *fragments):
        make()


# --------------------------------------------------------------------- the checks
def test_argument_checks_module_examples():
    from ftrain.loop import empty_batch

    for module in (_checks, ftrain.loss, empty_batch, ftrain.hooks.base, ftrain.hooks.cadence):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_number_describes_ranges():
    assert _checks.number("f: x", 0.5, 0, 1, low_open=True, high_open=True) == 0.5
    with raises(ValueError, "f: x must be a finite number in (0, 1), got 1"):
        _checks.number("f: x", 1, 0, 1, low_open=True, high_open=True)
    with raises(ValueError, "f: x must be a finite number <= 3, got 4"):
        _checks.number("f: x", 4, high=3)
    assert _checks.number("f: x", None, none=True) is None
    assert _checks.whole("f: n", np.int32(3), 1) == 3


def test_the_docs_page_snippets_run(tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "input_checks.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/input_checks.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "CheckpointHook: background must be True or False, got 'no'" in out
    assert namespace["state"].epoch == 3 and "val_loss did not improve" in out
