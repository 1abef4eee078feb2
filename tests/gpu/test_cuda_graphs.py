"""``with_compile(step, mode="reduce-overhead")``: CUDA graphs on a real GPU (skipped without
CUDA; the CPU suite checks the same logic with the step-begin marker counted,
tests/test_compile.py).

50 step calls (accumulation over 2 micro-batches, clipping, AdamW) against the same eager
step: equal losses, gradient norms and weights; after the first update no graph is recorded
again, none is skipped; the metrics of an earlier step keep their values after later replays.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import ftrain
from ftrain.bench.models import ModelSpec
from ftrain.step import Step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPEC = ModelSpec("transformer", batch_size=4, width=32, layers=2, seq_len=16, heads=2, vocab=64)
STEPS = 50


def _train(step: Step, on_step=None):
    torch.manual_seed(0)
    model = SPEC.build().cuda()
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    metrics = []
    for i in range(STEPS):
        state, m = step(state, SPEC.batch(seed=i, device="cuda"))
        metrics.append(m)
        if on_step is not None:
            on_step(i)
    return state, metrics


@pytest.fixture
def recordings(monkeypatch):
    """The CUDA graphs recorded so far (cudagraph trees' record_function calls)."""
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    calls = []
    real = cudagraph_trees.CUDAGraphTreeManager.record_function

    def record(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", record)
    return calls


def test_reduce_overhead_equals_eager_and_never_records_again(recordings):
    base = ftrain.with_clip(ftrain.with_grad_accum(ftrain.make_step(SPEC.loss), 2), max_norm=1.0)
    e_state, e_metrics = _train(base)
    seen = {}
    c_state, c_metrics = _train(
        ftrain.with_compile(base, mode="reduce-overhead"),
        on_step=lambda i: seen.setdefault(i, len(recordings)),
    )
    assert recordings, "no CUDA graph was recorded"
    assert seen[STEPS - 1] == seen[9], "graphs recorded again after the first windows"
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert sum(counters["graph_break"].values()) == 0
    for em, cm in zip(e_metrics, c_metrics, strict=True):  # earlier metrics kept their values
        assert em.keys() == cm.keys()
        for k in em:
            torch.testing.assert_close(cm[k], em[k], rtol=1e-4, atol=1e-5)
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # the gradient buffers are kept (zeroed after each update), at fixed addresses
    grads = [p.grad for p in c_state.model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


def test_reduce_overhead_grad_buffers_stay_put(recordings):
    """The backward accumulates into the same buffers at every step (no graph-owned memory)."""
    step = ftrain.with_compile(ftrain.make_step(SPEC.loss), mode="reduce-overhead")
    torch.manual_seed(0)
    model = SPEC.build().cuda()
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    addresses, losses = [], []
    for i in range(6):
        state, m = step(state, SPEC.batch(seed=i, device="cuda"))
        addresses.append([p.grad.data_ptr() for p in state.model.parameters()])
        losses.append(m["loss"])
    assert recordings and all(a == addresses[0] for a in addresses)
    assert len({float(x) for x in losses}) == len(losses)  # each step's own loss, kept
