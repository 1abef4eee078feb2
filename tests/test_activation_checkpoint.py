"""with_activation_checkpoint: gradients equal eager training with every plan."""

import copy

import pytest
import torch

import ftrain
from ftrain.memory import (
    DynamicPlannerState,
    dynamic,
    measure_activations,
    pattern,
    selective,
)
from ftrain.memory.apply import CheckpointSwitch
from ftrain.transforms.remat import CheckpointState, with_activation_checkpoint


class Block(torch.nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.bn = torch.nn.BatchNorm1d(2 * d)
        self.drop = torch.nn.Dropout(p)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class Net(torch.nn.Module):
    def __init__(self, d: int = 8, n: int = 4, p: float = 0.25):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, p) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def batches(n=4, b=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, d, generator=g), torch.randn(b, 1, generator=g)) for _ in range(n)]


def train(plan=None, *, steps=None, amp=False, accum=1, seed=0, **kw):
    torch.manual_seed(seed)
    model = Net(**kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = ftrain.TrainState.create(model, opt)
    step = ftrain.make_step(loss_fn)
    if plan is not None:
        step = with_activation_checkpoint(step, plan)
    if amp:
        step = ftrain.with_amp(step, dtype="bf16", loss_scale=None)
    if accum > 1:
        step = ftrain.with_grad_accum(step, every=accum)
    torch.manual_seed(123)  # dropout masks
    metrics = []
    for batch in steps or batches():
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def assert_same(a, b, *, atol=1e-6):
    ma, mb = a.model, b.model
    pa, pb = dict(ma.named_parameters()), dict(mb.named_parameters())
    assert pa.keys() == pb.keys()  # names unchanged by checkpointing
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=atol, rtol=1e-5, msg=k)
    for (k, x), (_, y) in zip(ma.named_buffers(), mb.named_buffers()):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5, msg=k)  # BN stats as eager


PLANS = {
    "names": ["blocks.0", "blocks.2", "head"],
    "every_block": pattern(under="blocks", level=1),
    "every_other": pattern(under="blocks", level=1, every=2),
    "level2_leaves": pattern(level=3),
    "selective_default": selective(pattern(under="blocks", level=1)),
    "selective_policy": selective(
        ["blocks.1", "blocks.3"],
        lambda ctx, op, *a, **k: (
            torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
            if op is torch.ops.aten.addmm.default
            else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        ),
    ),
    "dynamic_tight": dynamic(64, warmup_iters=2, candidates=pattern(under="blocks", level=1)),
    "dynamic_memory_time": dynamic(
        8000, warmup_iters=1, strategy="memory_time", candidates=pattern(level=2)
    ),
}


@pytest.mark.filterwarnings("ignore:dynamic checkpoint")
@pytest.mark.parametrize("name", list(PLANS))
def test_every_plan_matches_eager_with_dropout_and_batchnorm(name):
    ref, ref_metrics = train()
    got, metrics = train(PLANS[name])
    assert_same(ref, got)
    for a, b in zip(ref_metrics, metrics):
        torch.testing.assert_close(a["loss"], b["loss"])
    assert int(metrics[-1]["checkpointed_modules"]) > 0
    # the BN running stats really moved (so "equal to eager" is meaningful)
    assert int(got.model.blocks[0].bn.num_batches_tracked) == len(batches())


def test_running_stats_not_updated_twice_by_recomputation():
    torch.manual_seed(0)
    model = Net(p=0.0)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 8)
    ref(x).sum().backward()
    with CheckpointSwitch(model, ["blocks.0", "blocks.1"]):
        model(x).sum().backward()
    for (k, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), k


def test_composes_with_autocast_and_accumulation():
    ref, _ = train(amp=True, accum=2)
    got, _ = train(pattern(under="blocks", level=1), amp=True, accum=2)
    assert_same(ref, got, atol=1e-5)
    assert got.step == 2


def test_selective_keeps_matmuls_and_uses_less_than_eager():
    torch.manual_seed(0)
    model = Net(p=0.0)
    x = torch.randn(32, 8)
    eager = measure_activations(model, lambda: model(x).sum())
    plan = selective(pattern(under="blocks", level=1))
    with CheckpointSwitch(model, plan.resolve(model), context_fn=plan.context_fn()):
        sac = measure_activations(model, lambda: model(x).sum())
    with CheckpointSwitch(model, plan.resolve(model)):
        full = measure_activations(model, lambda: model(x).sum())
    assert full.total_bytes < sac.total_bytes < eager.total_bytes
    assert sac.selective_bytes == 4 * 32 * (16 + 8) * 4  # fc1, fc2 outputs of 4 blocks


def test_unknown_names_fail_clearly():
    step = with_activation_checkpoint(ftrain.make_step(loss_fn), ["blocks.0", "blocks.7.fc1"])
    model = Net()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"'blocks\.7\.fc1'.*close matches.*'blocks\.[0-3]\.fc1'"):
        step(state, batches(1)[0])
    state.check_fresh()  # nothing ran: the state is still usable
    with pytest.raises(ValueError, match="Unknown module"):
        with_activation_checkpoint(ftrain.make_step(loss_fn), ["blocks0"], model=model)
    with pytest.raises(TypeError, match="plan"):
        with_activation_checkpoint(ftrain.make_step(loss_fn), 3)


def test_monitor_reports_activation_bytes():
    model = Net(p=0.0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    eager = with_activation_checkpoint(ftrain.make_step(loss_fn), ["head"], monitor=True)
    ck = with_activation_checkpoint(
        ftrain.make_step(loss_fn), pattern(under="blocks", level=1), monitor=True
    )
    b = batches(1)[0]
    state, m1 = eager(state, b)
    # the same state with another plan: that plan's modules are used
    state, m2 = ck(state, b)
    assert int(m2["activation_bytes"]) < int(m1["activation_bytes"])
    assert int(m2["checkpointed_modules"]) == 4
    assert int(m1["checkpointed_modules"]) == 1


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_dynamic_state_lives_in_trainstate_and_survives_resume(tmp_path):
    plan = dynamic(
        6000,
        warmup_iters=3,
        size_fn=lambda x: x.shape[0],
        candidates=pattern(under="blocks", level=1),
    )
    data = [batches(1, b=b, seed=b)[0] for b in (8, 16, 24, 12, 20, 24)]

    def run(state, step, items):
        ms = []
        for batch in items:
            state, m = step(state, batch)
            ms.append(m)
        return state, ms

    torch.manual_seed(0)
    model = Net(p=0.0)
    step = with_activation_checkpoint(ftrain.make_step(loss_fn), plan)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01))
    state, _ = run(state, step, data[:4])
    tstate = state.transforms["activation_checkpoint"]
    assert isinstance(tstate, CheckpointState) and tstate.planner.fitted
    assert len(tstate.planner.samples) == 3 and set(tstate.planner.cache) == {12}
    path = tmp_path / "ckpt.pt"
    torch.save(ftrain.checkpoint.state_dict(state), path)
    state, m_cont = run(state, step, data[4:])

    torch.manual_seed(1)
    model2 = Net(p=0.0)
    state2 = ftrain.TrainState.create(model2, torch.optim.SGD(model2.parameters(), lr=0.01))
    state2 = ftrain.checkpoint.load_state_dict(state2, torch.load(path, weights_only=False))
    state2, m_res = run(state2, step, data[4:])
    p2 = state2.transforms["activation_checkpoint"].planner
    p1 = state.transforms["activation_checkpoint"].planner
    assert len(p2.samples) == 3  # no second warm-up after resume
    assert p2.state_dict() == p1.state_dict()
    assert set(p2.cache) == {12, 20, 24}
    for a, b in zip(m_cont, m_res):
        assert int(a["checkpointed_modules"]) == int(b["checkpointed_modules"])
    assert_same(state, state2)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_dynamic_transform_grads_match_eager_across_sizes():
    sizes = [8, 16, 24, 32, 12, 28, 32]
    data = [batches(1, b=b, seed=i)[0] for i, b in enumerate(sizes)]
    plan = dynamic(
        12000,
        warmup_iters=4,
        size_fn=lambda x: x.shape[0],
        candidates=pattern(under="blocks", level=1),
    )
    ref, _ = train(steps=data)
    got, metrics = train(plan, steps=data)
    assert_same(ref, got)
    n = [int(m["checkpointed_modules"]) for m in metrics]
    assert n[:4] == [4, 4, 4, 4]  # warm-up checkpoints every candidate
    assert n[4] < n[5] <= n[6]  # bigger inputs, more checkpointing


def test_planner_state_is_plain_data():
    st = CheckpointState(("a",), DynamicPlannerState(["a"]))
    sd = st.state_dict()
    assert sd == {"modules": ["a"], "planner": DynamicPlannerState(["a"]).state_dict()}
    assert CheckpointState.from_state_dict(sd).planner.candidates == ["a"]
