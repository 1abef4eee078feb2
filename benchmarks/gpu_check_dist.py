"""G8 of benchmarks/gpu_check.py: one NCCL process, DDP and FSDP2 (issue 20.11).

``torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check_dist.py OUT_DIR [--smoke]``

* resume: for DDP and FSDP2, a run stopped at update 3 with a synchronous and with an
  asynchronous save (FSDP2: DCP) and resumed to update 6 equals the straight run bitwise;
* FSDP2 bf16: the step's peak allocated bytes with autocast over fp32 FSDP2 weights
  (a hand-written ``torch.autocast`` in the loss) and with ``with_amp(step, "bf16")``
  (FSDP2's MixedPrecisionPolicy, issue 20.1), and the bf16 model's size.

Writes ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

import ftrain
from ftrain import dist
from ftrain.bench.models import ModelSpec, lm_loss


def _spec(smoke: bool) -> ModelSpec:
    if smoke:
        return ModelSpec("transformer", batch_size=2, width=32, layers=2, seq_len=16, heads=2)
    return ModelSpec("transformer", batch_size=4, width=1024, layers=8, seq_len=512, heads=16)


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in dist.unwrap(model).parameters():
        t = p.detach()
        out.append((t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone())
    return out


def _run(spec: ModelSpec, kind: str, steps: int, work: Path | None, background: bool) -> list:
    """Train to ``steps`` (saving at 3 when ``work`` is given; resuming from it if there)."""
    model = dist.wrap(spec.build(0), kind)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = [spec.batch(seed=i, device=dist.info().device) for i in range(6)]
    hooks = [] if work is None else [ftrain.CheckpointHook(interval=3, background=background)]
    resume = "auto" if work is not None and steps > 3 else None
    loop = ftrain.Loop(ftrain.make_step(lm_loss), state, data, hooks, max_steps=steps,
                       work_dir=work, resume=resume)  # fmt: skip
    weights = _full(loop.run().model)
    del loop, state, model
    gc.collect()
    return weights


def resume_exact(spec: ModelSpec, kind: str, background: bool) -> bool:
    straight = _run(spec, kind, 6, None, background)
    with tempfile.TemporaryDirectory() as tmp:
        _run(spec, kind, 3, Path(tmp), background)
        resumed = _run(spec, kind, 6, Path(tmp), background)
    return all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def _peak_of_step(spec: ModelSpec, step: ftrain.step.Step) -> int:
    """Peak bytes allocated above the start by the second step of an FSDP2 model."""
    model = dist.wrap(spec.build(0), "fsdp2")
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = spec.batch(device=dist.info().device)
    state, _ = step(state, batch)  # optimizer state made
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state, _ = step(state, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del state, model
    gc.collect()
    torch.cuda.empty_cache()
    return int(peak)


def _autocast_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return lm_loss(model, batch)


def mixed_precision(spec: ModelSpec) -> dict[str, int]:
    autocast = _peak_of_step(spec, ftrain.make_step(_autocast_loss))
    policy = _peak_of_step(spec, ftrain.with_amp(ftrain.make_step(lm_loss), dtype="bf16"))
    size = sum(p.numel() for p in spec.build(0).parameters()) * 2
    return {"peak_autocast": autocast, "peak_policy": policy, "bf16_model_bytes": size}


def main(argv: list[str]) -> None:
    out, smoke = Path(argv[0]), "--smoke" in argv
    dist.init()
    spec = _spec(smoke)
    res: dict[str, object] = {}
    for kind in ("ddp", "fsdp2"):
        for background, label in ((False, "sync"), (True, "async")):
            res[f"exact/{kind} {label}"] = resume_exact(spec, kind, background)
    res.update(mixed_precision(spec))
    if dist.is_main():
        (out / "result.json").write_text(json.dumps(res))
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
