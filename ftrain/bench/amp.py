"""``python -m ftrain.bench amp``: float32 vs bfloat16 vs float16 (dynamic loss scaling).

Example:
    >>> from ftrain.bench.models import ModelSpec
    >>> spec = ModelSpec("mlp", batch_size=8, width=16, layers=2)
    >>> res = run_amp(AmpConfig([spec], steps=3, repeats=2))
    >>> [(r["precision"], r["samples_per_s"] > 0) for r in res["results"]]
    [('fp32', True), ('bf16', True), ('fp16', True)]
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch

import ftrain
from ftrain.bench.models import ModelSpec
from ftrain.bench.report import fmt_mib, fmt_stats, format_table, progress_bar
from ftrain.bench.timing import Timed, cuda_peak, interleave, synchronize
from ftrain.bench.verdict import fmt_ratio
from ftrain.transforms.remat import with_activation_checkpoint

__all__ = ["PRECISIONS", "AmpConfig", "run_amp", "amp_table", "make_amp_step"]

#: The precisions, in table order.
PRECISIONS = ("fp32", "bf16", "fp16")
LR = 3e-3


def make_amp_step(spec: ModelSpec, precision: str) -> ftrain.step.Step:
    """The step of ``precision`` (``"fp32"``, ``"bf16"`` or ``"fp16"``) for ``spec``'s loss.

    Example:
        >>> from ftrain.bench.models import ModelSpec
        >>> make_amp_step(ModelSpec("mlp", 2, 4, 1), "fp16")["amp"]
        Amp(dtype=torch.float16, loss_scale='dynamic')
    """
    step = ftrain.make_step(spec.loss)
    if precision == "fp32":
        return step
    if precision == "bf16":
        return ftrain.with_amp(step, dtype=torch.bfloat16, loss_scale=None)
    if precision == "fp16":
        return ftrain.with_amp(step, dtype=torch.float16, loss_scale="dynamic")
    raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")


@dataclass
class AmpConfig:
    """What ``amp`` measures: the options of ``python -m ftrain.bench amp --help``.

    Example:
        >>> from ftrain.bench.models import default_spec
        >>> AmpConfig([default_spec("transformer", quick=True)], precisions=["fp32", "bf16"]).steps
        30
    """

    specs: Sequence[ModelSpec]
    device: torch.device | str = "cpu"
    precisions: Sequence[str] = PRECISIONS
    steps: int = 30
    warmup: int = 2
    repeats: int = 10
    max_seconds: float | None = None


class _Variant:
    def __init__(self, spec: ModelSpec, precision: str, cfg: AmpConfig) -> None:
        self.spec, self.precision, self.cfg = spec, precision, cfg
        self.dev = torch.device(cfg.device)
        model = spec.build().to(self.dev)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.box = [ftrain.TrainState.create(model, opt)]
        self.step = make_amp_step(spec, precision)
        self.monitored = with_activation_checkpoint(self.step, [], monitor=True)
        self.batch = spec.batch(device=self.dev)
        self.eval_batch = spec.batch(seed=999_999, device=self.dev)
        self.losses: list[float] = []
        self.trained = 0
        self.skipped = 0
        self.loss_scale: float | None = None
        self.bytes = 0
        self.peak: int | None = None
        self.spent = 0.0
        self.capped = False
        self.timed: Timed | None = None

    def eval_loss(self) -> float:
        model = self.box[0].model
        with torch.no_grad():
            return float(self.spec.loss(model, self.eval_batch))

    def _track(self, metrics: dict[str, Any]) -> None:
        if "skipped" in metrics:
            self.skipped += int(metrics["skipped"])
            self.loss_scale = float(metrics["loss_scale"])

    def train(self, tick: Any) -> None:
        """``steps`` (at least ``warmup``) steps on fresh batches; loss before and after."""
        cfg = self.cfg
        n = max(cfg.steps, cfg.warmup)
        self.losses.append(self.eval_loss())
        for i in range(n):
            if cfg.max_seconds is not None and i and self.spent * (i + 1) / i > cfg.max_seconds / 2:
                self.capped = True  # half the limit for training, half for timing
                break
            batch = self.spec.batch(seed=1 + i, device=self.dev)
            t0 = time.perf_counter()
            self.box[0], metrics = self.step(self.box[0], batch)
            self._track(metrics)
            synchronize(self.dev)
            self.spent += time.perf_counter() - t0
            self.trained += 1
            tick()
        self.losses.append(self.eval_loss())
        for _ in range(n - self.trained):
            tick()

    def measure(self, tick: Any) -> None:
        """Activation bytes (monitored step); on CUDA the peak of one step; the timer."""
        self.box[0], metrics = self.monitored(self.box[0], self.batch)
        self._track(metrics)
        self.bytes = int(metrics["activation_bytes"])
        tick()

        def unit(track: bool = False) -> None:
            self.box[0], metrics = self.step(self.box[0], self.batch)
            if track:  # not while timing: it reads the loss scale on the host
                self._track(metrics)

        if self.dev.type == "cuda":
            self.peak = cuda_peak(self.dev, lambda: unit(True))
            tick()

        limit = self.cfg.max_seconds
        self.timed = Timed(
            f"{self.spec.kind}/{self.precision}",
            unit,
            self.dev,
            None if limit is None else max(limit - self.spent, 0.0),
        )

    def row(self, ref: _Variant) -> dict[str, Any]:
        assert self.timed is not None and ref.timed is not None
        st = self.timed.stats().scaled(1e3)
        ref_ms = ref.timed.stats().median * 1e3
        samples_s = self.spec.batch_size / (st.median / 1e3) if st.n else math.nan
        row = {
            "model": self.spec.kind,
            "precision": self.precision,
            "batch_size": self.spec.batch_size,
            **st.as_dict("step_ms"),
            "samples_per_s": samples_s,
            "time_ratio": st.median / ref_ms if ref_ms else None,
            "activation_bytes": self.bytes,
            "activation_ratio": self.bytes / ref.bytes if ref.bytes else None,
            "peak_bytes": self.peak,
            "loss_start": self.losses[0],
            "loss_end": self.losses[-1],
            "loss_delta_vs_ref": self.losses[-1] - ref.losses[-1],
            "train_steps": self.trained,
            "skipped_updates": self.skipped,
            "loss_scale": self.loss_scale,
            "timed_steps": st.n,
            "capped": self.capped or self.timed.capped,
            "times_s": list(self.timed.times),
        }
        if self.spec.kind == "transformer":
            row["tokens_per_s"] = samples_s * self.spec.seq_len
        return row


def run_amp(cfg: AmpConfig, progress: Any = None) -> dict[str, Any]:
    """Train, measure and time every precision of every model; ``{"results": [row, ...]}``.

    Example:
        >>> from ftrain.bench.models import ModelSpec
        >>> spec = ModelSpec("mlp", batch_size=8, width=16, layers=2)
        >>> row = run_amp(AmpConfig([spec], precisions=["bf16"], steps=2, repeats=1))["results"][0]
        >>> row["precision"], row["train_steps"], math.isfinite(row["loss_end"])
        ('bf16', 2, True)
    """
    for p in cfg.precisions:
        if p not in PRECISIONS:
            raise ValueError(f"unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    cuda = torch.device(cfg.device).type == "cuda"
    n = max(cfg.steps, cfg.warmup)

    progress = progress if progress is not None else progress_bar(0, "amp", enabled=False)
    tick = progress.update  # tick(): one unit done
    rows: list[dict[str, Any]] = []
    for spec in cfg.specs:
        per = n + 1 + int(cuda) + cfg.repeats
        progress.total = (progress.total or 0) + per * len(cfg.precisions)
        progress.set_description(f"amp {spec.kind}: training")
        variants = [_Variant(spec, p, cfg) for p in cfg.precisions]
        for v in variants:
            v.train(tick)
            v.measure(tick)
        progress.set_description(f"amp {spec.kind}: timing")
        interleave([v.timed for v in variants if v.timed], cfg.repeats, on_unit=lambda _: tick())
        rows += [v.row(variants[0]) for v in variants]
    return {"results": rows}


def amp_table(rows: Sequence[dict[str, Any]], steps: int, cuda: bool = False) -> str:
    """The console table of :func:`run_amp`'s rows, a block per model.

    Example:
        >>> row = {"model": "mlp", "precision": "fp32", "step_ms": 2.0, "step_ms_p25": 1.9,
        ...        "step_ms_p75": 2.1, "samples_per_s": 32000.0, "time_ratio": 1.0,
        ...        "activation_bytes": 2**20, "activation_ratio": 1.0, "peak_bytes": None,
        ...        "loss_start": 2.5, "loss_end": 0.5, "train_steps": 30,
        ...        "skipped_updates": 0, "loss_scale": None, "capped": False}
        >>> print(amp_table([row], steps=30))
        model  precision  step ms  p25-p75  time vs fp32  samples/s  act MiB  act vs fp32  peak MiB  loss@0  loss@30  skipped
        -----  ---------  -------  -------  ------------  ---------  -------  -----------  --------  ------  -------  -------
        mlp    fp32           2.0  1.9-2.1         1.00x    32000.0     1.00        1.00x         -  2.5000   0.5000        -
    """
    ref = rows[0]["precision"] if rows else "fp32"
    headers = ["model", "precision", "step ms", "p25-p75", f"time vs {ref}", "samples/s",
               "act MiB", f"act vs {ref}", "peak MiB", "loss@0", f"loss@{steps}",
               "skipped"]  # fmt: skip

    def cells(r: dict[str, Any]) -> list[str]:
        med, spread = fmt_stats(r["step_ms"], r["step_ms_p25"], r["step_ms_p75"])
        loss_end = f"{r['loss_end']:.4f}"
        if r["train_steps"] != steps:
            loss_end += f" @{r['train_steps']}"
        act = "-" if r["activation_ratio"] is None else f"{r['activation_ratio']:.2f}x"
        peak = fmt_mib(r["peak_bytes"]) if cuda or r["peak_bytes"] is not None else "-"
        skipped = "-" if r["loss_scale"] is None else f"{r['skipped_updates']}"
        return [r["model"], r["precision"], med + ("*" if r.get("capped") else ""), spread,
                fmt_ratio(r["time_ratio"]), f"{r['samples_per_s']:.1f}",
                fmt_mib(r["activation_bytes"]), act, peak, f"{r['loss_start']:.4f}", loss_end,
                skipped]  # fmt: skip

    groups = [[cells(r) for r in g] for _, g in groupby(rows, lambda r: r["model"])]
    return format_table(headers, groups, left=2)


def plot_amp(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Step time per precision (median with p25-p75 bars), one panel per model (matplotlib).

    Example:
        >>> plot_amp(rows, "amp.png")  # doctest: +SKIP
    """
    from ftrain.bench.report import plot_bars

    keys = ("model", "precision", "step_ms", "step_ms_p25", "step_ms_p75")
    plot_bars(rows, keys, path, ylabel="ms per step", title=title)
