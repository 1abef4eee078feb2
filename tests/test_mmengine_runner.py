"""ftrain configured per docs/migration.md trains as the real MMEngine 0.10.7 ``Runner`` does.

AmpOptimWrapper(bfloat16, accumulative_counts, clip_grad, paramwise_cfg), LinearLR then
CosineAnnealingLR(eta_min), EMAHook: per iteration, the learning rate of every parameter, the
weights and the EMA weights agree within 1e-6, with accumulation (4) and without. Runs are
built by ``tests/mmengine_ref.py`` (checkpoint files and ``save_best`` can be compared on the
same runs).
"""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("mmengine", reason="the MMEngine reference runs need the mmengine extra")

from mmengine_ref import Setup, max_differences, run_ftrain, run_mmengine  # noqa: E402

TOLERANCE = 1e-6
SETUPS = {
    "accumulative_counts=4": Setup(accumulate=4, iters=32, warmup_end=8),
    "no accumulation": Setup(accumulate=1, iters=16, warmup_end=4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each setup run once by MMEngine and once by ftrain: {name: (mmengine, ftrain)}."""
    out = {}
    for name, setup in SETUPS.items():
        mm, _ = run_mmengine(setup, tmp_path_factory.mktemp("mmengine"))
        ours, _ = run_ftrain(setup)
        out[name] = (mm, ours)
    return out


@pytest.mark.parametrize("name", list(SETUPS))
def test_ftrain_per_the_guide_equals_the_mmengine_runner(runs, name):
    mm, ours = runs[name]
    setup = SETUPS[name]
    assert len(mm) == len(ours) == setup.iters
    diff = max_differences(mm, ours)
    print(
        f"{name}: max |ftrain - MMEngine| lr {diff['lr']:.3g}, weights "
        f"{diff['weights']:.3g}, EMA {diff['ema']:.3g}"
    )
    assert diff["lr"] <= TOLERANCE and diff["weights"] <= TOLERANCE and diff["ema"] <= TOLERANCE
    # the run exercises what it claims: the x10 group ends at the absolute floor, not 10x it
    head, body, floor = mm[-1].lrs["head.weight"], mm[-1].lrs["fc1.weight"], setup.eta_min
    high, low = setup.lr * setup.head_lr_mult, setup.lr  # each group: floor + (base - floor) c
    assert (head - floor) / (high - floor) == pytest.approx((body - floor) / (low - floor))
    assert head != pytest.approx(setup.head_lr_mult * body, rel=1e-2)
    assert ours[-1].ema["fc1.weight"].ne(ours[-1].weights["fc1.weight"]).any()


def test_counting_updates_under_accumulation_is_far_from_mmengine(runs):
    """The former guide (schedule and EMA counted in updates) is what the test would catch."""
    mm, _ = runs["accumulative_counts=4"]
    setup = attrs.evolve(SETUPS["accumulative_counts=4"], count="updates")
    ours, _ = run_ftrain(setup)
    diff = max_differences(mm, ours)
    assert diff["lr"] > 0.01 and diff["weights"] > 1e-3 and diff["ema"] > 1e-3


# ------------------------------------------------------------------ checkpoint files and best
# MMEngine CheckpointHook(interval=6, by_epoch=False, max_keep_ckpts=2, save_best="loss") with a
# validation every 12 iterations (and at the end): under accumulative_counts=4 an interval of 6
# iterations falls inside accumulation windows, and the names count iterations.
CKPT = dict(interval=6, max_keep=2, val_interval=12)


def _ftrain_checkpoint_hooks(setup, mode):
    """docs/migration.md's rows: the interval, names and max_iters in micro-batches; the
    validation every val_interval // N updates, of the EMA weights, and at the end."""
    from mmengine_ref import val_loss

    import ftrain
    from ftrain.hooks.evaluation import EvalHook
    from ftrain.transforms.ema import use_ema

    evaluate = use_ema(lambda state: {"loss": val_loss(state.model)})
    every = CKPT["val_interval"] // setup.accumulate
    return [
        EvalHook(evaluate, every=every, by_epoch=False, at_end=True),
        ftrain.CheckpointHook(CKPT["interval"], count="micro_batches", max_keep=CKPT["max_keep"]),
        ftrain.BestCheckpointHook("loss", mode, count="micro_batches"),
    ]


@pytest.mark.parametrize("rule", ["less", "greater"])  # greater: a best that is not the last
@pytest.mark.parametrize("name", list(SETUPS))
def test_kept_checkpoint_files_and_the_best_equal_the_mmengine_runner(tmp_path, name, rule):
    from mmengine_ref import mmengine_validation

    setup = SETUPS[name]
    mm_dir, our_dir = tmp_path / "mmengine", tmp_path / "ftrain"
    hooks = dict(
        checkpoint=dict(type="CheckpointHook", interval=CKPT["interval"], by_epoch=False,
                        max_keep_ckpts=CKPT["max_keep"], save_best="loss", rule=rule),
    )  # fmt: skip
    mm, runner = run_mmengine(setup, mm_dir, hooks, validation=mmengine_validation(12))
    hook_objs = _ftrain_checkpoint_hooks(setup, "min" if rule == "less" else "max")
    ours, _ = run_ftrain(setup, our_dir, hook_objs)
    theirs = sorted(p.name for p in mm_dir.glob("*.pth"))
    mine = sorted(p.name for p in our_dir.glob("*.pth"))
    best_mm, best_ours = runner.message_hub.get_info("best_score"), hook_objs[2].best
    print(f"{name}, {rule}: MMEngine kept {theirs} (best {best_mm:.9g}); ftrain kept {mine} "
          f"(best {best_ours:.9g})")  # fmt: skip
    assert mine == theirs
    first_val, last = CKPT["val_interval"], setup.iters
    assert f"best_loss_iter_{first_val if rule == 'greater' else last}.pth" in mine
    assert len(mine) == 3
    assert abs(best_mm - best_ours) <= TOLERANCE
    assert max_differences(mm, ours)["weights"] <= TOLERANCE
