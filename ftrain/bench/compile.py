"""``python -m ftrain.bench compile``: the whole compiled step vs eager and vs a compiled model.

Example:
    >>> from ftrain.bench.models import ModelSpec
    >>> cfg = CompileConfig([ModelSpec("mlp", batch_size=4, width=8, layers=1)], backend="eager",
    ...                     steps=1, repeats=2)
    >>> out = run_compile(cfg)  # doctest: +SKIP
    >>> sorted(out["results"][0])  # doctest: +SKIP
    ['compile_s', 'model', 'ms', 'ms_p25', 'ms_p75', 'speedup_vs_compiled_model', ...]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftrain.bench.models import ModelSpec
from ftrain.bench.report import fmt_stats, format_table
from ftrain.bench.timing import Timed, interleave, summarize

__all__ = ["VARIANTS", "CompileConfig", "run_compile", "compile_table", "profile_top_ops"]

VARIANTS = ("plain eager", "plain compile(model)", "ftrain eager", "ftrain compiled")
TARGET = 1.3  # ftrain compiled vs plain eager on the transformer (issue 14)
LR, MAX_NORM = 1e-3, 1.0


@dataclass(frozen=True)
class CompileConfig:
    """What :func:`run_compile` measures: the options of ``python -m ftrain.bench compile --help``."""

    specs: Sequence[ModelSpec]
    steps: int = 3
    repeats: int = 10
    warmup: int = 2
    backend: str = "inductor"
    mode: str | None = None
    max_seconds: float | None = None


def _plain(spec: ModelSpec, compiled: bool, cfg: CompileConfig) -> Callable[[int], None]:
    model = spec.build()
    if compiled:
        model = torch.compile(model, backend=cfg.backend, mode=cfg.mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = spec.batch()
    loss_fn = spec.loss

    def run(n: int) -> None:
        for _ in range(n):
            loss = loss_fn(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def _ftrain(spec: ModelSpec, compiled: bool, cfg: CompileConfig) -> Callable[[int], None]:
    import ftrain

    model = spec.build()
    box = [ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=LR))]
    step = ftrain.with_clip(ftrain.make_step(spec.loss), "norm", max_norm=MAX_NORM)
    if compiled:
        step = ftrain.with_compile(step, backend=cfg.backend, mode=cfg.mode)
    batch = spec.batch()

    def run(n: int) -> None:
        state = box[0]
        for _ in range(n):
            state, _ = step(state, batch)
        box[0] = state

    return run


def _build(name: str, spec: ModelSpec, cfg: CompileConfig) -> Callable[[int], None]:
    """The runner of variant ``name`` (one of :data:`VARIANTS`)."""
    return (_ftrain if name.startswith("ftrain") else _plain)(spec, "compile" in name, cfg)


def _paired(a: list[float], b: list[float]) -> float:
    """Median per-round ratio ``b / a`` (a speed-up of ``a`` over ``b``)."""
    pairs = [y / x for x, y in zip(a, b) if x > 0]
    return statistics.median(pairs) if pairs else float("nan")


def run_compile(cfg: CompileConfig, progress: Any = None) -> dict[str, Any]:
    """Time the four variants on each model; return ``{"results": [...], "targets": [...]}``."""
    import torch._dynamo

    results: list[dict[str, Any]] = []
    for spec in cfg.specs:
        torch._dynamo.reset()
        items, first = [], {}
        for name in VARIANTS:
            run = _build(name, spec, cfg)
            t0 = time.perf_counter()
            run(1)  # compiles, for the compiled variants
            first[name] = time.perf_counter() - t0
            run(cfg.warmup)
            items.append(Timed(name, lambda run=run: run(cfg.steps), max_seconds=cfg.max_seconds))
            if progress is not None:
                progress.update(1)
        interleave(items, cfg.repeats, on_unit=lambda _: progress and progress.update(0))
        per_step = {t.name: [x / cfg.steps for x in t.times] for t in items}
        for t in items:
            times = per_step[t.name]
            s = summarize(times).scaled(1e3)
            results.append(
                {
                    "model": spec.kind,
                    "variant": t.name,
                    **s.as_dict("ms"),
                    "speedup_vs_plain": _paired(times, per_step["plain eager"]),
                    "speedup_vs_compiled_model": _paired(times, per_step["plain compile(model)"]),
                    "first_call_s": first[t.name],
                    "compile_s": max(first[t.name] - statistics.median(times), 0.0),
                    "capped": t.capped,
                }
            )
    return {"results": results, "targets": check_targets(results)}


def check_targets(results: Sequence[dict[str, Any]]) -> list[str]:
    """Issue 14's targets on the transformer, each with its figure and OK/MISSED."""
    by = {(r["model"], r["variant"]): r for r in results}
    r = by.get(("transformer", "ftrain compiled"))
    if r is None:
        return []
    v, w = r["speedup_vs_plain"], r["speedup_vs_compiled_model"]
    return [
        f"ftrain compiled vs plain eager on transformer >= {TARGET}x: {v:.2f}x  "
        f"{'OK' if v >= TARGET else 'MISSED'}",
        f"ftrain compiled vs plain compile(model) on transformer > 1x: {w:.2f}x  "
        f"{'OK' if w > 1 else 'MISSED'}",
    ]


def compile_table(results: Sequence[dict[str, Any]]) -> str:
    """The results as an aligned table, one block per model."""
    groups: dict[str, list[list[str]]] = {}
    for r in results:
        med, spread = fmt_stats(r["ms"], r["ms_p25"], r["ms_p75"], digits=2)
        groups.setdefault(r["model"], []).append(
            [r["model"], r["variant"], med + ("*" if r["capped"] else ""), spread,
             f"{r['speedup_vs_plain']:.2f}x", f"{r['speedup_vs_compiled_model']:.2f}x",
             f"{r['first_call_s']:.1f}"])  # fmt: skip
    headers = ["model", "variant", "step ms", "p25-p75", "vs plain", "vs compile(model)", "1st s"]
    return format_table(headers, list(groups.values()), left=2)


def profile_top_ops(
    spec: ModelSpec, cfg: CompileConfig, steps: int = 5, top: int = 12
) -> dict[str, str]:
    """``torch.profiler`` top operators (self CPU time) of ``plain eager`` and ``ftrain compiled``."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in ("plain eager", "ftrain compiled"):
        run = _build(name, spec, cfg)
        run(1 + cfg.warmup)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(steps)
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return out
