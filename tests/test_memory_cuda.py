"""The dynamic planner's CUDA measurement, on the CPU with a fake CUDA allocator (issue 20.9).

``tests/fake_cuda.py`` counts the bytes of the live tensors the test's ops create, grows
a "reserved" figure by a fragmentation factor, and answers ``torch.cuda``'s memory
counters. References: the allocator's own peak over a plain forward and backward written
here, and its reserved peak against the budget. No CUDA runs here (tests/gpu does that).
"""

from __future__ import annotations

import random

import pytest
import torch
from fake_cuda import FakeAllocator, install

import ftrain
from ftrain.hooks.monitor import memory_stats
from ftrain.memory import cuda_peak, dynamic, pattern

D = 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D, 4 * D)
        self.down = torch.nn.Linear(4 * D, D)

    def forward(self, x):
        scores = torch.softmax(x @ x.transpose(-1, -2), dim=-1)  # grows with T^2
        return x + self.down(torch.tanh(self.up(scores @ x)))


class Net(torch.nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


def seq_len(x):
    return x.shape[1]


def batch(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, t, D, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _fresh_peaks(monkeypatch):
    install(monkeypatch, FakeAllocator())  # each test installs its own on top
    yield
    cuda_peak.clear_peaks(0)  # forget the fake device's maximum (still faked here)


def plain_peak(alloc: FakeAllocator, model, x) -> int:
    """The allocator's peak over a plain forward and backward, above what was allocated."""
    base = alloc.allocated
    alloc.reset_peak()
    loss_fn(model, x).backward()
    model.zero_grad(set_to_none=True)
    return alloc.peak - base


def planned_steps(plan, sizes, model=None):
    model = model or Net()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step = ftrain.with_activation_checkpoint(ftrain.make_step(loss_fn), plan)
    for i, t in enumerate(sizes):
        state, _ = step(state, batch(t, seed=i))
    return state


def test_warmup_samples_are_their_own_peak_after_a_higher_earlier_one(monkeypatch):
    sizes = [8, 16, 24]
    plan = dynamic(2**40, warmup_iters=3, size_fn=seq_len, measure="cuda",
                   candidates=pattern(under="blocks", level=1), warmup_checkpoint=False)  # fmt: skip
    samples = {}
    for earlier in (0, 64 * 2**20):
        alloc = FakeAllocator()
        install(monkeypatch, alloc)
        with alloc:
            big = torch.empty(earlier, dtype=torch.uint8)  # an evaluation's peak, say
            del big
            state = planned_steps(plan, sizes)
            reference = [plain_peak(alloc, Net(), batch(t, seed=i)) for i, t in enumerate(sizes)]
        planner = state.transforms["activation_checkpoint"].planner
        samples[earlier] = [s["memory"] for s in planner.samples]
        # eager warm-up: a sample is the forward and backward's peak above the start
        assert samples[earlier] == [float(r) for r in reference]
        assert alloc.resets >= len(sizes)
    # before issue 20 the earlier peak hid the samples' own: they came out lower
    assert samples[64 * 2**20] == samples[0]


def test_ftrain_keeps_the_peak_its_resets_hide(monkeypatch):
    alloc = FakeAllocator()
    install(monkeypatch, alloc, available=True)
    big_bytes = 32 * 2**20
    plan = dynamic(2**40, warmup_iters=2, size_fn=seq_len, measure="cuda",
                   candidates=pattern(under="blocks", level=1))  # fmt: skip
    with alloc:
        big = torch.empty(big_bytes, dtype=torch.uint8)
        del big
        planned_steps(plan, [8, 16, 12])
    assert torch.cuda.max_memory_allocated() < big_bytes  # the planner reset CUDA's counter
    assert cuda_peak.max_memory_allocated(0) == big_bytes  # ftrain kept it
    stats = memory_stats("cuda:0")
    assert stats["memory/max_allocated_mib"] == big_bytes / 2**20
    assert stats["memory/max_reserved_mib"] == big_bytes / 2**20


def _reserved_peak(alloc, model, plan, state, t, seed):
    """Reserved peak (cache emptied first) of one planned step at length ``t``."""
    alloc.empty_cache()
    alloc.reset_peak()
    step = ftrain.with_activation_checkpoint(ftrain.make_step(loss_fn), plan)
    state, metrics = step(state, batch(t, seed))
    return state, alloc.peak_reserved, int(metrics["checkpointed_modules"])


@pytest.mark.parametrize("earlier", [0, 64 * 2**20])
def test_budget_binds_on_reserved_memory_with_random_lengths(monkeypatch, earlier):
    frag = 1.5
    alloc = FakeAllocator(fragmentation=frag)
    install(monkeypatch, alloc)
    rng = random.Random(0)
    with alloc:
        big = torch.empty(earlier, dtype=torch.uint8)
        del big
        model = Net()
        weights = alloc.allocated
        eager = plain_peak(alloc, model, batch(48))
        budget = frag * (weights + 0.7 * eager)  # binds at the longer inputs
        plan = dynamic(budget, warmup_iters=4, size_fn=seq_len, measure="cuda",
                       candidates=pattern(under="blocks", level=1))  # fmt: skip
        alloc.empty_cache()
        state = planned_steps(plan, [48, 12, 24, 36], model)  # warm-up
        counts = []
        for i in range(8):
            t = rng.randint(8, 48)
            state, reserved, n = _reserved_peak(alloc, model, plan, state, t, 100 + i)
            assert reserved <= budget, (t, reserved, budget)
            counts.append((t, n))
        assert any(n > 0 for _, n in counts) and any(n == 0 for _, n in counts), counts
        planner = state.transforms["activation_checkpoint"].planner
        assert planner.fitted and planner.fragmentation == pytest.approx(frag, rel=1e-3)
        # budgeting allocated bytes (fragmentation 1) plans fewer checkpoints at 48 tokens
        # and its reserved peak runs over the budget: the out-of-memory this avoids
        naive = planner.copy()
        naive.fragmentation, naive.cache = 1.0, {}
        assert len(naive.plan_for(48, plan)) < len(planner.plan_for(48, plan))
        state.transforms["activation_checkpoint"].planner = naive
        _, reserved, _ = _reserved_peak(alloc, model, plan, state, 48, 7)
        assert reserved > budget


def test_activation_budget_and_its_warning_name_the_terms():
    from ftrain.memory import DynamicPlannerState

    st = DynamicPlannerState(["a"])
    for size in (1.0, 2.0, 3.0):
        st.add_sample(size, 100.0 * size, {"a": (10.0, 1e-3)}, fragmentation=1.2)
    st.fit()
    st.baseline = 50.0
    plan = dynamic(300.0, warmup_iters=3, margin=0.1)
    assert st.fragmentation == 1.2
    assert st.activation_budget(plan) == pytest.approx(300 * 0.9 / 1.2 - 50)
    with pytest.warns(RuntimeWarning, match=r"fragmentation 1\.2 - 50B of weights"):
        assert st.plan_for(3.0, plan) == ["a"]


def test_the_memory_pages_cuda_section_runs():
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "memory.md"
    section = page.read_text(encoding="utf-8").split("### On CUDA", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/concepts/memory.md On CUDA", "exec"), namespace)  # noqa: S102
    assert namespace["budget"] == pytest.approx(8 * 2**30 * 0.95 / 1.25 - 2 * 2**30)
