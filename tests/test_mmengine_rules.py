"""Rule inference and early stopping decide as MMEngine 0.10.7 does.

Expected values are MMEngine's documented behaviour (``CheckpointHook._init_rule``
docstring: case-insensitive; the greater keys ``acc, top, AR@, auc, precision,
mAP, mDice, mIoU, mAcc, aAcc`` and the less key ``loss``; exact match before
substring, greater before less; ``EarlyStoppingHook(min_delta=0.1,
check_finite=True, patience=5)``), worked out by hand for each case.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ftrain
from ftrain.events import Evaluated
from ftrain.hooks.misc import EarlyStoppingHook
from ftrain.hooks.rules import infer_mode


@pytest.mark.parametrize(
    "metric, mode",
    [
        ("acc", "max"),
        ("val/Accuracy", "max"),  # 'acc' in 'val/accuracy'
        ("Top1", "max"),
        ("TOP", "max"),
        ("coco/bbox_mAP", "max"),
        ("MIOU", "max"),
        ("ar@100", "max"),
        ("AUC", "max"),
        ("Precision", "max"),
        ("LOSS", "min"),
        ("val_loss", "min"),
        ("val/Loss_cls", "min"),
    ],
)
def test_rule_is_inferred_case_insensitively(metric, mode):
    assert infer_mode(metric) == mode
    assert ftrain.BestCheckpointHook(metric).mode == mode
    assert EarlyStoppingHook(metric).mode == mode


def test_a_name_with_both_kinds_of_key_is_maximised_with_a_warning():
    # MMEngine: 'heatmap_loss'.lower() contains 'map' (greater keys are tried first)
    with pytest.warns(UserWarning, match="mode='min'"):
        assert infer_mode("heatmap_loss") == "max"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ftrain.BestCheckpointHook("heatmap_loss", mode="min").mode == "min"


def test_custom_key_lists_and_unknown_names():
    assert infer_mode("psnr", greater_keys=["PSNR"]) == "max"
    assert infer_mode("fid", less_keys=["fid"]) == "min"
    with pytest.raises(ValueError, match="mode='max' or mode='min'"):
        infer_mode("psnr_db")
    with pytest.raises(ValueError, match="mode='max'"):
        EarlyStoppingHook("score")


def _decisions(hook, values):
    return [hook.observe(v) for v in values]


def test_mmengine_mapping_stops_a_slowly_improving_metric_after_six_evaluations():
    # +0.01 per evaluation: MMEngine (min_delta=0.1) keeps best=0.50 (0.5 + 0.1 > value
    # for 0.51 ... 0.55), waits 5 times and stops at the 6th evaluation.
    values = [0.50, 0.51, 0.52, 0.53, 0.54, 0.55, 0.56]
    mm = EarlyStoppingHook("acc", patience=5, min_delta=0.1, check_finite=True)
    assert _decisions(mm, values[:6]) == [False] * 5 + [True]
    assert mm.best == 0.50 and mm.wait == 5
    # ftrain's own default (min_delta=0) trains on
    assert not any(_decisions(EarlyStoppingHook("acc", patience=5), values))


def test_a_change_of_exactly_min_delta_improves_as_in_mmengine():
    # MMEngine: no improvement when best + min_delta > value; 0.5 + 0.25 == 0.75 improves
    hook = EarlyStoppingHook("acc", patience=1, min_delta=0.25)
    assert _decisions(hook, [0.5, 0.75]) == [False, False] and hook.best == 0.75
    loss = EarlyStoppingHook("loss", patience=1, min_delta=0.25)
    assert _decisions(loss, [1.0, 0.75]) == [False, False] and loss.best == 0.75
    assert loss.observe(0.5625) is True  # 0.75 - 0.25 < 0.5625: no improvement


def test_check_finite_and_stopping_threshold():
    hook = EarlyStoppingHook("loss", patience=5, min_delta=0.1, check_finite=True)
    assert _decisions(hook, [1.0, math.nan]) == [False, True]
    plain = EarlyStoppingHook("loss", patience=5)
    assert _decisions(plain, [1.0, math.nan, math.inf]) == [False, False, False]
    goal = EarlyStoppingHook("acc", stopping_threshold=0.9)
    assert _decisions(goal, [0.5, 0.9, 0.95]) == [False, False, True]  # strictly greater
    assert goal.best == 0.95


def test_early_stopping_in_a_run_reports_the_reason():
    model = torch.nn.Linear(2, 1)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    values = iter([0.50, 0.51, 0.52, 0.53, 0.54, 0.55, 0.56, 0.57])
    seen = []

    def watch(events):
        for ev in events:
            if type(ev) is Evaluated:
                seen.append(ev.metrics["acc"])
            yield ev

    lp = ftrain.Loop(
        ftrain.make_step(lambda m, b: m(b).pow(2).mean()),
        state,
        [torch.ones(2, 2)] * 2,
        [
            ftrain.EvalHook(lambda s: {"acc": next(values)}),
            EarlyStoppingHook("acc", patience=5, min_delta=0.1, check_finite=True),
            ftrain.hook(watch, priority="LOWEST"),
        ],
        epochs=8,
    )
    lp.run()
    assert len(seen) == 6 and lp.state.epoch == 6
    assert lp.stop_reason.startswith("early stopping: acc did not improve (max) by at least 0.1")
