"""``python -m ftrain.bench compile``: the compiled step vs eager, vs a compiled model, and
vs a compiled model with a compiled update (the baseline of its compile time).

Example:
    >>> from ftrain.bench.models import ModelSpec
    >>> cfg = CompileConfig([ModelSpec("mlp", batch_size=4, width=8, layers=1)], backend="eager",
    ...                     steps=1, repeats=2)
    >>> out = run_compile(cfg)  # doctest: +SKIP
    >>> sorted(out["results"][0])  # doctest: +SKIP
    ['capped', 'first_call_s', 'model', 'ms', 'ms_p25', 'ms_p75', ...]
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ftrain.bench.models import ModelSpec
from ftrain.bench.report import fmt_stats, format_table
from ftrain.bench.timing import Timed, interleave, summarize
from ftrain.bench.verdict import Interval, Target, judge, median_interval, paired

__all__ = [
    "VARIANTS", "BASELINE", "CompileConfig", "run_compile", "compile_table", "cold_table",
    "profile_top_ops", "heavy_share", "check_targets", "cpu_seconds", "quick_specs", "run_cli",
]  # fmt: skip

BASELINE = "compile(model)+update"
VARIANTS = ("plain eager", "plain compile(model)", BASELINE, "ftrain eager", "ftrain compiled")
COLD_TARGET = 1.5  # ftrain compiled's first step vs the baseline's (issue 20)
GAIN_SHARE = 0.5  # of the speed-up compile can give at most on the transformer (issue 20)
LR, MAX_NORM = 1e-3, 1.0
#: Operators compile cannot speed up on the CPU: matrix products and attention kernels.
HEAVY_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "scaled_dot_product")


@dataclass(frozen=True)
class CompileConfig:
    """What :func:`run_compile` measures: the options of ``python -m ftrain.bench compile --help``.

    ``cold_pairs``: extra cold compiles of the baseline and ``ftrain compiled`` (alternating,
    fresh caches) for a paired ratio; ``static_cold``: also the cold compile of ``ftrain
    compiled`` with ``dynamic_batch=False`` (the dynamic batch's share of it);
    ``fresh_caches``: empty inductor's caches for each first step (``False``: the caches as
    found, e.g. warm from an earlier run)."""

    specs: Sequence[ModelSpec]
    steps: int = 3
    repeats: int = 10
    warmup: int = 2
    backend: str = "inductor"
    mode: str | None = None
    max_seconds: float | None = None
    cold_pairs: int = 1
    static_cold: bool = True
    fresh_caches: bool = True


#: The order the variants are built and first called in: the baseline first, after a reset
#: of dynamo (nothing compiled before it), then ``ftrain compiled`` (its programs are its own):
#: both first calls are cold compiles, the first pair of the paired ratio.
BUILD_ORDER = (BASELINE, "ftrain compiled", "plain compile(model)", "plain eager", "ftrain eager")


@contextlib.contextmanager
def cold(reset: bool = True, fresh: bool = True) -> Iterator[None]:
    """A cold compile: inductor's on-disk and in-memory caches fresh (``fresh``); ``reset``:
    dynamo's too (every function compiled before recompiles at its next call)."""
    import torch._dynamo
    from torch._inductor.utils import fresh_cache

    if reset:
        torch._dynamo.reset()
    with fresh_cache() if fresh else contextlib.nullcontext():
        yield


def _plain(spec: ModelSpec, cfg: CompileConfig, model_c: bool, update_c: bool):
    """A plain loop: the model compiled or not, clip + AdamW compiled or not."""
    model = spec.build()
    run_model = torch.compile(model, backend=cfg.backend, mode=cfg.mode) if model_c else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batch, loss_fn = spec.batch(), spec.loss

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()

    if update_c:
        update = torch.compile(update, backend=cfg.backend, mode=cfg.mode)

    def run(n: int) -> None:
        for _ in range(n):
            loss_fn(run_model, batch).backward()
            update()
            opt.zero_grad(set_to_none=True)

    return run


def _ftrain(spec: ModelSpec, cfg: CompileConfig, compiled: bool, dynamic: bool | None = None):
    import ftrain

    model = spec.build()
    box = [ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=LR))]
    step = ftrain.with_clip(ftrain.make_step(spec.loss), "norm", max_norm=MAX_NORM)
    if compiled:
        step = ftrain.with_compile(step, backend=cfg.backend, mode=cfg.mode, dynamic_batch=dynamic)
    batch = spec.batch()

    def run(n: int) -> None:
        state = box[0]
        for _ in range(n):
            state, _ = step(state, batch)
        box[0] = state

    return run


def _build(name: str, spec: ModelSpec, cfg: CompileConfig) -> Callable[[int], None]:
    """The runner of variant ``name`` (one of :data:`VARIANTS`)."""
    if name.startswith("ftrain"):
        return _ftrain(spec, cfg, name == "ftrain compiled")
    return _plain(spec, cfg, "compile" in name, name == BASELINE)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (inductor's ``g++``), user + system:
    what a compile costs whatever else the machine runs (its wall time on an idle machine,
    with ``TORCHINDUCTOR_COMPILE_THREADS=1``).

    Example:
        >>> cpu_seconds() > 0
        True
    """
    import resource

    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _first_call(
    run: Callable[[int], None], reset: bool = True, fresh: bool = True
) -> tuple[float, float]:
    """Wall and CPU seconds of ``run``'s first step, compiled cold."""
    with cold(reset, fresh):
        t0, c0 = time.perf_counter(), cpu_seconds()
        run(1)
        return time.perf_counter() - t0, cpu_seconds() - c0


def _paired(a: list[float], b: list[float]) -> float:
    """Median per-round ratio ``b / a`` (a speed-up of ``a`` over ``b``)."""
    pairs = [y / x for x, y in zip(a, b) if x > 0]
    return statistics.median(pairs) if pairs else float("nan")


def _time_variants(spec: ModelSpec, cfg: CompileConfig, progress: Any) -> list[dict[str, Any]]:
    """Every variant's cold first step, then interleaved timed rounds: one row each."""
    items, first, cpu = [], {}, {}
    for name in BUILD_ORDER:
        run = _build(name, spec, cfg)
        first[name], cpu[name] = _first_call(run, name == BUILD_ORDER[0], cfg.fresh_caches)
        run(cfg.warmup)
        items.append(Timed(name, lambda run=run: run(cfg.steps), max_seconds=cfg.max_seconds))
        if progress is not None:
            progress.update(1)
    interleave(items, cfg.repeats, on_unit=lambda _: progress and progress.update(0))
    per_step = {t.name: [x / cfg.steps for x in t.times] for t in items}
    rows = []
    for t in sorted(items, key=lambda t: VARIANTS.index(t.name)):
        times = per_step[t.name]
        rows.append({
            "model": spec.kind,
            "variant": t.name,
            **summarize(times).scaled(1e3).as_dict("ms"),
            "speedup_vs_plain": _paired(times, per_step["plain eager"]),
            "speedup_vs_compiled_model": _paired(times, per_step["plain compile(model)"]),
            "round_ms": [x * 1e3 for x in times],
            "first_call_s": first[t.name],
            "first_call_cpu_s": cpu[t.name],
            "compile_s": max(first[t.name] - statistics.median(times), 0.0),
            "capped": t.capped,
        })  # fmt: skip
    return rows


def _cold(spec: ModelSpec, cfg: CompileConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Cold compile seconds (wall, CPU) of the baseline and ``ftrain compiled`` (the timing
    run's, then ``cold_pairs`` more pairs), the median paired ratio of their CPU seconds, and
    the static batch's."""
    by = {r["variant"]: r for r in rows}
    base = [(by[BASELINE]["first_call_s"], by[BASELINE]["first_call_cpu_s"])]
    ours = [(by["ftrain compiled"]["first_call_s"], by["ftrain compiled"]["first_call_cpu_s"])]
    for _ in range(cfg.cold_pairs):
        base.append(_first_call(_build(BASELINE, spec, cfg)))
        ours.append(_first_call(_build("ftrain compiled", spec, cfg)))
    static = _first_call(_ftrain(spec, cfg, True, dynamic=False)) if cfg.static_cold else None
    ratio = statistics.median(o[1] / b[1] for b, o in zip(base, ours))
    share = None if static is None else 1.0 - static[1] / statistics.median(o[1] for o in ours)
    return {"model": spec.kind, "baseline_s": [b[0] for b in base],
            "baseline_cpu_s": [b[1] for b in base], "ftrain_s": [o[0] for o in ours],
            "ftrain_cpu_s": [o[1] for o in ours], "ratio": ratio,
            "static_cpu_s": None if static is None else static[1],
            "dynamic_share": share}  # fmt: skip


def heavy_share(spec: ModelSpec, cfg: CompileConfig, steps: int = 3) -> float:
    """The share of a plain eager step in :data:`HEAVY_OPS` (self CPU time over wall time):
    compile leaves them as they are, so ``1 / share`` bounds its speed-up."""
    from torch.profiler import ProfilerActivity, profile

    run = _build("plain eager", spec, cfg)
    run(1 + cfg.warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - t0
    heavy = sum(
        e.self_cpu_time_total for e in prof.key_averages() if any(h in e.key for h in HEAVY_OPS)
    )
    return min(1.0, heavy / 1e6 / wall)


def run_compile(cfg: CompileConfig, progress: Any = None, quick: bool = False) -> dict[str, Any]:
    """Time the variants on each model; ``{"results", "cold", "heavy_share", "targets"}``
    (``heavy_share``: of the first model).

    ``quick``: small models: the targets are printed, not judged."""
    results, colds = [], []
    for spec in cfg.specs:
        rows = _time_variants(spec, cfg, progress)
        results += rows
        colds.append(_cold(spec, cfg, rows))
    share = heavy_share(cfg.specs[0], cfg)
    out = {"results": results, "cold": colds, "heavy_share": share}
    return {**out, "targets": check_targets(results, colds, share, quick=quick)}


def check_targets(
    results: Sequence[dict[str, Any]],
    colds: Sequence[dict[str, Any]],
    share: float | None,
    *,
    quick: bool = False,
) -> list[str]:
    """Issue 20's targets on the transformer, each judged on its paired interval
    (:mod:`ftrain.bench.verdict`; ``quick``: "not judged", they are the full-size model's).

    Example:
        >>> rows = [{"model": "transformer", "variant": v, "round_ms": ms} for v, ms in
        ...         (("plain eager", [2.0] * 5), ("plain compile(model)", [1.5] * 5),
        ...          ("ftrain compiled", [1.0] * 5))]
        >>> cold = [{"model": "transformer", "baseline_cpu_s": [10.0], "ftrain_cpu_s": [12.0]}]
        >>> for line in check_targets(rows, cold, 0.8):
        ...     print(line)  # doctest: +ELLIPSIS
        ftrain compiled vs plain eager on transformer ... >= 1.12x: 2.00x (...) OK
        ftrain compiled vs plain compile(model) on transformer >= 1.00x: 1.50x (...) OK
        ftrain compiled's cold first step vs compile(model)+update on transformer (CPU seconds) \
<= 1.50x: 1.20x (...) inconclusive: ...
    """
    by = {(r["model"], r["variant"]): r for r in results}
    ours = by.get(("transformer", "ftrain compiled"))
    c = next((c for c in colds if c["model"] == "transformer"), None)
    if ours is None or c is None:
        return []
    bound = math.nan if not share else 1.0 / share
    want = 1.0 + GAIN_SHARE * (bound - 1.0)

    def speedup(variant: str) -> Interval:
        base = by[("transformer", variant)]["round_ms"]
        return median_interval(paired(base, ours["round_ms"], "ratio"))

    cold = paired(c["ftrain_cpu_s"], c["baseline_cpu_s"], "ratio")
    goals = [
        (Target(f"ftrain compiled vs plain eager on transformer (of at most {bound:.2f}x: "
                f"matrix products and attention {share or math.nan:.0%} of the eager step; "
                "half the possible gain)", want, "x", "higher", True), speedup("plain eager")),
        (Target("ftrain compiled vs plain compile(model) on transformer", 1.0, "x", "higher",
                True), speedup("plain compile(model)")),
        (Target(f"ftrain compiled's cold first step vs {BASELINE} on transformer (CPU seconds)",
                COLD_TARGET, "x", "lower", True), median_interval(cold)),
    ]  # fmt: skip
    return [judge(t, iv, quick=quick).line() for t, iv in goals]


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


def cold_table(colds: Sequence[dict[str, Any]]) -> str:
    """Cold compile CPU seconds (wall seconds in brackets): the baseline, ``ftrain compiled``,
    their ratio, the static batch and the dynamic batch's share."""

    def both(cpu: list[float], wall: list[float]) -> str:
        return " ".join(f"{c:.1f} ({w:.0f})" for c, w in zip(cpu, wall))

    rows = []
    for c in colds:
        static = "-" if c["static_cpu_s"] is None else f"{c['static_cpu_s']:.1f}"
        share = "-" if c["dynamic_share"] is None else f"{c['dynamic_share']:.0%}"
        rows.append([c["model"], both(c["baseline_cpu_s"], c["baseline_s"]),
                     both(c["ftrain_cpu_s"], c["ftrain_s"]), f"{c['ratio']:.2f}x", static,
                     share])  # fmt: skip
    headers = ["model", f"{BASELINE} s", "ftrain compiled s", "ratio", "static batch s",
               "dynamic share"]  # fmt: skip
    return format_table(headers, [rows], left=1)


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


def quick_specs(args: Any, specs: Sequence[ModelSpec]) -> list[ModelSpec]:
    """``--quick``: the transformer with one block and 32 tokens unless the sizes are given
    (compiling dominates a quick run).

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(quick=True, layers=None, seq_len=None)
        >>> spec = ModelSpec("transformer", batch_size=8, width=64, layers=4, seq_len=64)
        >>> [(s.layers, s.seq_len) for s in quick_specs(args, [spec])]
        [(1, 32)]
    """
    if not args.quick:
        return list(specs)
    return [replace(s, layers=args.layers or 1, seq_len=args.seq_len or 32)
            if s.kind == "transformer" else s for s in specs]  # fmt: skip


def run_cli(args: Any, specs: Sequence[ModelSpec], repeats: int, warmup: int,
            max_seconds: float | None, bar: Any) -> tuple[dict, str, dict, list[str]]:  # fmt: skip
    """``python -m ftrain.bench compile``: ``(results, table, config, notes)`` for the CLI."""
    steps = args.steps or (1 if args.quick else 3)
    pairs = (0 if args.quick else 1) if args.cold_pairs is None else args.cold_pairs
    cfg = CompileConfig(specs, steps, repeats, warmup, args.backend, args.mode, max_seconds,
                        cold_pairs=pairs, static_cold=not args.quick,
                        fresh_caches=not args.quick)  # fmt: skip
    with bar:
        out = run_compile(cfg, progress=bar, quick=args.quick)
    table = compile_table(out["results"]) + "\n\ncold compile:\n" + cold_table(out["cold"])
    config = {"steps": steps, "warmup": warmup, "repeats": repeats, "backend": args.backend,
              "mode": args.mode, "max_seconds": max_seconds, "cold_pairs": pairs}  # fmt: skip
    if args.profile or any("MISSED" in line for line in out["targets"]):
        out["profile"] = profile_top_ops(specs[0], cfg)
    share = out["heavy_share"]
    notes = [
        f"step ms: median time of one training step (p25-p75 over {repeats} interleaved "
        f"rounds of {steps} step(s)); vs plain / vs compile(model): median per-round "
        "speed-up over the plain eager loop / the plain loop over torch.compile(model); "
        f"{BASELINE}: that loop with clip_grad_norm_ + AdamW.step compiled too",
        "1st s: seconds of the first step; cold compile: the first step of "
        f"{BASELINE} and of ftrain compiled with every compiler cache empty (--quick: "
        "inductor's caches as found, warm after a first run; one pair from "
        f"the timed run, then {pairs} more, alternating), in CPU seconds (user + system, "
        "g++ included: the wall time of an idle machine; wall seconds in brackets), the "
        "median paired ratio, and ftrain compiled with dynamic_batch=False (static batch s) "
        "with the dynamic batch's share of the compile (skipped with --quick); every "
        "variant: AdamW + clip_grad_norm_(1.0), float32, a fixed batch",
    ]
    if args.quick:
        notes.append(
            "--quick: small models, inductor's caches as found; no target is judged (they are "
            "the full-size transformer's); without --model it runs the MLP, which compiles "
            "fastest (--model transformer: one block, 32 tokens)"
        )
    if share is not None:
        notes.append(
            f"matrix products and attention ({', '.join(HEAVY_OPS)}): {share:.0%} of a plain "
            f"eager {specs[0].kind} step (self CPU time over wall time, torch.profiler): "
            f"compile cannot speed them up, so it gains at most {1 / share:.2f}x there"
        )
    return out, table, config, notes
