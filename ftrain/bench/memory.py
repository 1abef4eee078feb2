"""``python -m ftrain.bench memory``: activation checkpoint plans, conv-bn eval, accumulation.

Example:
    >>> from ftrain.bench.models import ModelSpec
    >>> spec = ModelSpec("mlp", batch_size=8, width=16, layers=2)
    >>> res = run_memory(MemoryConfig([spec], warmup=1, repeats=2, budgets=(0.5,)))
    >>> [r["variant"] for r in res["results"]]  # doctest: +NORMALIZE_WHITESPACE
    ['none', 'every block', 'every other block', 'selective', 'dynamic 50%',
     'batch 8', 'batch 4 x accum 2', 'batch 2 x accum 4']
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
from torch import nn

import ftrain
from ftrain.bench.models import ModelSpec
from ftrain.bench.report import fmt_mib, fmt_stats, format_table, progress_bar, pyplot
from ftrain.bench.timing import Timed, cuda_peak, interleave
from ftrain.bench.verdict import fmt_ratio
from ftrain.memory import dynamic, pattern, selective
from ftrain.transforms.conv_bn import with_efficient_conv_bn_eval
from ftrain.transforms.remat import with_activation_checkpoint

__all__ = ["MemoryConfig", "run_memory", "memory_table", "plot_memory"]

LR, MOMENTUM = 0.01, 0.9

Decorate = Callable[[ftrain.step.Step, bool], ftrain.step.Step]


@dataclass
class MemoryConfig:
    """What ``memory`` measures: the options of ``python -m ftrain.bench memory --help``.

    Example:
        >>> from ftrain.bench.models import default_spec
        >>> MemoryConfig([default_spec("mlp", quick=True)], budgets=(0.3,)).accum
        (1, 2, 4)
    """

    specs: Sequence[ModelSpec]
    device: torch.device | str = "cpu"
    budgets: Sequence[float] = (0.5, 0.25)
    accum: Sequence[int] = (1, 2, 4)
    warmup: int = 2
    repeats: int = 10
    dynamic_warmup: int = 3
    conv_bn: bool = True
    max_seconds: float | None = None


@dataclass
class _Variant:
    """One model + step of one variant, set up (warmed up, measured) by :meth:`setup`."""

    spec: ModelSpec
    group: str
    name: str
    decorate: Decorate
    accum: int = 1
    frozen_bn: bool = False
    budget: float | None = None
    extra_warmup: int = 0
    bytes: int = 0
    ckpt: int = 0
    warned: bool = False
    peak: int | None = None
    timed: Timed | None = None

    def units(self, cfg: MemoryConfig) -> int:
        """Units (optimizer updates) this variant runs in total: for the progress bar."""
        cuda = torch.device(cfg.device).type == "cuda"
        return cfg.warmup + self.extra_warmup + 1 + int(cuda) + cfg.repeats

    def setup(self, cfg: MemoryConfig, tick: Callable[[], None]) -> None:
        dev = torch.device(cfg.device)
        spec = self.spec
        model = spec.build().to(dev)
        if self.frozen_bn:
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        box = [ftrain.TrainState.create(model, opt)]
        x, y = spec.batch(device=dev)
        k = self.accum
        m = spec.batch_size // k
        # the same B samples, as k separate (cloned: no shared storage) micro-batches
        micro = [(x[i * m : (i + 1) * m].clone(), y[i * m : (i + 1) * m].clone()) for i in range(k)]
        base = ftrain.make_step(spec.loss)
        if k > 1:
            base = ftrain.with_grad_accum(base, every=k)
        plain, monitored = self.decorate(base, False), self.decorate(base, True)

        def unit(first: ftrain.step.Step = plain) -> Any:
            metrics = None
            for i, b in enumerate(micro):
                box[0], mt = (first if i == 0 else plain)(box[0], b)
                metrics = mt if i == 0 else metrics
            return metrics

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(cfg.warmup + self.extra_warmup):
                unit()
                tick()
            metrics = unit(monitored)
            tick()
        self.warned = any("dynamic checkpoint" in str(w.message) for w in caught)
        for w in caught:
            if "dynamic checkpoint" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.bytes = int(metrics["activation_bytes"])
        self.ckpt = int(metrics["checkpointed_modules"])
        if dev.type == "cuda":
            self.peak = cuda_peak(dev, unit)
            tick()
        self.timed = Timed(f"{spec.kind}/{self.name}", unit, dev, cfg.max_seconds)

    def row(self, ref: _Variant) -> dict[str, Any]:
        assert self.timed is not None and ref.timed is not None
        st = self.timed.stats()
        ms = st.scaled(1e3)
        ref_ms = ref.timed.stats().median * 1e3
        b = self.spec.batch_size
        over = self.budget is not None and self.bytes > self.budget
        return {
            "model": self.spec.kind,
            "group": self.group,
            "variant": self.name,
            "batch_size": b // self.accum,
            "accum": self.accum,
            "effective_batch": b,
            "checkpointed_modules": self.ckpt,
            "activation_bytes": self.bytes,
            "activation_ratio": self.bytes / ref.bytes if ref.bytes else None,
            "budget_bytes": self.budget,
            "over_budget": over if self.budget is not None else None,
            "unreachable": (over or self.warned) if self.budget is not None else None,
            "planner_warned": self.warned if self.budget is not None else None,
            **ms.as_dict("step_ms"),
            "time_ratio": ms.median / ref_ms if ref_ms else None,
            "us_per_sample": ms.median * 1e3 / b,
            "peak_bytes": self.peak,
            "timed_units": st.n,
            "capped": self.timed.capped,
            "times_s": list(self.timed.times),
        }


def _ckpt(plan: Any) -> Decorate:
    return lambda step, monitor: with_activation_checkpoint(step, plan, monitor=monitor)


def _conv_bn(on: bool) -> Decorate:
    return lambda step, monitor: with_activation_checkpoint(
        with_efficient_conv_bn_eval(step) if on else step, [], monitor=monitor
    )


def _variants(spec: ModelSpec, cfg: MemoryConfig) -> tuple[_Variant, list[_Variant]]:
    """``none`` and the variants that do not depend on its measurement."""
    blocks = pattern(under="blocks", level=1)
    plans = {
        "every block": blocks,
        "every other block": pattern(under="blocks", level=1, every=2),
        "selective": selective(blocks),
    }
    none = _Variant(spec, "checkpoint", "none", _ckpt([]))
    rest = [_Variant(spec, "checkpoint", name, _ckpt(plan)) for name, plan in plans.items()]
    if cfg.conv_bn and spec.has_batchnorm:
        for word, on in (("off", False), ("on", True)):
            name = f"bn frozen, conv-bn eval {word}"
            rest.append(_Variant(spec, "conv-bn", name, _conv_bn(on), frozen_bn=True))
    b = spec.batch_size
    for k in sorted(set(cfg.accum) - {1}):
        rest.append(_Variant(spec, "accum", f"batch {b // k} x accum {k}", _ckpt([]), accum=k))
    return none, rest


def _dynamic_variants(spec: ModelSpec, cfg: MemoryConfig, none_bytes: int) -> list[_Variant]:
    blocks = pattern(under="blocks", level=1)
    out, extra = [], max(0, cfg.dynamic_warmup + 1 - cfg.warmup)
    for frac in cfg.budgets:
        budget = int(frac * none_bytes)
        plan = dynamic(budget, warmup_iters=cfg.dynamic_warmup, candidates=blocks, measure="saved")
        name = f"dynamic {frac * 100:g}%"
        out.append(
            _Variant(spec, "checkpoint", name, _ckpt(plan), budget=budget, extra_warmup=extra)
        )
    return out


def run_memory(cfg: MemoryConfig, progress: Any = None) -> dict[str, Any]:
    """Measure every variant of every model; returns ``{"results": [row, ...]}``.

    Example:
        >>> from ftrain.bench.models import ModelSpec
        >>> spec = ModelSpec("mlp", batch_size=4, width=8, layers=2)
        >>> rows = run_memory(MemoryConfig([spec], warmup=1, repeats=1, budgets=(), accum=(1,)))
        >>> [(r["variant"], r["activation_bytes"] > 0) for r in rows["results"]][:2]
        [('none', True), ('every block', True)]
    """
    for spec in cfg.specs:
        for k in cfg.accum:
            if k < 1 or spec.batch_size % k:
                raise ValueError(
                    f"{spec.kind}: batch size {spec.batch_size} is not divisible by accum {k}"
                )
    rows: list[dict[str, Any]] = []

    progress = progress if progress is not None else progress_bar(0, "memory", enabled=False)
    tick = progress.update  # tick(): one unit done
    for spec in cfg.specs:
        none, rest = _variants(spec, cfg)
        dyn_units = len(cfg.budgets) * (
            none.units(cfg) + max(0, cfg.dynamic_warmup + 1 - cfg.warmup)
        )
        units = none.units(cfg) + dyn_units + sum(v.units(cfg) for v in rest)
        progress.total = (progress.total or 0) + units
        progress.set_description(f"memory {spec.kind}: set-up")
        none.setup(cfg, tick)
        rest = rest[:3] + _dynamic_variants(spec, cfg, none.bytes) + rest[3:]
        for v in rest:
            v.setup(cfg, tick)
        variants = [none, *rest]  # in table order: checkpoint, conv-bn, accum
        progress.set_description(f"memory {spec.kind}: timing")
        interleave([v.timed for v in variants if v.timed], cfg.repeats, on_unit=lambda _: tick())
        refs = {"conv-bn": next((v for v in rest if v.group == "conv-bn"), none)}
        rows += [v.row(refs.get(v.group, none)) for v in variants if v.group != "accum"]
        accum_rows = [v for v in rest if v.group == "accum"]
        if accum_rows:
            full = none.row(none)
            full.update(group="accum", variant=f"batch {spec.batch_size}")
            rows.append(full)
            rows += [v.row(none) for v in accum_rows]
    return {"results": rows}


def memory_table(rows: Sequence[dict[str, Any]], cuda: bool = False) -> str:
    """The console table of :func:`run_memory`'s rows, a block per model and group.

    Example:
        >>> row = {"model": "mlp", "group": "checkpoint", "variant": "none",
        ...        "checkpointed_modules": 0, "activation_bytes": 2**20, "activation_ratio": 1.0,
        ...        "budget_bytes": None, "unreachable": None, "step_ms": 2.0, "step_ms_p25": 1.9,
        ...        "step_ms_p75": 2.1, "time_ratio": 1.0, "us_per_sample": 31.25,
        ...        "peak_bytes": None, "capped": False}
        >>> print(memory_table([row]))
        model  variant  ckpt  act MiB  act vs ref  budget MiB  step ms  p25-p75  time vs ref  us/sample  peak MiB
        -----  -------  ----  -------  ----------  ----------  -------  -------  -----------  ---------  --------
        mlp    none        0     1.00       1.00x           -      2.0  1.9-2.1        1.00x       31.2         -
    """
    headers = ["model", "variant", "ckpt", "act MiB", "act vs ref", "budget MiB", "step ms",
               "p25-p75", "time vs ref", "us/sample", "peak MiB"]  # fmt: skip

    def cells(r: dict[str, Any]) -> list[str]:
        budget = fmt_mib(r["budget_bytes"]) + (" (unreachable)" if r.get("unreachable") else "")
        med, spread = fmt_stats(r["step_ms"], r["step_ms_p25"], r["step_ms_p75"])
        act = "-" if r["activation_ratio"] is None else f"{r['activation_ratio']:.2f}x"
        peak = fmt_mib(r["peak_bytes"]) if cuda or r["peak_bytes"] is not None else "-"
        return [r["model"], r["variant"], str(r["checkpointed_modules"]),
                fmt_mib(r["activation_bytes"]), act, budget, med + ("*" if r.get("capped") else ""),
                spread, fmt_ratio(r["time_ratio"]), f"{r['us_per_sample']:.1f}", peak]  # fmt: skip

    groups = [[cells(r) for r in g] for _, g in groupby(rows, lambda r: (r["model"], r["group"]))]
    return format_table(headers, groups, left=2)


def plot_memory(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Activation MiB against step time (median, p25-p75 bars) per plan, one panel per model.

    Example:
        >>> plot_memory(rows, "memory.png")  # doctest: +SKIP
    """
    plt = pyplot()

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    markers = {"checkpoint": "o", "conv-bn": "s", "accum": "^"}
    for ax, model in zip(axes[0], models):
        # the accumulation block's "batch B" row is the "none" measurement: drawn once
        points = [
            r
            for r in rows
            if r["model"] == model and not (r["group"] == "accum" and r["accum"] == 1)
        ]
        labels: dict[tuple[float, float], list[str]] = {}
        for r in points:
            x = r["activation_bytes"] / 2**20
            y, lo, hi = r["step_ms"], r["step_ms_p25"], r["step_ms_p75"]
            ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], fmt=markers.get(r["group"], "o"),
                        capsize=3)  # fmt: skip
            # one label for points that coincide (e.g. dynamic 25% = every block)
            key = next(
                (k for k in labels if abs(k[0] - x) <= 0.01 * max(x, 1e-9)
                 and abs(k[1] - y) <= 0.03 * y),
                (x, y),
            )  # fmt: skip
            labels.setdefault(key, []).append(r["variant"])
        for (x, y), names in labels.items():
            ax.annotate(" / ".join(names), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)  # fmt: skip
        ax.set_title(model)
        ax.set_xlabel("activation memory (MiB saved for backward)")
        ax.set_ylabel("step time (ms per effective batch)")
        right = max((r["activation_bytes"] for r in points), default=1) / 2**20
        ax.set_xlim(0, right * 1.3)  # room for the labels
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
