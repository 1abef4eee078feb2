"""param_groups: MMCV paramwise_cfg rules, checked against values computed by hand."""

import doctest
import importlib
import warnings

import pytest
import torch
from torch import nn

from ftrain.optim import param_groups

LR, WD = 0.1, 0.01


class Net(nn.Module):
    """conv + bn + depthwise conv + group norm + linear/layernorm head + raw params."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))  # 1-D, not a bias: the "flat" rule
        self.pos_embed = nn.Parameter(torch.zeros(1, 8))  # 2-D top-level parameter
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)  # depthwise, with a bias
        self.gn = nn.GroupNorm(2, 8)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))

    def forward(self, x):
        x = self.gn(self.dw(torch.relu(self.bn(self.conv(x)))))
        x = x.mean(dim=(2, 3)) + self.pos_embed
        x = self.head[1](self.head[0](x)) * self.scale
        return self.head[2](x)


class DeformConv2d(nn.Module):
    """Stand-in for mmcv.ops.DeformConv2d (recognised by class name)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, 3, 3))
        self.bias = nn.Parameter(torch.zeros(4))
        self.conv_offset = nn.Conv2d(4, 18, 3, padding=1)


class DeformConv2dPack(DeformConv2d):
    pass


def by_name(groups):
    """{name: (lr, weight_decay, param)} from merged or unmerged groups."""
    out = {}
    for g in groups:
        names = g["names"] if "names" in g else [g["name"]]
        assert len(names) == len(g["params"])
        for n, p in zip(names, g["params"]):
            assert n not in out
            out[n] = (g["lr"], g["weight_decay"], p)
    return out


def assert_values(groups, expected):
    got = {n: (lr, wd) for n, (lr, wd, _) in by_name(groups).items()}
    assert set(got) == set(expected)
    for n, (lr, wd) in expected.items():
        assert got[n] == (pytest.approx(lr), pytest.approx(wd)), n


def test_defaults_give_one_base_group_in_parameter_order():
    model = Net()
    groups = param_groups(model, lr=LR, weight_decay=WD)
    assert len(groups) == 1
    (g,) = groups
    assert (g["lr"], g["weight_decay"]) == (LR, WD)
    assert g["names"] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(g["params"], model.parameters()))
    assert set(g) == {"params", "names", "lr", "weight_decay"}


def test_bias_norm_dwconv_flat_rules_by_hand():
    groups = param_groups(
        Net(),
        lr=LR,
        weight_decay=WD,
        bias_lr_mult=2.0,
        bias_decay_mult=0.5,
        norm_decay_mult=0.0,
        dwconv_decay_mult=0.1,
        flat_decay_mult=0.3,
        merge=False,
    )
    assert all(len(g["params"]) == 1 and isinstance(g["name"], str) for g in groups)
    assert_values(
        groups,
        {
            "scale": (0.1, 0.003),  # 1-D, no other rule -> flat
            "pos_embed": (0.1, 0.01),  # 2-D -> untouched
            "conv.weight": (0.1, 0.01),
            "conv.bias": (0.2, 0.005),
            "bn.weight": (0.1, 0.0),  # norm: decay mult on weight and bias,
            "bn.bias": (0.1, 0.0),  # no bias_lr_mult on norm bias
            "dw.weight": (0.1, 0.001),  # depthwise weight
            "dw.bias": (0.2, 0.005),  # bias rule comes before the dwconv rule
            "gn.weight": (0.1, 0.0),
            "gn.bias": (0.1, 0.0),
            "head.0.weight": (0.1, 0.01),
            "head.0.bias": (0.2, 0.005),
            "head.1.weight": (0.1, 0.0),  # LayerNorm
            "head.1.bias": (0.1, 0.0),
            "head.2.weight": (0.1, 0.01),
            "head.2.bias": (0.2, 0.005),
        },
    )


@pytest.mark.parametrize(
    "norm",
    [
        nn.BatchNorm1d(4),
        nn.SyncBatchNorm(4),
        nn.InstanceNorm1d(4, affine=True),
        nn.GroupNorm(2, 4),
        nn.LayerNorm(4),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_norm_type(norm):
    model = nn.Sequential(nn.Linear(4, 4), norm)
    groups = param_groups(
        model, lr=LR, weight_decay=WD, bias_lr_mult=3.0, bias_decay_mult=0.0, norm_decay_mult=0.5
    )
    assert_values(
        groups,
        {
            "0.weight": (0.1, 0.01),
            "0.bias": (0.3, 0.0),
            "1.weight": (0.1, 0.005),
            "1.bias": (0.1, 0.005),
        },
    )


def test_custom_key_wins_over_every_other_rule():
    groups = param_groups(
        Net(),
        lr=LR,
        weight_decay=WD,
        bias_lr_mult=2.0,
        bias_decay_mult=0.5,
        norm_decay_mult=0.0,
        flat_decay_mult=0.0,
        custom_keys={"head": dict(lr_mult=0.1, decay_mult=3.0), "scale": dict(lr_mult=0.0)},
    )
    got = by_name(groups)
    for n in ["head.0.weight", "head.0.bias", "head.1.weight", "head.1.bias", "head.2.bias"]:
        assert got[n][:2] == (pytest.approx(0.01), pytest.approx(0.03)), n
    # a missing field means 1.0 (scale would otherwise get flat_decay_mult=0)
    assert got["scale"][:2] == (0.0, pytest.approx(0.01))
    assert got["conv.bias"][:2] == (pytest.approx(0.2), pytest.approx(0.005))  # not matched


@pytest.mark.parametrize("reverse", [False, True])
def test_longest_key_wins_whatever_the_dict_order(reverse):
    keys = [
        ("head", dict(lr_mult=0.1)),
        ("head.0", dict(lr_mult=0.5)),
        ("head.0.bias", dict(lr_mult=3.0, decay_mult=0.0)),
    ]
    custom = dict(reversed(keys) if reverse else keys)
    got = by_name(param_groups(Net(), lr=LR, weight_decay=WD, custom_keys=custom))
    assert got["head.0.weight"][:2] == (pytest.approx(0.05), pytest.approx(0.01))
    assert got["head.0.bias"][:2] == (pytest.approx(0.3), 0.0)
    assert got["head.2.weight"][:2] == (pytest.approx(0.01), pytest.approx(0.01))
    assert got["conv.weight"][:2] == (LR, WD)


@pytest.mark.parametrize("reverse", [False, True])
def test_equal_length_keys_tie_break_alphabetically(reverse):
    model = nn.Module()
    model.abc = nn.Linear(2, 2)
    keys = [("bc", dict(lr_mult=2.0)), ("ab", dict(lr_mult=3.0))]
    custom = dict(reversed(keys) if reverse else keys)
    got = by_name(param_groups(model, lr=LR, custom_keys=custom))
    assert got["abc.weight"][0] == pytest.approx(0.3)  # "ab" < "bc"
    assert got["abc.bias"][0] == pytest.approx(0.3)


def test_top_level_params_match_dotted_keys_like_mmcv():
    custom = {".pos_embed": dict(decay_mult=0.0), ".scale": dict(decay_mult=0.0)}
    got = by_name(param_groups(Net(), lr=LR, weight_decay=WD, custom_keys=custom))
    assert got["pos_embed"][:2] == (LR, 0.0)
    assert got["scale"][:2] == (LR, 0.0)
    assert got["conv.weight"][:2] == (LR, WD)


def test_dcn_offset_lr_and_bias_exemptions():
    model = nn.Module()
    model.dcn = DeformConv2d()
    model.pack = DeformConv2dPack()  # subclasses are recognised too
    groups = param_groups(
        model,
        lr=LR,
        weight_decay=WD,
        bias_lr_mult=2.0,
        bias_decay_mult=0.5,
        dcn_offset_lr_mult=0.5,
        flat_decay_mult=0.0,
    )
    expected = {}
    for m in ["dcn", "pack"]:
        expected |= {
            f"{m}.weight": (0.1, 0.01),
            f"{m}.bias": (0.2, 0.005),  # the DCN's own bias is an ordinary bias
            f"{m}.conv_offset.weight": (0.05, 0.01),
            f"{m}.conv_offset.bias": (0.05, 0.01),  # no bias or flat rule inside a DCN
        }
    assert_values(groups, expected)


def test_frozen_params_are_kept_with_base_values_and_their_flag():
    model = Net()
    model.bn.requires_grad_(False)
    groups = param_groups(model, lr=LR, weight_decay=WD, norm_decay_mult=0.0, merge=False)
    got = by_name(groups)
    for n in ["bn.weight", "bn.bias"]:
        lr, wd, p = got[n]
        assert (lr, wd) == (LR, WD) and not p.requires_grad
    assert got["gn.weight"][:2] == (LR, 0.0)
    assert all(p.requires_grad for n, (_, _, p) in got.items() if not n.startswith("bn."))


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.tower = nn.Sequential(self.block, nn.LayerNorm(4))  # shared module
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # tied weights

    def forward(self, idx):
        return self.out(self.tower(self.emb(idx)))


def test_duplicates_raise_naming_both_occurrences():
    with pytest.raises(ValueError, match="bypass_duplicate=True") as err:
        param_groups(Shared(), lr=LR)
    assert "'tower.0.weight'" in str(err.value) and "'block.weight'" in str(err.value)


def test_bypass_duplicate_keeps_first_occurrence_and_warns():
    model = Shared()
    with pytest.warns(UserWarning) as rec:
        groups = param_groups(model, lr=LR, weight_decay=WD, bypass_duplicate=True, merge=False)
    msgs = [str(w.message) for w in rec]
    assert any("'tower.0.weight'" in m and "'block.weight'" in m for m in msgs)
    assert any("'out.weight'" in m and "'emb.weight'" in m for m in msgs)
    assert len(msgs) == 3  # tower.0.weight, tower.0.bias, out.weight
    got = by_name(groups)
    assert list(got) == [
        "emb.weight",
        "block.weight",
        "block.bias",
        "tower.1.weight",
        "tower.1.bias",
    ]
    assert {id(p) for _, _, p in got.values()} == {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(groups, lr=LR)  # torch accepts it: no parameter twice
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()


def test_merge_preserves_per_parameter_values():
    kw = dict(
        lr=LR,
        weight_decay=WD,
        bias_lr_mult=2.0,
        bias_decay_mult=0.0,
        norm_decay_mult=0.0,
        dwconv_decay_mult=0.5,
        flat_decay_mult=0.0,
        custom_keys={"head.2": dict(lr_mult=0.1)},
    )
    model = Net()
    merged = param_groups(model, **kw)
    single = param_groups(model, **kw, merge=False)
    a, b = by_name(merged), by_name(single)
    assert list(b) == [n for n, _ in model.named_parameters()]  # one group each, in order
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n][:2] == b[n][:2] and a[n][2] is b[n][2], n
    pairs = [(g["lr"], g["weight_decay"]) for g in merged]
    assert len(pairs) == len(set(pairs)) == len({v[:2] for v in b.values()})
    # groups come in order of first appearance
    first_seen = list(dict.fromkeys((g["lr"], g["weight_decay"]) for g in single))
    assert pairs == first_seen


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("merge", [True, False])
def test_works_with_torch_optimizers(opt_cls, merge):
    torch.manual_seed(0)
    model = Net()
    groups = param_groups(
        model,
        lr=LR,
        weight_decay=WD,
        norm_decay_mult=0.0,
        custom_keys={"head.2": dict(lr_mult=0.0, decay_mult=0.0)},
        merge=merge,
    )
    opt = opt_cls(groups, lr=1.0, weight_decay=0.0)  # defaults are overridden per group
    frozen_before = model.head[2].weight.detach().clone()
    conv_before = model.conv.weight.detach().clone()
    model(torch.randn(2, 3, 5, 5)).pow(2).mean().backward()
    opt.step()
    assert torch.equal(model.head[2].weight, frozen_before)  # lr 0
    assert not torch.equal(model.conv.weight, conv_before)
    got = by_name(opt.param_groups)
    assert got["bn.weight"][:2] == (LR, 0.0)
    assert got["conv.weight"][:2] == (LR, WD)
    opt.load_state_dict(opt.state_dict())  # the extra name keys round-trip


def test_sgd_applies_each_groups_decay():
    # zero gradients: plain SGD then only decays, p <- p * (1 - lr * wd), per group
    model = Net()
    groups = param_groups(
        model, lr=LR, weight_decay=WD, norm_decay_mult=0.0, bias_decay_mult=0.5, merge=False
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.optim.SGD(groups, lr=LR).step()
    expected_wd = {n: 0.0 if n.startswith(("bn.", "gn.", "head.1.")) else WD for n in before}
    expected_wd |= {
        "conv.bias": 0.005,
        "dw.bias": 0.005,
        "head.0.bias": 0.005,
        "head.2.bias": 0.005,
    }
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] * (1 - LR * expected_wd[n]))


def test_data_parallel_is_unwrapped():
    wrapped = nn.DataParallel(nn.Linear(2, 2), device_ids=[])
    (g,) = param_groups(wrapped, lr=LR)
    assert g["names"] == ["weight", "bias"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lr=-0.1), "lr must be"),
        (dict(weight_decay=-1e-4), "weight_decay must be"),
        (dict(bias_lr_mult=-1.0), "bias_lr_mult must be"),
        (dict(norm_decay_mult=float("nan")), "norm_decay_mult must be"),
        (dict(dwconv_decay_mult=True), "dwconv_decay_mult must be"),
        (dict(flat_decay_mult=-0.5), "flat_decay_mult must be"),
        (dict(dcn_offset_lr_mult="0.1"), "dcn_offset_lr_mult must be"),
        (dict(custom_keys={"head": dict(lr_mul=0.1)}), r"unknown field\(s\) \['lr_mul'\]"),
        (dict(custom_keys={"head": dict(requires_grad=False)}), "requires_grad_"),
        (dict(custom_keys={"head": dict(decay_mult=-1)}), r"custom_keys\['head'\]\['decay_mult'\]"),
        (dict(custom_keys={"head": 0.1}), "must be a dict"),
        (dict(custom_keys=["head"]), "custom_keys must be a dict"),
        (dict(custom_keys={1: dict(lr_mult=1.0)}), "keys must be str"),
    ],
)
def test_invalid_input_raises_value_error_with_fix(kwargs, match):
    kwargs = {"lr": LR, **kwargs}
    with pytest.raises(ValueError, match=match):
        param_groups(Net(), **kwargs)


def test_unknown_key_error_shows_the_fix():
    with pytest.raises(ValueError) as err:
        param_groups(Net(), lr=LR, custom_keys={"head": dict(lr=0.1)})
    assert "'lr_mult' and 'decay_mult'" in str(err.value)
    assert "dict(lr_mult=0.1, decay_mult=0.0)" in str(err.value)


def test_no_warning_without_duplicates():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        param_groups(Net(), lr=LR, bypass_duplicate=True)


@pytest.mark.parametrize("module", ["ftrain.optim", "ftrain.optim.groups"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
