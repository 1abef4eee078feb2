"""Activation memory and step time with activation checkpointing and efficient conv-bn eval.

Run::

    python benchmarks/memory.py            # about a minute on one CPU thread
    python benchmarks/memory.py --quick    # fewer timed steps
    python benchmarks/memory.py --device cuda

Workloads:

* ``transformer``: 6 pre-LN blocks (d=128, 4 heads, MLP 4x, SDPA attention),
  batch 8 x 128 tokens, token embedding and LM head (vocab 512), cross-entropy.
* ``convnet``: stem conv + 6 residual ConvBN blocks (32 channels, 3 stages),
  batch 8 x 3 x 64 x 64, BatchNorm in training mode, 10-way classifier.

Variants, each a :class:`ftrain.Step` built with ``with_activation_checkpoint``:

* ``none``: no checkpointing.
* ``every block`` / ``every other block``: ``pattern(under="blocks", level=1[, every=2])``.
* ``selective``: every block with the default per-op policy (keep matmul /
  convolution / attention outputs, recompute pointwise ops).
* ``dynamic 50%`` / ``dynamic 25%``: ``dynamic(max_memory=...)`` over the
  blocks, with the budget a fraction of ``none``'s activation bytes, after
  its warm-up (3 forwards, every candidate checkpointed).
* ``convnet``, BatchNorm frozen (``eval()``): ``conv-bn eval off`` / ``on``
  (``with_efficient_conv_bn_eval``).

Activation bytes are the bytes saved for backward (deduplicated storages,
parameters excluded; :mod:`ftrain.memory.accounting`), measured on one step
with ``monitor=True``; on CUDA the allocator peak of that step is also
shown. Step time is the median of the timed steps (forward, backward, SGD
update) run without monitoring; the variants of a workload are timed
interleaved (round robin, rotating who goes first) so drift and other load
hit them alike; on a shared machine expect a few percent of noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ftrain
from ftrain.memory import dynamic, pattern, selective
from ftrain.transforms.checkpoint import with_activation_checkpoint
from ftrain.transforms.conv_bn import with_efficient_conv_bn_eval


# ---------------------------------------------------------------- workloads
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, heads: int = 4, layers: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.short(x))


class ConvNet(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        chans = [width, width, 2 * width, 2 * width, 4 * width, 4 * width]
        strides = [1, 1, 2, 1, 2, 1]
        cin = width
        blocks = []
        for c, s in zip(chans, strides):
            blocks.append(ResBlock(cin, c, s))
            cin = c
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean((2, 3)))


def ce_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


# ---------------------------------------------------------------- measuring
class Variant:
    """One model + step: warmed up and measured at construction, then timed step by step."""

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        loss_fn: Callable,
        batch: Any,
        decorate: Callable[[ftrain.Step, bool], ftrain.Step],
        *,
        warmup: int,
        device: str,
        frozen_bn: bool = False,
    ) -> None:
        torch.manual_seed(0)
        model = make_model().to(device)
        if frozen_bn:
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.state = ftrain.TrainState.create(model, opt)
        self.batch = batch
        self.cuda = device.startswith("cuda")
        base = ftrain.make_step(loss_fn)
        monitored, self.step = decorate(base, True), decorate(base, False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(warmup):
                self.state, _ = self.step(self.state, batch)
            if self.cuda:
                torch.cuda.synchronize()
                base_mem = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            self.state, m = monitored(self.state, batch)
        self.warned = any("dynamic checkpoint" in str(w.message) for w in caught)
        self.peak = torch.cuda.max_memory_allocated() - base_mem if self.cuda else None
        self.bytes = int(m["activation_bytes"])
        self.ckpt = int(m["checkpointed_modules"])
        self.times: list[float] = []
        self.budget: float | None = None

    def timed_step(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.state, _ = self.step(self.state, self.batch)
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)

    @property
    def ms(self) -> float:
        return statistics.median(self.times) * 1e3


def time_interleaved(variants: list[Variant], rounds: int) -> None:
    """Round-robin timed steps, rotating who goes first, so drift hits all alike."""
    for r in range(rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            v.timed_step()


def checkpoint_variants(none_bytes: int | None) -> list[tuple[str, Callable]]:
    blocks = pattern(under="blocks", level=1)
    out: list[tuple[str, Callable]] = [
        ("none", lambda s, mon: with_activation_checkpoint(s, [], monitor=mon)),
        ("every block", lambda s, mon: with_activation_checkpoint(s, blocks, monitor=mon)),
        (
            "every other block",
            lambda s, mon: with_activation_checkpoint(
                s, pattern(under="blocks", level=1, every=2), monitor=mon
            ),
        ),
        (
            "selective",
            lambda s, mon: with_activation_checkpoint(s, selective(blocks), monitor=mon),
        ),
    ]
    if none_bytes:
        for frac in (0.5, 0.25):
            plan = dynamic(int(frac * none_bytes), warmup_iters=3, candidates=blocks)

            def decorate(s: ftrain.Step, mon: bool, plan: Any = plan) -> ftrain.Step:
                return with_activation_checkpoint(s, plan, monitor=mon)

            decorate.budget = plan.max_memory  # type: ignore[attr-defined]
            out.append((f"dynamic {int(frac * 100)}%", decorate))
    return out


def fmt_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timed steps")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = args.device
    steps = 3 if args.quick else 8
    warmup = 4  # >= the dynamic warm-up (3) + 1

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (8, 129), generator=g)
    lm_batch = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    img_batch = (
        torch.randn(8, 3, 64, 64, generator=g).to(dev),
        torch.randint(0, 10, (8,), generator=g).to(dev),
    )
    workloads = [
        ("transformer", Transformer, lm_loss, lm_batch),
        ("convnet", ConvNet, ce_loss, img_batch),
    ]
    groups: list[tuple[str, list[tuple[str, Variant]]]] = []
    for wname, make_model, loss_fn, batch in workloads:
        none = Variant(make_model, loss_fn, batch, checkpoint_variants(None)[0][1],
                       warmup=warmup, device=dev)  # fmt: skip
        group = [("none", none)]
        for vname, decorate in checkpoint_variants(none.bytes)[1:]:
            v = Variant(make_model, loss_fn, batch, decorate, warmup=warmup, device=dev)
            v.budget = getattr(decorate, "budget", None)
            group.append((vname, v))
        groups.append((wname, group))
    # efficient conv-bn eval, BatchNorm frozen
    group = []
    for vname, decorate in [
        (
            "bn frozen, conv-bn eval off",
            lambda s, mon: with_activation_checkpoint(s, [], monitor=mon),
        ),
        (
            "bn frozen, conv-bn eval on",
            lambda s, mon: with_activation_checkpoint(
                with_efficient_conv_bn_eval(s), [], monitor=mon
            ),
        ),
    ]:
        v = Variant(ConvNet, ce_loss, img_batch, decorate, warmup=2, device=dev, frozen_bn=True)
        group.append((vname, v))
    groups.append(("convnet", group))
    for _, group in groups:
        time_interleaved([v for _, v in group], steps * len(group))

    print(f"torch {torch.__version__}, device {dev}, {torch.get_num_threads()} thread(s), "
          f"median of {steps} timed steps per variant, interleaved")  # fmt: skip
    header = (
        "| workload | variant | ckpt modules | activations MiB | vs none | budget MiB "
        "| step ms | vs none |"
    )
    if dev.startswith("cuda"):
        header += " CUDA peak MiB |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for wname, group in groups:
        ref = group[0][1]
        for vname, v in group:
            budget = fmt_bytes(v.budget).strip()
            if v.warned:
                budget += " (unreachable: warned)"
            line = (
                f"| {wname} | {vname} | {v.ckpt} | {fmt_bytes(v.bytes)} | "
                f"{v.bytes / ref.bytes:.2f}x | {budget} | {v.ms:.1f} | {v.ms / ref.ms:.2f}x |"
            )
            if dev.startswith("cuda"):
                line += f" {fmt_bytes(v.peak)} |"
            print(line)


if __name__ == "__main__":
    main()
