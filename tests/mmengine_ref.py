"""The real MMEngine 0.10.7 ``Runner`` and ftrain configured per docs/migration.md, side by side.

:func:`run_mmengine` and :func:`run_ftrain` train the same model on the same batches from one
:class:`Setup` and return one :class:`Record` per micro-batch (MMEngine's iteration): the
learning rate of every parameter the forward saw, then the weights and the EMA weights after
it. Extra hooks (MMEngine ``default_hooks`` / ftrain hooks) and the work directories are
parameters, so checkpoint files, ``max_iters`` counting and ``save_best`` can be compared on
the same runs.

MMEngine on a CPU-only machine (docs: /work/shared/reference/seed-semantics.md):
``AmpOptimWrapper`` asserts an accelerator, so its ``is_cuda_available`` is patched while a run
is built (bf16 autocast works on the CPU and its GradScaler disables itself); a torchvision
whose operators do not match torch is kept out of MMEngine's environment report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import ftrain
from ftrain import schedules as S
from ftrain.events import StepEnd
from ftrain.optim import param_groups


@attrs.frozen
class Setup:
    """One configuration, written once for both libraries."""

    accumulate: int = 4  # MMEngine accumulative_counts, ftrain with_grad_accum(every=)
    iters: int = 32  # micro-batches (MMEngine max_iters)
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    max_norm: float = 1.0  # some updates are clipped, some not
    warmup_end: int = 8  # LinearLR(start_factor, begin=0, end=warmup_end)
    start_factor: float = 0.1
    eta_min: float = 1e-3  # CosineAnnealingLR(eta_min) from warmup_end to iters, absolute
    ema_momentum: float = 0.01  # EMAHook(momentum=)
    head_lr_mult: float = 10.0  # paramwise_cfg custom_keys={"head": dict(lr_mult=...)}
    bf16: bool = True
    batches: int = 16  # per epoch (batch size 4 over 64 samples)
    count: str = "micro_batches"  # how ftrain's schedule and EMA count (the guide's rows)


@attrs.frozen
class Record:
    """After micro-batch ``iteration`` (from 0): the lr its forward saw and the weights."""

    iteration: int
    lrs: dict[str, float]
    weights: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor]


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    )


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=False)


@contextlib.contextmanager
def mmengine_on_cpu() -> Iterator[types.ModuleType]:
    """Import MMEngine's runner pieces; ``AmpOptimWrapper`` accepted on a CPU meanwhile."""
    if importlib.util.find_spec("torchvision") is not None:
        stub = types.ModuleType("torchvision._meta_registrations")
        sys.modules.setdefault("torchvision._meta_registrations", stub)
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_wrapper
    import mmengine.runner

    saved = amp_wrapper.is_cuda_available
    amp_wrapper.is_cuda_available = lambda: True
    try:
        yield mmengine.runner
    finally:
        amp_wrapper.is_cuda_available = saved


def make_net() -> torch.nn.Module:
    """The model, as an MMEngine ``BaseModel`` (ftrain trains the same class)."""
    from mmengine.model import BaseModel

    class Net(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc1 = torch.nn.Linear(8, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x, y, mode="loss"):
            out = self.head(torch.relu(self.norm(self.fc1(x))))
            if mode == "predict":  # the validation: the batch's summed squared error
                return [torch.nn.functional.mse_loss(out.float(), y, reduction="sum")]
            return {"loss": torch.nn.functional.mse_loss(out.float(), y)}

    return Net()


def val_loader() -> torch.utils.data.DataLoader:
    """The validation data (16 samples, batch size 4)."""
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def val_loss(model: torch.nn.Module) -> float:
    """The validation metric as ftrain's evaluation computes it (mean squared error)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in val_loader():
            total += float(model(x, y, mode="predict")[0])
            count += y.numel()
    return total / count


def mmengine_validation(val_interval: int) -> dict[str, Any]:
    """Runner arguments validating every ``val_interval`` iterations (and at the end) with a
    metric ``loss``: the same mean squared error as :func:`val_loss`."""
    from mmengine.evaluator import BaseMetric, Evaluator

    class MSE(BaseMetric):
        def process(self, data_batch, data_samples):
            self.results.append((float(data_samples[0]), data_batch[1].numel()))

        def compute_metrics(self, results):
            return {"loss": sum(r[0] for r in results) / sum(r[1] for r in results)}

    return dict(
        val_dataloader=val_loader(),
        val_evaluator=Evaluator(MSE()),
        val_cfg=dict(),
        val_interval=val_interval,
    )


def _named(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict:
    return {name: t.detach().clone() for name, t in tensors}


def _lrs(model: torch.nn.Module, groups: Sequence[dict]) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: float(g["lr"]) for g in groups for p in g["params"] if id(p) in names}


def mmengine_config(setup: Setup) -> dict[str, Any]:
    """The MMEngine config: optim_wrapper, param_scheduler, train_cfg, custom_hooks (EMAHook)."""
    wrapper = dict(
        type="AmpOptimWrapper" if setup.bf16 else "OptimWrapper",
        accumulative_counts=setup.accumulate,
        optimizer=dict(
            type="SGD", lr=setup.lr, momentum=setup.momentum, weight_decay=setup.weight_decay
        ),
        clip_grad=dict(max_norm=setup.max_norm),
        paramwise_cfg=dict(
            norm_decay_mult=0.0, custom_keys={"head": dict(lr_mult=setup.head_lr_mult)}
        ),
    )
    if setup.bf16:
        wrapper["dtype"] = "bfloat16"
    end, cosine_len = setup.warmup_end, setup.iters - setup.warmup_end
    schedulers = [
        dict(type="LinearLR", start_factor=setup.start_factor, by_epoch=False, begin=0, end=end),
        dict(
            type="CosineAnnealingLR",
            T_max=cosine_len,
            eta_min=setup.eta_min,
            by_epoch=False,
            begin=end,
            end=setup.iters,
        ),
    ]
    return dict(
        optim_wrapper=wrapper,
        param_scheduler=schedulers,
        train_cfg=dict(by_epoch=False, max_iters=setup.iters),
        custom_hooks=[dict(type="EMAHook", momentum=setup.ema_momentum)],
    )


def recorder(records: list[Record]) -> Any:
    """An MMEngine hook appending a :class:`Record` after every iteration."""
    from mmengine.hooks import Hook

    class Recorder(Hook):
        priority = "LOWEST"  # after EMAHook and the optimizer update

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            model = runner.model
            self.lrs = _lrs(model, runner.optim_wrapper.optimizer.param_groups)

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            ema = next(h for h in runner.hooks if type(h).__name__ == "EMAHook").ema_model
            model = runner.model
            records.append(
                Record(
                    runner.iter,
                    self.lrs,
                    _named(model, model.named_parameters()),
                    _named(model, ema.module.named_parameters()),
                )
            )

    return Recorder()


def run_mmengine(
    setup: Setup,
    work_dir: Path,
    default_hooks: dict | None = None,
    config: dict[str, Any] | None = None,
    validation: dict[str, Any] | None = None,
) -> tuple[list[Record], Any]:
    """Train with the real MMEngine ``Runner``; the per-iteration records and the runner.

    ``config``: ``optim_wrapper``, ``param_scheduler``, ``train_cfg`` and ``custom_hooks``
    (an ``EMAHook`` among them) in place of :func:`mmengine_config`'s; ``validation``:
    :func:`mmengine_validation`'s."""
    records: list[Record] = []
    cfg = config or mmengine_config(setup)
    val = dict(validation or {})
    train_cfg = dict(cfg["train_cfg"])
    if val:
        train_cfg["val_interval"] = val.pop("val_interval")
    hooks = dict(
        checkpoint=dict(type="CheckpointHook", interval=10**6, by_epoch=False),
        logger=dict(type="LoggerHook", interval=10**6),
    )
    hooks.update(default_hooks or {})
    with mmengine_on_cpu() as mm_runner:
        runner = mm_runner.Runner(
            model=make_net(),
            work_dir=str(work_dir),
            experiment_name=f"ftrain-ref-{uuid.uuid4().hex[:8]}",
            train_dataloader=loader(),
            optim_wrapper=cfg["optim_wrapper"],
            param_scheduler=cfg["param_scheduler"],
            train_cfg=train_cfg,
            custom_hooks=[*cfg["custom_hooks"], recorder(records)],
            default_hooks=hooks,
            log_level="ERROR",
            **val,
        )
        runner.train()
    return records, runner


def runner_lrs(
    param_scheduler: list[dict], work_dir: Path, *, epochs: int, batches: int, lr: float = 0.1
) -> list[float]:
    """The learning rate the real ``Runner`` gives each iteration (SGD, epoch-based loop)."""
    from mmengine.hooks import Hook

    lrs: list[float] = []

    class Recorder(Hook):
        def before_train_iter(self, runner, batch_idx, data_batch=None):
            lrs.append(runner.optim_wrapper.optimizer.param_groups[0]["lr"])

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(batches, 8), torch.zeros(batches, 4)),
        batch_size=1,
    )
    with mmengine_on_cpu() as mm_runner:
        mm_runner.Runner(
            model=make_net(),
            work_dir=str(work_dir),
            experiment_name=f"ftrain-lrs-{uuid.uuid4().hex[:8]}",
            train_dataloader=data,
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=lr)),
            param_scheduler=param_scheduler,
            train_cfg=dict(by_epoch=True, max_epochs=epochs),
            custom_hooks=[Recorder()],
            default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=10**6)),
            log_level="ERROR",
        ).train()
    return lrs


def ftrain_schedule(setup: Setup) -> S.Schedule:
    """``LinearLR(start_factor, begin=0, end=E)`` + ``CosineAnnealingLR(T_max, eta_min, begin=E,
    end=iters)``, per docs/migration.md: a warmup over ``E - 1`` steps, then the cosine."""
    end = setup.warmup_end
    if setup.count == "updates":  # the same run counted in updates: lengths divided by N
        end //= setup.accumulate
    total = setup.iters if setup.count == "micro_batches" else setup.iters // setup.accumulate
    warm = S.warmup(S.constant(setup.lr), iters=end - 1, ratio=setup.start_factor)
    return S.join([warm, S.cosine(setup.lr, total - end, final=setup.eta_min)], [end])


def build_ftrain(setup: Setup, model: torch.nn.Module, loss_fn: Any) -> tuple[Any, Any]:
    """The step and state docs/migration.md's rows give for :func:`mmengine_config`."""
    groups = param_groups(
        model,
        lr=setup.lr,
        weight_decay=setup.weight_decay,
        norm_decay_mult=0.0,
        custom_keys={"head": dict(lr_mult=setup.head_lr_mult)},
        merge=False,
    )
    optimizer = torch.optim.SGD(groups, lr=setup.lr, momentum=setup.momentum)
    step = ftrain.make_step(loss_fn)
    if setup.bf16:
        step = ftrain.with_amp(step, "bf16")
    step = ftrain.with_grad_accum(step, every=setup.accumulate)
    step = ftrain.with_clip(step, "norm", max_norm=setup.max_norm)
    step = ftrain.with_schedule(step, lr=ftrain_schedule(setup), count=setup.count)
    step = ftrain.with_ema(step, decay=1 - setup.ema_momentum, count=setup.count)
    return step, ftrain.TrainState.create(model, optimizer)


def run_ftrain(
    setup: Setup,
    work_dir: Path | None = None,
    hooks: Sequence[Any] = (),
    build: Any = None,
) -> tuple[list[Record], ftrain.TrainState]:
    """Train with ftrain configured per docs/migration.md; the per-micro-batch records.

    ``build(model, loss_fn) -> (step, state)`` in place of :func:`build_ftrain`."""
    model = make_net()
    seen: list[dict[str, float]] = []
    live: dict[str, Any] = {}

    def loss_fn(model, batch):
        seen.append(_lrs(model, live["optimizer"].param_groups))  # what this forward sees
        x, y = batch
        return model(x, y)["loss"]

    if build is None:
        step, state = build_ftrain(setup, model, loss_fn)
    else:
        step, state = build(model, loss_fn)
    live["optimizer"] = state.optimizer
    updates = setup.iters // setup.accumulate
    lp = ftrain.Loop(step, state, loader(), list(hooks), max_steps=updates, work_dir=work_dir)
    records = []
    for ev in lp:
        if type(ev) is StepEnd:
            ema = ev.state.transforms["ema"].params
            weights = _named(model, model.named_parameters())
            records.append(Record(len(records), seen[-1], weights, _named(model, ema.items())))
    return records, lp.state


def max_differences(a: Sequence[Record], b: Sequence[Record]) -> dict[str, float]:
    """The largest absolute difference of learning rates, weights and EMA weights."""
    assert [r.iteration for r in a] == [r.iteration for r in b]
    out = {"lr": 0.0, "weights": 0.0, "ema": 0.0}
    for x, y in zip(a, b, strict=True):
        assert x.lrs.keys() == y.lrs.keys() and x.weights.keys() == y.weights.keys()
        out["lr"] = max(out["lr"], *(abs(x.lrs[k] - y.lrs[k]) for k in x.lrs))
        for what in ("weights", "ema"):
            mine, theirs = getattr(x, what), getattr(y, what)
            diff = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
            out[what] = max(out[what], diff)
    return out
