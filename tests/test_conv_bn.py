"""Efficient conv-bn eval: same results and gradients, less activation memory."""

import pytest
import torch

import ftrain
from ftrain.memory import efficient_conv_bn_eval, measure_activations, pattern
from ftrain.memory.conv_bn import efficient_conv_bn_eval_forward, find_conv_bn_pairs
from ftrain.transforms.conv_bn import with_efficient_conv_bn_eval
from ftrain.transforms.remat import with_activation_checkpoint


class ConvBNReLU(torch.nn.Sequential):
    def __init__(self, cin, cout, bias=False):
        super().__init__(
            torch.nn.Conv2d(cin, cout, 3, padding=1, bias=bias),
            torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU(),
        )


class Residual(torch.nn.Module):
    """A ResNet-style block: conv-bn, relu, conv-bn, plus a 1x1 conv-bn shortcut."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, padding=1, bias=True)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.short = torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 1, bias=False), torch.nn.BatchNorm2d(cout)
        )

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.short(x))


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(ConvBNReLU(3, 8), Residual(8, 8), ConvBNReLU(8, 8))
        self.neck = ConvBNReLU(8, 4, bias=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.neck(self.backbone(x)).mean((2, 3)))


def randomized(model):
    """Non-trivial BN statistics and affine parameters, BN frozen (eval)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            if m.affine:
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.num_features, generator=g))
                    m.bias.copy_(torch.randn(m.num_features, generator=g))
            m.eval()
    return model


def make():
    torch.manual_seed(0)
    return randomized(ConvNet())


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_fused_forward_matches_for_conv_kinds():
    torch.manual_seed(0)
    cases = [
        (torch.nn.Conv1d(3, 6, 3), torch.nn.BatchNorm1d(6), (2, 3, 9)),
        (torch.nn.Conv2d(4, 6, 3, groups=2, bias=False), torch.nn.BatchNorm2d(6), (2, 4, 7, 7)),
        (torch.nn.Conv3d(2, 4, 1), torch.nn.BatchNorm3d(4, affine=False), (1, 2, 3, 4, 5)),
    ]
    for conv, bn, shape in cases:
        randomized(torch.nn.Sequential(bn))
        x = torch.randn(shape)
        torch.testing.assert_close(efficient_conv_bn_eval_forward(conv, bn, x), bn(conv(x)))


def test_pairs_by_fx_and_by_children():
    model = make()
    fx = find_conv_bn_pairs(model)
    assert fx == [
        ("backbone.0.0", "backbone.0.1"),
        ("backbone.1.conv1", "backbone.1.bn1"),
        ("backbone.1.conv2", "backbone.1.bn2"),
        ("backbone.1.short.0", "backbone.1.short.1"),
        ("backbone.2.0", "backbone.2.1"),
        ("neck.0", "neck.1"),
    ]
    assert sorted(find_conv_bn_pairs(model, method="children")) == sorted(fx)
    assert find_conv_bn_pairs(model, ["neck"]) == [("neck.0", "neck.1")]
    with pytest.raises(ValueError, match="'nek'.*'neck'"):
        find_conv_bn_pairs(model, ["nek"])


def test_fx_skips_a_conv_whose_output_is_used_twice():
    class Tapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 1)
            self.bn = torch.nn.BatchNorm2d(2)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y

    m = Tapped()
    assert find_conv_bn_pairs(m) == []
    # pairing by children assumes conv -> bn directly; a forward that puts
    # something in between is caught at run time
    m.eval()
    with efficient_conv_bn_eval(m, method="children") as ctx:
        assert ctx.pairs == [("conv", "bn")]
        with pytest.raises(RuntimeError, match="did not receive the output"):
            m.bn(torch.relu(m.conv(torch.randn(1, 2, 3, 3))))


def test_saves_memory_and_matches_gradients():
    ref, model = make(), make()
    x = torch.randn(4, 3, 16, 16)
    r_eager = measure_activations(ref, lambda: ref(x).square().sum())
    with efficient_conv_bn_eval(model):
        r_fused = measure_activations(model, lambda: model(x).square().sum())
    # each of the 6 pairs stops saving its conv output (4 x C x 16 x 16 floats)
    assert r_fused.total_bytes < 0.75 * r_eager.total_bytes
    g_ref, g = grads(ref), grads(model)
    assert g_ref.keys() == g.keys()
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], atol=1e-4, rtol=1e-4, msg=k)
    assert any(k.endswith("bn1.weight") for k in g)  # gradients reach gamma ...
    assert any(k.endswith("bn1.bias") for k in g)  # ... and beta
    for (k, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), k  # eval BN: statistics untouched


def test_training_mode_bn_runs_unchanged():
    ref, model = make(), make()
    ref.train()
    model.train()
    x = torch.randn(4, 3, 8, 8)
    eager = measure_activations(ref, lambda: ref(x).sum())
    with efficient_conv_bn_eval(model):
        r = measure_activations(model, lambda: model(x).sum())
    assert r.total_bytes == eager.total_bytes
    for (k, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        torch.testing.assert_close(a, b, msg=k)  # statistics updated once, as usual
    for k, v in grads(ref).items():
        torch.testing.assert_close(grads(model)[k], v, atol=1e-5, rtol=1e-5, msg=k)
    assert "forward" not in vars(model.neck[0])  # patches removed on exit


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def run(step, model, n=3):
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        batch = (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 2, (4,), generator=g))
        state, m = step(state, batch)
    return state


def test_transform_matches_eager_and_composes_with_checkpointing():
    base = ftrain.make_step(loss_fn)
    ref = run(base, make())
    fused = run(with_efficient_conv_bn_eval(base, modules=["backbone"]), make())
    assert fused.transforms["efficient_conv_bn_eval"][0] == ("backbone.0.0", "backbone.0.1")
    both = run(
        with_activation_checkpoint(
            with_efficient_conv_bn_eval(base), pattern(under="backbone", level=1)
        ),
        make(),
    )
    for st in (fused, both):
        for (k, a), (_, b) in zip(ref.model.named_parameters(), st.model.named_parameters()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=k)
    with pytest.raises(ValueError, match="Unknown module"):
        with_efficient_conv_bn_eval(base, modules=["backbon"], model=make())


def test_transform_state_round_trips():
    model = make()
    st = run(with_efficient_conv_bn_eval(ftrain.make_step(loss_fn)), model, n=1)
    saved = ftrain.checkpoint.state_dict(st)
    model2 = make()
    st2 = ftrain.TrainState.create(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    st2 = ftrain.checkpoint.load_state_dict(st2, saved)
    step = with_efficient_conv_bn_eval(ftrain.make_step(loss_fn))
    st2 = step.init(st2)
    assert tuple(map(tuple, st2.transforms["efficient_conv_bn_eval"])) == tuple(
        st.transforms["efficient_conv_bn_eval"]
    )
