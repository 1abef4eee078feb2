"""How much time does ftrain add to a training step? Compared with a plain PyTorch loop.

Run (the same as ``python -m ftrain.bench overhead``, every option of it works here)::

    python benchmarks/overhead.py                 # full run, a few minutes
    python benchmarks/overhead.py --quick         # 5 repeats of 200-step chunks, seconds
    python benchmarks/overhead.py --json out.json

Method: one process, one thread (``torch.set_num_threads(1)``); every variant
gets its own model (same initial weights), optimizer (SGD with momentum) and a
fixed batch. The variants of a workload are timed *interleaved*: each repeat
runs every variant for the same 1000 steps (a multiple of the accumulation
window, of the default log interval and the default checkpoint interval: so
each chunk of the loop with default hooks pays for exactly 20 logs and one
checkpoint), rotating which goes first, so drift and other load on the
machine hit all of them alike. ``mlp`` runs 0.3x the repeats of ``tiny``. Per variant we report the median µs/step
over the repeats and its spread (25th-75th percentile); the ratio and the
added µs/step are the medians of the *per-repeat* paired ratios and
differences against the variant's reference, which cancels most drift, with
an order-statistic interval of that median (:mod:`ftrain.bench.verdict`): a
target is OK or MISSED only when the whole interval is on one side of it.
Before each timed chunk the garbage collector runs (cheaply: torch's objects
are frozen out of it), so no variant pays for another's garbage.

Workloads:

* ``tiny``: ``Linear(16, 16)``, batch 8, MSE: the step is nearly all overhead.
* ``mlp``: three ``Linear(256, 256)`` layers with ReLU, batch 64, MSE.

Variants (reference in brackets):

* ``plain``: forward, loss, backward, ``opt.step()``, ``zero_grad(set_to_none=True)``.
* ``plain, grad=None`` [plain]: the same, clearing gradients with ``p.grad = None``
  as ftrain's step does (``Optimizer.zero_grad`` spends microseconds in its
  profiler annotation). Against it, the targets' variants are also reported
  (lines marked "info"): the cost that is ftrain's own.
* ``make_step`` [plain]: ``ftrain.make_step(loss_fn)``.
* ``plain composed``: the same loop doing the work of the composed step:
  bf16 autocast, loss divided by the window, ``clip_grad_norm_`` and the
  update once per window of 4.
* ``composed`` [plain composed]: ``make_step`` + ``with_amp(bf16)`` +
  ``with_grad_accum(every=4)`` + ``with_clip("norm")``.

* ``loop, no hooks`` [plain]: ``ftrain.Loop(..., hooks=[])`` driven over the
  fixed batch: the loop's own cost (events, deferred signals, timing).
* ``loop + defaults`` [plain]: ``ftrain.Loop`` with ``ftrain.default_hooks()``
  and a work dir: timer, logger every 50 updates (console lines, JSONL and
  TensorBoard files), checkpoint every 1000 updates, save-on-interrupt;
  driven by ``lp.run(steps=n)``, as ``Loop.run()`` drives it (a step's event reaches
  the hooks only at the updates their cadences ask for: see ``ftrain.hooks.cadence``).
* ``loop+def, for ev`` [plain]: the same driven by ``for ev in lp``: every
  step's event passes through every hook to the caller.

Targets (issue 2): ``make_step`` ≤ 1.02x on ``mlp`` and ≤ 10 µs/step added on
``tiny``; importing ftrain adds ≤ 0.1 s to ``import torch``. Issue 3: the loop
with default hooks ≤ 1.02x on ``mlp`` and ≤ 10 µs/step added on ``tiny`` (judged
on full runs only: a --quick run's 200-step chunks do not hold the checkpoint
written every 1000 steps).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import ftrain
from ftrain.bench.verdict import Interval, Target, judge, median_interval
from ftrain.bench.verdict import paired as paired_values

ACCUM = 4  # micro-batches per update in the composed variants
MAX_NORM = 1.0
LR, MOMENTUM = 1e-3, 0.9

Batch = tuple[torch.Tensor, torch.Tensor]
Runner = Callable[[int], None]  # run(n): n training steps (micro-batches)


# ---------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """A model factory and a fixed batch."""

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    batch: Batch
    # Steps per timed chunk: 1000, so that every chunk of "loop + defaults" holds
    # exactly 20 logs and one checkpoint (rare costs are in every chunk, not
    # dropped by the median), and the composed step's windows of 4 align.
    chunk_steps: int = 1000
    repeats_factor: float = 1.0  # a slow workload runs fewer repeats


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()

    return build


def workloads() -> dict[str, Workload]:
    """The two workloads of issue 2 (tiny: pure overhead; mlp: a small real step)."""
    g = torch.Generator().manual_seed(0)
    return {
        "tiny": Workload(
            "tiny",
            "Linear(16,16), batch 8",
            _seeded(lambda: nn.Linear(16, 16)),
            (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)),
        ),
        "mlp": Workload(
            "mlp",
            "3 x Linear(256,256) + ReLU, batch 64",
            _seeded(
                lambda: nn.Sequential(
                    nn.Linear(256, 256),
                    nn.ReLU(),
                    nn.Linear(256, 256),
                    nn.ReLU(),
                    nn.Linear(256, 256),
                )
            ),
            (torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)),
            repeats_factor=0.3,  # a chunk takes ~1 s
        ),
    }


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The ftrain loss function: MSE of the model's output."""
    x, y = batch
    return F.mse_loss(model(x), y)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# ----------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One way of running training steps.

    ``build(workload)`` makes a fresh model and optimizer and returns
    ``run(n)``, which performs ``n`` steps (micro-batches) on the fixed batch.
    ``reference`` names the variant it is compared with (``None``: it is a
    reference itself).
    """

    name: str
    build: Callable[[Workload], Runner]
    reference: str | None = None


def plain_variant(wl: Workload) -> Runner:
    """The plain PyTorch loop."""
    model = wl.make_model()
    opt = _sgd(model)
    x, y = wl.batch

    def run(n: int) -> None:
        for _ in range(n):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def plain_no_zero_grad_variant(wl: Workload) -> Runner:
    """The plain loop, clearing gradients with ``p.grad = None`` (as ftrain's step does).

    ``Optimizer.zero_grad`` wraps its loop in a profiler ``record_function``
    that costs microseconds per call; ftrain skips it when no profiler runs.
    This variant shows that cost, and is the reference for ftrain's own cost.
    """
    model = wl.make_model()
    opt = _sgd(model)
    x, y = wl.batch
    params = [p for g in opt.param_groups for p in g["params"]]

    def run(n: int) -> None:
        for _ in range(n):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            for p in params:
                p.grad = None

    return run


def plain_composed_variant(wl: Workload) -> Runner:
    """The plain loop doing the composed step's work: autocast, accumulation, clipping."""
    model = wl.make_model()
    opt = _sgd(model)
    x, y = wl.batch
    params = list(model.parameters())
    micro = 0

    def run(n: int) -> None:
        nonlocal micro
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x), y)
            (loss / ACCUM).backward()
            micro += 1
            if micro % ACCUM == 0:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                opt.step()
                opt.zero_grad(set_to_none=True)

    return run


def _ftrain_runner(wl: Workload, step: ftrain.step.Step) -> Runner:
    model = wl.make_model()
    box = [ftrain.TrainState.create(model, _sgd(model))]
    batch = wl.batch

    def run(n: int) -> None:
        state = box[0]
        for _ in range(n):
            state, _metrics = step(state, batch)
        box[0] = state

    return run


def make_step_variant(wl: Workload) -> Runner:
    """``ftrain.make_step`` alone."""
    return _ftrain_runner(wl, ftrain.make_step(loss_fn))


def composed_variant(wl: Workload) -> Runner:
    """``make_step`` with AMP (bf16), accumulation and norm clipping."""
    step = ftrain.make_step(loss_fn)
    step = ftrain.with_amp(step, dtype=torch.bfloat16)
    step = ftrain.with_grad_accum(step, every=ACCUM)
    step = ftrain.with_clip(step, "norm", max_norm=MAX_NORM)
    return _ftrain_runner(wl, step)


def base_variants() -> list[Variant]:
    """The variants of issue 2."""
    return [
        Variant("plain", plain_variant),
        Variant("plain, grad=None", plain_no_zero_grad_variant, reference="plain"),
        Variant("make_step", make_step_variant, reference="plain"),
        Variant("plain composed", plain_composed_variant),
        Variant("composed", composed_variant, reference="plain composed"),
    ]


def _loop_runner(wl: Workload, hooks: Any, *, iterate: bool = False) -> Runner:
    """``run(n)`` drives one long ``ftrain.Loop`` over the fixed batch for ``n`` more steps.

    By default through ``lp.run(steps=n)`` (what ``fit`` does: the run pauses
    between chunks with its hooks open); ``iterate=True`` instead pulls every
    event with ``for ev in lp`` (a notebook driving the loop by hand).
    """
    import contextlib
    import itertools
    import tempfile

    from ftrain.events import StepEnd

    model = wl.make_model()
    state = ftrain.TrainState.create(model, _sgd(model))
    work_dir = tempfile.mkdtemp(prefix="ftrain-overhead-")  # checkpoints, JSONL, TensorBoard
    lp = ftrain.Loop(
        ftrain.make_step(loss_fn),
        state,
        itertools.repeat(wl.batch),  # one endless epoch
        hooks,
        max_steps=10**12,
        work_dir=work_dir,
    )
    devnull = open(os.devnull, "w")  # noqa: SIM115 - the console log (bar or lines) goes here
    quiet = (contextlib.redirect_stderr(devnull), contextlib.redirect_stdout(devnull))

    if not iterate:

        def run(n: int) -> None:
            with quiet[0], quiet[1]:
                lp.run(steps=n)

        return run

    events = iter(lp)

    def run_iterated(n: int) -> None:
        seen = 0
        with quiet[0], quiet[1]:
            for ev in events:
                if type(ev) is StepEnd:
                    seen += 1
                    if seen == n:
                        return

    return run_iterated


def loop_no_hooks_variant(wl: Workload) -> Runner:
    """``ftrain.Loop`` with no hooks: the loop's own cost (events, signals, timing)."""
    return _loop_runner(wl, [])


def loop_default_hooks_variant(wl: Workload) -> Runner:
    """``ftrain.Loop`` with ``default_hooks()`` and a ``work_dir``.

    Timer, logger at its default interval (50 updates: progress bar, JSONL and
    TensorBoard in the work dir), periodic checkpoint (every 1000 updates,
    written atomically) and save-on-interrupt: what a user gets by default.
    """
    return _loop_runner(wl, ftrain.default_hooks())


def loop_default_hooks_iterated_variant(wl: Workload) -> Runner:
    """``loop + defaults`` driven by ``for ev in lp``: every event reaches the caller."""
    return _loop_runner(wl, ftrain.default_hooks(), iterate=True)


def extra_variants() -> list[Variant]:
    """Issue 3's variants: the loop alone, and the loop with its default hooks."""
    return [
        Variant("loop, no hooks", loop_no_hooks_variant, reference="plain"),
        Variant("loop + defaults", loop_default_hooks_variant, reference="plain"),
        Variant("loop+def, for ev", loop_default_hooks_iterated_variant, reference="plain"),
    ]


def all_variants() -> list[Variant]:
    """Every variant the benchmark runs."""
    return base_variants() + extra_variants()


# ------------------------------------------------------------------ timing
@dataclass
class Result:
    """Timings of one variant on one workload (µs per step, one per repeat)."""

    workload: str
    variant: str
    reference: str | None
    us: list[float] = field(default_factory=list)
    ratio: float = math.nan  # median of per-repeat ratios to the reference
    added_us: float = math.nan  # median of per-repeat differences to the reference
    ratio_interval: Interval | None = None  # where the median ratio lies
    added_interval: Interval | None = None  # where the median difference lies

    @property
    def median(self) -> float:
        return statistics.median(self.us)

    @property
    def spread(self) -> tuple[float, float]:
        """25th and 75th percentiles."""
        q = statistics.quantiles(self.us, n=4, method="inclusive")
        return q[0], q[2]

    def as_dict(self) -> dict[str, Any]:
        lo, hi = self.spread
        return {
            "workload": self.workload,
            "variant": self.variant,
            "reference": self.reference,
            "median_us": self.median,
            "p25_us": lo,
            "p75_us": hi,
            "ratio": self.ratio,
            "added_us": self.added_us,
            "ratio_interval": None
            if self.ratio_interval is None
            else self.ratio_interval.as_dict(),
            "added_interval": None
            if self.added_interval is None
            else self.added_interval.as_dict(),
            "repeats_us": self.us,
        }


def run_benchmark(
    wl: Workload, variants: list[Variant], *, repeats: int, echo: Callable[[str], None] = print
) -> list[Result]:
    """Time ``variants`` on ``wl``, interleaved round-robin.

    Each variant runs ``wl.chunk_steps`` steps per repeat, over ``repeats``
    repeats scaled by ``wl.repeats_factor`` (at least 5, the fewest that can give a verdict).
    """
    runners = [(v, v.build(wl)) for v in variants]
    n = wl.chunk_steps
    repeats = max(5, round(repeats * wl.repeats_factor))  # 5: enough for a verdict
    for _, r in runners:  # warm-up chunk for each
        r(n)
    gc.collect()
    gc.freeze()  # long-lived objects (torch's) out of the collector: gc.collect() is then cheap
    results = {v.name: Result(wl.name, v.name, v.reference) for v in variants}
    k = len(runners)
    for rep in range(repeats):
        for i in range(k):
            v, r = runners[(rep + i) % k]  # rotate who goes first
            gc.collect()
            t0 = time.perf_counter_ns()
            r(n)
            results[v.name].us.append((time.perf_counter_ns() - t0) / 1e3 / n)
    gc.unfreeze()
    for res in results.values():
        if res.reference is not None:
            ref = results[res.reference]
            res.ratio_interval = median_interval(paired_values(res.us, ref.us, "ratio"))
            res.added_interval = median_interval(paired_values(res.us, ref.us, "difference"))
            res.ratio, res.added_us = res.ratio_interval.median, res.added_interval.median
    echo(f"  {wl.name}: {n} steps per chunk x {repeats} repeats per variant")
    return list(results.values())


def paired(a: Result, b: Result) -> tuple[float, float]:
    """Median per-repeat ratio and difference of ``a`` against ``b`` (timed side by side)."""
    ratio = statistics.median(x / y for x, y in zip(a.us, b.us))
    added = statistics.median(x - y for x, y in zip(a.us, b.us))
    return ratio, added


def import_time(repeats: int) -> dict[str, Any]:
    """Start-up cost of ftrain beyond torch's own, two ways.

    ``torch`` / ``torch+ftrain``: median wall time of ``python -c "import torch"``
    and ``python -c "import torch, ftrain"`` (fresh processes, alternated);
    ``added``: the median of the paired differences. ``importtime``: the
    cumulative time of ``import ftrain`` after torch, from ``python -X
    importtime`` (steadier on a busy machine); median over the same repeats.
    """
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    codes = {"torch": "import torch", "torch+ftrain": "import torch, ftrain"}
    times: dict[str, list[float]] = {k: [] for k in codes}
    own: list[float] = []
    for rep in range(repeats):
        order = list(codes) if rep % 2 == 0 else list(reversed(codes))
        for key in order:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", codes[key]], check=True, env=env)
            times[key].append(time.perf_counter() - t0)
        trace = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import torch; import ftrain"],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        ).stderr
        for line in trace.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[2].rstrip() == " ftrain":
                own.append(int(parts[1]) / 1e6)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out["added"] = statistics.median(a - b for a, b in zip(times["torch+ftrain"], times["torch"]))
    out["importtime"] = statistics.median(own) if own else math.nan
    out["importtime_samples"] = own
    return out


# ------------------------------------------------------------------ targets
#: (workload, variant, target): issue 2's and issue 3's targets; the loop's are judged on
#: full runs only (a --quick run's 200-step chunks do not hold the 1000-step checkpoint).
TARGETS = (
    ("mlp", "make_step", Target("make_step on mlp: time vs plain", 1.02, "x")),
    ("tiny", "make_step", Target("make_step on tiny: added", 10.0, "us")),
    (
        "mlp",
        "loop + defaults",
        Target("loop+hooks on mlp: time vs plain", 1.02, "x", full_size=True),
    ),
    ("tiny", "loop + defaults", Target("loop+hooks on tiny: added", 10.0, "us", full_size=True)),
)
IMPORT_TARGET = Target("import ftrain after torch (-X importtime)", 0.1, "s")


def _info(by: dict[tuple[str, str], Result]) -> list[str]:
    """ftrain's step clears gradients without zero_grad's profiler annotation; against a plain
    loop that does the same, the cost left is ftrain's own (for information)."""
    lines = []
    for wl in ("tiny", "mlp"):
        ref = by.get((wl, "plain, grad=None"))
        for name in ("make_step", "loop + defaults"):
            if ref is not None and (wl, name) in by:
                ratio, added = paired(by[wl, name], ref)
                lines.append(
                    f"(info) {name} on {wl} vs 'plain, grad=None': {ratio:.2f}x, {added:+.1f} us"
                )
    return lines


def check_targets(
    results: list[Result], imports: dict[str, Any] | None, *, quick: bool = False
) -> list[str]:
    """Issue 2's and 3's targets: each with its median, interval and verdict."""
    by = {(r.workload, r.variant): r for r in results}
    checks = []
    for wl, variant, target in TARGETS:
        r = by.get((wl, variant))
        if r is not None:
            interval = r.ratio_interval if target.unit == "x" else r.added_interval
            checks.append(judge(target, interval, quick=quick).line())
    checks += _info(by)
    if imports is not None:
        interval = median_interval(imports.get("importtime_samples", []))
        checks.append(judge(IMPORT_TARGET, interval, quick=quick).line())
    return checks


def main(argv: list[str] | None = None) -> int:
    """``python -m ftrain.bench overhead`` with ``argv``."""
    from ftrain.bench.cli import main as bench_main

    return bench_main(["overhead", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
