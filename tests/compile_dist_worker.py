"""``with_compile`` under DDP and FSDP2, run by ``torchrun`` (2 processes, gloo on the CPU).

``torchrun --standalone --nproc-per-node 2 compile_dist_worker.py SCENARIO OUT_DIR [ARGS...]``

Each rank trains the same wrapped model twice on its own batches, eagerly and under
``with_compile``, and writes ``OUT_DIR/<scenario>_rank<r>.json``: the largest differences of
the losses, gradient norms and (whole, gathered) weights, and dynamo's counters (graph
breaks, graphs, recompiles) with the compile fallbacks warned.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import ftrain
from ftrain import dist
from ftrain.bench.models import ModelSpec
from ftrain.step import Step
from ftrain.transforms.compile import CompileFallbackWarning

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*barrier.*")

SPEC = ModelSpec("transformer", batch_size=4, width=16, layers=2, seq_len=8, heads=2, vocab=32)
UPDATES, EVERY = 20, 2


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2 shards gathered), by its unwrapped name."""
    out = {}
    for name, p in dist.unwrap(model).named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def _step() -> Step:
    """Accumulation (no_sync off the boundary), clipping (traced into the update), the
    non-finite check (eager, between two compiled programs), a schedule (eager, first)."""
    step = ftrain.make_step(SPEC.loss)
    step = ftrain.with_grad_accum(step, every=EVERY)
    step = ftrain.with_clip(step, "norm", max_norm=0.5)
    step = ftrain.with_nonfinite_check(step, "skip")
    lr = ftrain.schedules.warmup(ftrain.schedules.cosine(0.1, total=UPDATES), iters=3)
    return ftrain.with_schedule(step, lr=lr)


def _train(step: Step, strategy: str) -> tuple[ftrain.TrainState, list[dict]]:
    torch.manual_seed(0)
    model = dist.wrap(SPEC.build(), strategy)
    # SGD: AdamW divides float noise by its own size where the true gradient is 0 (the key
    # part of an attention's qkv bias), so two correct runs drift apart there by ~lr per update
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    state = ftrain.TrainState.create(model, opt)
    metrics = []
    for i in range(UPDATES * EVERY):
        state, m = step(state, SPEC.batch(seed=1000 * dist.rank() + i))
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def _largest(a: list[dict], b: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys(), (sorted(x), sorted(y))
        for k in x:
            out[k] = max(out.get(k, 0.0), abs(x[k] - y[k]))
    return out


def scenario_compiled(out: Path, strategy: str, backend: str) -> None:
    """Eager vs compiled on ``strategy`` ("ddp" or "fsdp2") with ``backend``."""
    dist.init()
    step = _step()
    start = _initial(strategy)
    eager, eager_metrics = _train(step, strategy)
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, compiled_metrics = _train(ftrain.with_compile(step, backend=backend), strategy)
    a, b = whole(eager.model), whole(compiled.model)
    result = {
        "metrics_diff": _largest(eager_metrics, compiled_metrics),
        "weights_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
        "weights_moved": max(float((a[k] - start[k]).abs().max()) for k in a),
        "updates": compiled.step,
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": [r.splitlines()[0] for r in counters["graph_break"]],
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "fallbacks": [str(w.message) for w in caught if w.category is CompileFallbackWarning],
        "strategy": dist.strategy(compiled.model),
    }
    with open(out / f"compiled_{strategy}_{backend}_rank{dist.rank()}.json", "w") as f:
        json.dump(result, f)


def _initial(strategy: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return whole(dist.wrap(SPEC.build(), strategy))


SCENARIOS = {"compiled": scenario_compiled}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    name, out, *args = argv
    try:
        SCENARIOS[name](Path(out), *args)
        gc.collect()  # DDP/FSDP2 modules in reference cycles: gone before the group
        dist.barrier()
    finally:
        dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
