"""GPU checks that decide (issue 20.11): each measures one figure on CUDA against a target.

    python benchmarks/gpu_check.py              # every check, one table, exit 1 on a miss
    python benchmarks/gpu_check.py --only G3 G7 # some checks
    bash benchmarks/gpu_check.sh                # the same, after a clear "no CUDA" check

One function per check returns ``Result(measured, target, ok)``; the table has a row per
check (check, measured, target, verdict) and the exit status is non-zero when any check
misses its target or fails to run. Sized for one H100 in under 10 minutes. ``--smoke``
runs tiny sizes (with ``--device cpu``: the checks that need no CUDA) to try the driver.

Checks marked "needs" use features built alongside (issue 20): they fail until the
feature is there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

import ftrain
from ftrain.bench.models import ModelSpec, ce_loss, lm_loss
from ftrain.bench.timing import Timed, interleave, synchronize

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


class Result(NamedTuple):
    """What a check measured, its target, and whether the target was met."""

    measured: str
    target: str
    ok: bool


@dataclass(frozen=True)
class Config:
    device: torch.device
    smoke: bool
    out: Path

    def transformer(self) -> ModelSpec:
        """The compute-bound transformer (width 1024, 8 layers, 512 tokens; tiny in smoke)."""
        if self.smoke:
            return ModelSpec("transformer", batch_size=2, width=32, layers=2, seq_len=16, heads=2)
        return ModelSpec("transformer", batch_size=8, width=1024, layers=8, seq_len=512, heads=16)

    def tiny(self) -> ModelSpec:
        """A tiny MLP: the step is Python- and launch-bound."""
        return ModelSpec("mlp", batch_size=64, width=128, layers=4)

    def n(self, full: int, smoke: int) -> int:
        return smoke if self.smoke else full


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    fn: Callable[[Config], Result]
    needs: str = ""  # a feature built alongside (issue 20)
    cuda_only: bool = True


# ------------------------------------------------------------------ helpers
def _state(model: torch.nn.Module, *, fused: bool = False, lr: float = 1e-3) -> ftrain.TrainState:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused or None)
    return ftrain.TrainState.create(model, opt)


def _build(spec: ModelSpec, cfg: Config, seed: int = 0) -> torch.nn.Module:
    return spec.build(seed).to(cfg.device)


def _batches(spec: ModelSpec, cfg: Config, n: int, size: int | None = None) -> list:
    return [spec.batch(size, seed=i, device=cfg.device) for i in range(n)]


@contextlib.contextmanager
def _strict_fp32() -> Iterator[None]:
    """float32 matmuls and convolutions in IEEE fp32 (no TF32) inside."""
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


def _steps_unit(step: ftrain.step.Step, state: ftrain.TrainState, data: list) -> Callable[[], None]:
    """A unit running ``step`` over ``data`` (the state kept in a box between units)."""
    box = [state]

    def run() -> None:
        for b in data:
            box[0], _ = step(box[0], b)

    return run


def _median(t: Timed) -> float:
    return t.stats().median


# ------------------------------------------------------------ G1: host syncs
@contextlib.contextmanager
def _sync_warnings() -> Iterator[list]:
    """The synchronising CUDA calls made inside, as recorded warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)
    caught[:] = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]


def _syncs_in_run(cfg: Config, dtype: str, updates: int) -> int:
    spec = cfg.tiny()
    model = _build(spec, cfg)
    base = ftrain.make_step(ce_loss)
    if dtype == "fp16":  # a GradScaler with a foreach AdamW: one found-inf read per update
        step = ftrain.with_amp(base, dtype="fp16")
        step = ftrain.with_clip(ftrain.with_grad_accum(step, every=2), "norm", max_norm=1.0)
        state, micro = _state(model), 2 * updates
    else:
        step, state, micro = ftrain.with_amp(base, dtype="bf16"), _state(model, fused=True), updates
    data = _batches(spec, cfg, micro)
    hooks = ftrain.default_hooks(progress=False)  # no periodic log before update 50
    synchronize(cfg.device)
    with _sync_warnings() as caught:
        ftrain.Loop(step, state, data, hooks, epochs=1).run()
    return len(caught)


def g1_host_syncs(cfg: Config) -> Result:
    """Syncs per update: the difference of two runs' counts over their updates (start and
    end costs cancel)."""
    per = {}
    for dtype in ("fp16", "bf16"):
        a, b = (_syncs_in_run(cfg, dtype, n) for n in (10, 30))
        per[dtype] = (b - a) / 20
    ok = per["fp16"] == 1.0 and per["bf16"] == 0.0
    measured = f"fp16+clip+accum {per['fp16']:g}/update; bf16+fused AdamW {per['bf16']:g}/update"
    return Result(measured, "exactly 1; 0", ok)


# ------------------------------------------------------- G2: bf16 vs fp32
def g2_bf16_speedup(cfg: Config) -> Result:
    spec = cfg.transformer()
    data = _batches(spec, cfg, 1)
    units = []
    for amp in (None, "bf16"):
        step = ftrain.make_step(lm_loss)
        step = step if amp is None else ftrain.with_amp(step, dtype=amp)
        run = _steps_unit(step, _state(_build(spec, cfg), fused=True), data)
        units.append(Timed(amp or "fp32", run, cfg.device))
    with _strict_fp32():
        for u in units:
            for _ in range(3):
                u.run()  # warm-up
        interleave(units, rounds=cfg.n(10, 2))
    fp32, bf16 = (_median(u) for u in units)
    ratio = fp32 / bf16
    measured = f"{ratio:.2f}x (fp32 {fp32 * 1e3:.1f} ms, bf16 {bf16 * 1e3:.1f} ms per step)"
    return Result(measured, ">= 2.0x strict fp32", ratio >= 2.0)


# ------------------------------------------------ G3: fp16 vs a GradScaler loop
SCALER = {"init_scale": 2.0**10, "growth_interval": 10}


def _overflowing(cfg: Config, n: int) -> tuple[list, int]:
    """``n`` batches; every 25th (from the 10th) has an inf input: an overflow to skip."""
    data = _batches(cfg.tiny(), cfg, n)
    forced = 0
    for i, (x, _) in enumerate(data):
        if i % 25 == 10:
            x[0, 0] = float("inf")
            forced += 1
    return data, forced


def _scaler_loop(cfg: Config, data: list) -> tuple[list, int, float]:
    """The hand-written torch.amp loop: weights, skipped updates, final scale."""
    model = _build(cfg.tiny(), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(cfg.device.type, **SCALER)
    skipped = 0
    for batch in data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(cfg.device.type, dtype=torch.float16):
            loss = ce_loss(model, batch)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += int(scaler.get_scale() < before)
    return [p.detach().clone() for p in model.parameters()], skipped, scaler.get_scale()


def _ftrain_fp16(cfg: Config, data: list) -> tuple[list, int, float]:
    state = _state(_build(cfg.tiny(), cfg))
    step = ftrain.with_amp(ftrain.make_step(ce_loss), dtype="fp16", loss_scale=dict(SCALER))
    skipped = 0
    for batch in data:
        state, metrics = step(state, batch)
        skipped += int(metrics["skipped"])
    scale = state.transforms["amp"].scaler.get_scale()
    return [p.detach().clone() for p in state.model.parameters()], skipped, scale


def g3_fp16_matches_grad_scaler(cfg: Config) -> Result:
    data, forced = _overflowing(cfg, cfg.n(200, 30))
    ref_w, ref_skipped, ref_scale = _scaler_loop(cfg, [tuple(t.clone() for t in b) for b in data])
    w, skipped, scale = _ftrain_fp16(cfg, data)
    diff = max(float((a - b).abs().max()) for a, b in zip(w, ref_w, strict=True))
    same = all(torch.equal(a, b) for a, b in zip(w, ref_w, strict=True))
    ok = same and skipped == ref_skipped >= forced and scale == ref_scale
    measured = (
        f"max |diff| {diff:g} over {len(data)} updates; skipped {skipped} vs {ref_skipped} "
        f"({forced} forced); scale {scale:g} vs {ref_scale:g}"
    )
    return Result(measured, "bitwise equal, every forced overflow skipped", ok)


# --------------------------------------------------- G4: the loop's overhead
def _plain_bf16(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    for batch in data:
        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16):
            loss = lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def g4_loop_overhead(cfg: Config) -> Result:
    spec = cfg.transformer()
    data = _batches(spec, cfg, cfg.n(100, 4))
    model = _build(spec, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = ftrain.with_amp(ftrain.make_step(lm_loss), dtype="bf16")

    def loop() -> None:
        hooks = ftrain.default_hooks(progress=False)
        ftrain.Loop(step, ftrain.TrainState.create(model, opt), data, hooks, epochs=1).run()

    plain = Timed("plain", lambda: _plain_bf16(model, opt, data), cfg.device)
    looped = Timed("loop", loop, cfg.device)
    for t in (plain, looped):
        t.run()  # warm-up
    interleave([plain, looped], rounds=cfg.n(4, 2))
    over = _median(looped) / _median(plain) - 1.0
    per = [_median(t) / len(data) * 1e3 for t in (looped, plain)]
    measured = f"{over * 100:+.2f}% ({per[0]:.2f} vs {per[1]:.2f} ms per step)"
    return Result(measured, "<= 1% over a plain loop", over <= 0.01)


# --------------------------------------------------------------- G5: compile
@contextlib.contextmanager
def _count_captures() -> Iterator[list[int]]:
    """The CUDA graph captures (records) made inside."""
    graph_cls = torch.cuda.graphs.CUDAGraph
    original = graph_cls.capture_begin
    count = [0]

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(self, *args, **kwargs)

    graph_cls.capture_begin = capture_begin
    try:
        yield count
    finally:
        graph_cls.capture_begin = original


def g5_compile(cfg: Config) -> Result:
    spec = cfg.tiny()
    data = _batches(spec, cfg, 20)
    units = []
    for mode in ("eager", "default", "reduce-overhead"):
        step = ftrain.make_step(ce_loss)
        if mode != "eager":
            step = ftrain.with_compile(step, mode=None if mode == "default" else mode)
        run = _steps_unit(step, _state(_build(spec, cfg), fused=True), data)
        run()  # compile and record
        run()
        units.append(Timed(mode, run, cfg.device))
    with _count_captures() as records, torch._dynamo.config.patch(error_on_recompile=True):
        interleave(units, rounds=cfg.n(8, 2))
    eager, comp, ro = (_median(u) for u in units)
    ok = eager / comp >= 1.3 and eager / ro >= 1.5 and records[0] == 0
    measured = (
        f"compile {eager / comp:.2f}x, reduce-overhead {eager / ro:.2f}x eager "
        f"({eager / len(data) * 1e3:.3f} ms/step), {records[0]} re-records, no recompile"
    )
    return Result(measured, ">= 1.3x; >= 1.5x; 0 re-records", ok)


# ------------------------------------------------------- G6: background save
def _big_model(cfg: Config) -> torch.nn.Module:
    """About 2 GiB of float32 weights (16 x 8192 x 4096); 2 MiB in smoke."""
    n, d = (2, 512) if cfg.smoke else (16, 4096)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2 * d, d, bias=False) for _ in range(n)]
    return torch.nn.Sequential(*layers).to(cfg.device)


def _big_run(cfg: Config, work_dir: Path | None, resume: str | None = None) -> ftrain.Loop:
    model = _big_model(cfg)
    d = model[0].in_features
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(4, d, generator=g).to(cfg.device) for _ in range(6)]

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).pow(2).mean() for layer in m)

    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    return ftrain.Loop(ftrain.make_step(loss_fn), state, data, [], epochs=1,
                       work_dir=work_dir, resume=resume)  # fmt: skip


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def g6_background_save(cfg: Config) -> Result:
    work = Path(tempfile.mkdtemp(dir=cfg.out))
    loop = _big_run(cfg, work)
    loop.run(steps=2)
    save = loop.checkpointer.save
    save(loop.snapshot(), work, "iter_2.pth", "periodic", background=True)  # stager warm
    loop.checkpointer.wait()
    loop.run(steps=1)
    plain = _timed(lambda: torch.save(loop.snapshot().payload, work / "plain.pt"), cfg.device)
    blocked = _timed(
        lambda: save(loop.snapshot(), work, "iter_3.pth", "periodic", background=True), cfg.device
    )
    loop.checkpointer.wait()
    straight = [p.detach().clone() for p in loop.run().model.parameters()]
    resumed = _big_run(cfg, work, resume=str(work / "iter_3.pth")).run()
    exact = all(torch.equal(a, b) for a, b in zip(straight, resumed.model.parameters()))
    size = sum(p.numel() * p.element_size() for p in straight) / GIB
    share = blocked / plain
    measured = (
        f"{size:.2f} GiB: blocked {blocked:.2f} s = {share * 100:.1f}% of torch.save "
        f"{plain:.2f} s; resume {'bit-exact' if exact else 'DIFFERS'}"
    )
    return Result(measured, "<= 10%; bit-exact", share <= 0.10 and exact)


# --------------------------------------------------------- G7: the planner
def _seq_len(tokens: torch.Tensor) -> float:
    return float(tokens.shape[1])


def _eager_activations(spec: ModelSpec, cfg: Config, model: torch.nn.Module) -> float:
    """Peak bytes allocated above the weights by one eager forward and backward at full length."""
    batch = spec.batch(device=cfg.device)
    synchronize(cfg.device)
    base = torch.cuda.memory_allocated(cfg.device)
    torch.cuda.reset_peak_memory_stats(cfg.device)
    lm_loss(model, batch).backward()
    model.zero_grad(set_to_none=True)
    synchronize(cfg.device)
    return float(torch.cuda.max_memory_allocated(cfg.device) - base)


def _planner_run(cfg: Config, earlier: int) -> tuple[float, float, list[int]]:
    """(peak reserved of the planned steps, budget, modules checkpointed per step)."""
    from ftrain.memory import dynamic, pattern

    spec = cfg.transformer()
    model = _build(spec, cfg)
    state = _state(model, fused=True)
    state, _ = ftrain.make_step(lm_loss)(state, spec.batch(device=cfg.device))  # Adam's moments
    weights = float(torch.cuda.memory_allocated(cfg.device))
    budget = 1.15 * (weights + 0.5 * _eager_activations(spec, cfg, model))
    torch.cuda.empty_cache()
    if earlier:  # a higher earlier peak: an evaluation, a bigger batch (the cache given back)
        big = torch.empty(earlier, dtype=torch.uint8, device=cfg.device)
        del big
        torch.cuda.empty_cache()
    blocks = pattern(under="blocks", level=1)
    plan = dynamic(budget, warmup_iters=5, size_fn=_seq_len, candidates=blocks)
    step = ftrain.with_activation_checkpoint(ftrain.make_step(lm_loss), plan)
    full = spec.seq_len
    for length in (full, full // 4, full // 2, 3 * full // 4, full // 8):  # warm-up
        state, _ = step(state, _batch_of_length(spec, cfg, length, 0))
    synchronize(cfg.device)
    torch.cuda.reset_peak_memory_stats(cfg.device)  # the planned steps from here
    rng = random.Random(0)
    counts = []
    for i in range(cfg.n(16, 4)):
        length = rng.randint(full // 8, full)
        state, metrics = step(state, _batch_of_length(spec, cfg, length, i + 1))
        counts.append(int(metrics["checkpointed_modules"]))
    synchronize(cfg.device)
    return float(torch.cuda.max_memory_reserved(cfg.device)), budget, counts


def _batch_of_length(spec: ModelSpec, cfg: Config, length: int, seed: int) -> tuple:
    x, y = spec.batch(seed=seed, device=cfg.device)
    return x[:, :length].contiguous(), y[:, :length].contiguous()


def g7_planner_budget(cfg: Config) -> Result:
    parts, ok = [], True
    for label, earlier in (("fresh", 0), ("after 4 GiB", cfg.n(4 * GIB, 2**20))):
        reserved, budget, counts = _planner_run(cfg, earlier)
        binds = any(counts) and not all(c == max(counts) for c in counts)
        ok = ok and reserved <= budget and binds
        parts.append(
            f"{label}: reserved {reserved / GIB:.2f} of {budget / GIB:.2f} GiB, "
            f"checkpointed {min(counts)}-{max(counts)} blocks"
        )
        gc.collect()
        torch.cuda.empty_cache()
    return Result("; ".join(parts), "reserved <= budget, plan varies with length", ok)


# ---------------------------------------------------- G8: NCCL, DCP, FSDP2
def g8_nccl_dcp_fsdp2(cfg: Config) -> Result:
    out = Path(tempfile.mkdtemp(dir=cfg.out))
    worker = Path(__file__).with_name("gpu_check_dist.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(worker), str(out)] + (["--smoke"] if cfg.smoke else [])  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"the NCCL worker failed: {(proc.stdout + proc.stderr)[-800:]}")
    res = json.loads((out / "result.json").read_text())
    saving = res["peak_autocast"] - res["peak_policy"]
    share = saving / res["bf16_model_bytes"]
    exact = {k: v for k, v in res.items() if k.startswith("exact/")}
    ok = all(exact.values()) and share >= 0.4
    failed = [k[6:] for k, v in exact.items() if not v]
    measured = (
        f"resume bit-exact: {', '.join(k[6:] for k in exact)}"
        + (f" (DIFFERS: {', '.join(failed)})" if failed else "")
        + f"; policy peak lower by {share:.2f}x the bf16 model ({saving / 2**20:.0f} MiB)"
    )
    return Result(measured, "bit-exact; >= 0.4x", ok)


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


# ------------------------------------------------------------------- G9: MFU
def g9_mfu(cfg: Config) -> Result:
    from ftrain.hooks.logging import LoggerHook
    from ftrain.hooks.monitor import Throughput, peak_flops_for
    from ftrain.hooks.timer import TimerHook

    spec = cfg.transformer()
    work = Path(tempfile.mkdtemp(dir=cfg.out))
    model = _build(spec, cfg)
    step = ftrain.with_amp(ftrain.make_step(lm_loss), dtype="bf16")
    logger = LoggerHook(
        every=10, progress=False, tensorboard=False, throughput=Throughput(flops="auto")
    )
    hooks = [TimerHook(skip_first_k=2), logger]
    data = _batches(spec, cfg, cfg.n(30, 10))
    ftrain.Loop(step, _state(model, fused=True), data, hooks, epochs=1, work_dir=work).run()
    last = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()][-1]
    peak = peak_flops_for(torch.cuda.get_device_name(cfg.device), "bf16")
    if peak is None or "perf/mfu" not in last:
        raise RuntimeError(f"no MFU logged (peak {peak}, tags {sorted(last)})")
    n = sum(p.numel() for p in model.parameters())
    tokens = spec.batch_size * spec.seq_len
    reference = 6 * n * tokens / last["iter_time"] / peak
    rel = last["perf/mfu"] / reference - 1
    measured = (
        f"logged MFU {last['perf/mfu']:.3f} vs 6*N*tokens {reference:.3f} ({rel * 100:+.1f}%)"
    )
    return Result(measured, "within 10%", abs(rel) <= 0.10)


# ---------------------------------------------------------- G10: tests/gpu
def g10_pytest_gpu(cfg: Config) -> Result:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480, env=_env())
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    summary = lines[-1].strip("= ") if lines else proc.stdout[-300:]
    return Result(summary, "all pass", proc.returncode == 0)


# features built alongside (issue 20) that a check's target depends on
NEEDS_G5 = "20.5 with_compile(mode='reduce-overhead')"
NEEDS_G6 = "20.7 pinned stager"
NEEDS_G8 = "20.1 FSDP2 MixedPrecisionPolicy"

CHECKS: tuple[Check, ...] = (
    Check("G1", "host syncs per update", g1_host_syncs),
    Check("G2", "bf16 vs strict fp32, transformer 1024x8x512", g2_bf16_speedup, cuda_only=False),
    Check("G3", "fp16 = torch.amp.GradScaler loop", g3_fp16_matches_grad_scaler, cuda_only=False),
    Check("G4", "Loop + default hooks vs plain loop", g4_loop_overhead, cuda_only=False),
    Check("G5", "with_compile speed-up, tiny model", g5_compile, needs=NEEDS_G5),
    Check("G6", "2 GiB background save", g6_background_save, needs=NEEDS_G6, cuda_only=False),
    Check("G7", "dynamic planner budget", g7_planner_budget),
    Check("G8", "NCCL DDP/FSDP2, DCP resume, FSDP2 bf16", g8_nccl_dcp_fsdp2, needs=NEEDS_G8),
    Check("G9", "MFU vs 6*N*tokens", g9_mfu),
    Check("G10", "pytest tests/gpu", g10_pytest_gpu),
)


# ------------------------------------------------------------------- table
@dataclass(frozen=True)
class Row:
    check: str
    measured: str
    target: str
    verdict: str
    seconds: float


def run_check(check: Check, cfg: Config) -> Row:
    """Run one check; an exception is a failed check with its message."""
    name = f"{check.key} {check.title}" + (f" [needs {check.needs}]" if check.needs else "")
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the table alone on stdout
            res = check.fn(cfg)
        measured, target, verdict = res.measured, res.target, "PASS" if res.ok else "FAIL"
    except Exception as e:  # noqa: BLE001 - the table reports it; the exit status fails
        measured, target, verdict = f"error: {type(e).__name__}: {e}"[:300], "-", "FAIL"
    finally:
        gc.collect()
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    return Row(name, measured, target, verdict, time.perf_counter() - t0)


def table(rows: Sequence[Row]) -> str:
    """One table: check, measured, target, verdict (and seconds)."""
    head = ("check", "measured", "target", "verdict", "s")
    cells = [head, *[(r.check, r.measured, r.target, r.verdict, f"{r.seconds:.0f}") for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def exit_status(rows: Sequence[Row]) -> int:
    """0 when every check met its target, else 1."""
    return 0 if rows and all(r.verdict == "PASS" for r in rows) else 1


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="G", help="run these checks (e.g. G3 G7)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: try the driver")
    p.add_argument("--out", default=None, help="scratch directory (default: a temporary one)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, checks: Sequence[Check] = CHECKS) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; run it on a GPU machine.", file=sys.stderr)
        return 2
    known = {c.key for c in checks}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        print(
            f"gpu_check: unknown check(s) {unknown}; choose from {sorted(known)}", file=sys.stderr
        )
        return 2
    chosen = [c for c in checks if not args.only or c.key in args.only]
    if device.type != "cuda":
        chosen = [c for c in chosen if not c.cuda_only]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(device, args.smoke, Path(args.out or tmp))
        cfg.out.mkdir(parents=True, exist_ok=True)
        rows = []
        for check in chosen:
            print(f"gpu_check: {check.key} {check.title} ...", file=sys.stderr, flush=True)
            rows.append(run_check(check, cfg))
    print(table(rows))
    return exit_status(rows)


if __name__ == "__main__":
    raise SystemExit(main())
