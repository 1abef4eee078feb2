"""The public API: every name in ``ftrain.__all__`` resolves, lazily where it is heavy."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ftrain


@pytest.mark.parametrize("name", ftrain.__all__)
def test_every_public_name_resolves(name):
    assert getattr(ftrain, name) is not None
    assert name in dir(ftrain)


def test_lazy_names_are_the_real_objects():
    from ftrain.optim import param_groups
    from ftrain.transforms.conv_bn import with_efficient_conv_bn_eval
    from ftrain.transforms.remat import with_activation_checkpoint

    assert ftrain.with_activation_checkpoint is with_activation_checkpoint
    assert ftrain.transforms.conv_bn.with_efficient_conv_bn_eval is with_efficient_conv_bn_eval
    assert ftrain.param_groups is param_groups
    assert ftrain.with_ema is ftrain.transforms.ema.with_ema
    assert ftrain.with_schedule is ftrain.transforms.schedule.with_schedule
    assert ftrain.schedules.cosine is not None


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'with_nothing'"):
        ftrain.with_nothing  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'NoHook'"):
        ftrain.hooks.NoHook  # noqa: B018


def test_import_loads_exactly_what_the_package_docstring_says():
    code = (
        "import sys, ftrain; "
        "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules if m.startswith('ftrain')})); "
        "print([m for m in ('tensorboard', 'torch.utils.tensorboard', 'mlflow', 'wandb', "
        "'torch.distributed.checkpoint') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, optional = out.stdout.strip().splitlines()
    core = ["_agreement", "_checks", "_moved", "_tensors", "_warnings", "binding"]
    core += ["dist", "errors", "events", "hooks", "loop"]
    core += ["loss", "metric_names", "persist", "state"]
    assert loaded == str(
        sorted(["ftrain", *(f"ftrain.{m}" for m in [*core, "step", "transforms"])])
    )
    assert optional == "[]"
    for lazy in ("with_schedule", "with_ema", "with_activation_checkpoint", "EvalHook", "bench"):
        assert (
            lazy in ftrain.__doc__
            or lazy.replace("_", "") in ftrain.__doc__
            or lazy in {"with_activation_checkpoint"} | set(ftrain.__doc__.split("``"))
        )


def test_the_api_page_lists_every_public_name_on_one_screen():
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "api" / "index.md").read_text()
    assert len(page.splitlines()) <= 30  # one screen
    for module in ("ftrain", "ftrain.schedules", "ftrain.hooks", "ftrain.checkpoint",
                   "ftrain.transforms"):  # fmt: skip
        names = importlib.import_module(module).__all__
        assert [name for name in names if f"`{name}`" not in page] == [], module


def test_removed_names_say_what_replaces_them():
    for name, instead in (("fit", r"ftrain\.Loop\("), ("EMAHook", "with_ema"),
                          ("ScheduleHook", "with_schedule"),
                          ("InvalidLossHook", "with_nonfinite_check")):  # fmt: skip
        with pytest.raises(AttributeError, match=f"removed in ftrain 0.2: use .*{instead}"):
            getattr(ftrain, name)
