"""The benchmark's built-in models, sized by flags: a transformer, a conv net, an MLP.

Example:
    >>> spec = ModelSpec("mlp", batch_size=4, width=8, layers=2)
    >>> model, batch = spec.build(), spec.batch()
    >>> float(spec.loss(model, batch).detach()) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "MODELS", "ModelSpec", "default_spec", "Block", "Transformer", "ResBlock", "ConvNet", "MLP",
    "lm_loss", "ce_loss"
]  # fmt: skip

#: The built-in model kinds.
MODELS = ("transformer", "convnet", "mlp")

Batch = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ transformer
class Block(nn.Module):
    """A pre-LN transformer block: causal SDPA attention, then an MLP (4x), both residual.

    Example:
        >>> Block(16, heads=2)(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, d: int, heads: int) -> None:
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
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """A small decoder-only language model: embedding, ``layers`` blocks, LayerNorm, head.

    Example:
        >>> Transformer(vocab=32, d=16, heads=2, layers=2)(torch.zeros(2, 7, dtype=torch.long)).shape
        torch.Size([2, 7, 32])
    """

    def __init__(self, vocab: int = 512, d: int = 128, heads: int = 4, layers: int = 6) -> None:
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


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy of a ``(tokens, targets)`` batch.

    Example:
        >>> m = Transformer(vocab=32, d=16, heads=2, layers=1)
        >>> t = torch.zeros(2, 5, dtype=torch.long)
        >>> lm_loss(m, (t, t)).shape
        torch.Size([])
    """
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------- convnet
class ResBlock(nn.Module):
    """Two 3x3 Conv-BN layers with a residual (1x1 Conv-BN when the shape changes).

    Example:
        >>> ResBlock(4, 8, stride=2)(torch.randn(2, 4, 8, 8)).shape
        torch.Size([2, 8, 4, 4])
    """

    def __init__(self, cin: int, cout: int, stride: int) -> None:
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
    """A small ResNet: stem, ``layers`` residual blocks in three stages, pooling, classifier.

    Example:
        >>> ConvNet(width=4, layers=3)(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 32, classes: int = 10, layers: int = 6) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks = []
        cin, stage = width, 0
        for i in range(layers):
            s = 3 * i // layers
            cout = width * 2**s
            blocks.append(ResBlock(cin, cout, 2 if s != stage else 1))
            cin, stage = cout, s
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean((2, 3)))


def ce_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy of a classifier on an ``(inputs, labels)`` batch.

    Example:
        >>> m = MLP(width=4, layers=1, classes=3)
        >>> ce_loss(m, (torch.randn(2, 4), torch.tensor([0, 2]))).shape
        torch.Size([])
    """
    x, y = batch
    return F.cross_entropy(model(x), y)


# -------------------------------------------------------------------------- mlp
class MLP(nn.Module):
    """``layers`` blocks of ``Linear(width, width) -> GELU``, then a classifier.

    Example:
        >>> MLP(width=8, layers=2, classes=3)(torch.randn(5, 8)).shape
        torch.Size([5, 3])
    """

    def __init__(self, width: int = 256, layers: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ------------------------------------------------------------------------ specs
_DEFAULTS: dict[str, dict[str, int]] = {
    "transformer": {"batch_size": 8, "width": 128, "layers": 6, "seq_len": 128},
    "convnet": {"batch_size": 8, "width": 32, "layers": 6, "image_size": 64},
    "mlp": {"batch_size": 256, "width": 512, "layers": 6},
}
# --quick: small enough that a whole subcommand runs in seconds on one CPU thread
_QUICK: dict[str, dict[str, int]] = {
    "transformer": {"batch_size": 8, "width": 64, "layers": 4, "seq_len": 64},
    "convnet": {"batch_size": 8, "width": 8, "layers": 4, "image_size": 16},
    "mlp": {"batch_size": 64, "width": 256, "layers": 4},
}


@dataclass(frozen=True)
class ModelSpec:
    """Which built-in model, at which size; builds the model, its loss and its batches.

    ``width``: transformer ``d_model``, convnet base channels, MLP hidden width; ``layers``:
    the number of ``model.blocks``; the other sizes apply to the kinds they name.

    Example:
        >>> spec = ModelSpec("transformer", batch_size=2, width=16, layers=2, seq_len=8, heads=2)
        >>> tokens, targets = spec.batch()
        >>> tokens.shape, spec.describe()
        (torch.Size([2, 8]), 'transformer d=16 x 2 layers, 2 heads, 2 x 8 tokens, vocab 512')
    """

    kind: str
    batch_size: int
    width: int
    layers: int
    seq_len: int = 128
    image_size: int = 64
    heads: int = 4
    vocab: int = 512
    classes: int = 10

    def __post_init__(self) -> None:
        if self.kind not in MODELS:
            raise ValueError(f"unknown model {self.kind!r}; choose from {', '.join(MODELS)}")
        for name in ("batch_size", "width", "layers", "seq_len", "image_size", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "transformer" and self.width % self.heads:
            raise ValueError(
                f"transformer width (d_model) {self.width} is not divisible by heads {self.heads}"
            )

    # ---------------------------------------------------------------- building
    def build(self, seed: int = 0) -> nn.Module:
        """A fresh model, initialised from ``seed`` (the same weights every call).

        Example:
            >>> spec = ModelSpec("mlp", batch_size=2, width=4, layers=3)
            >>> a, b = spec.build(), spec.build()
            >>> len(a.blocks), torch.equal(a.head.weight, b.head.weight)
            (3, True)
        """
        torch.manual_seed(seed)
        if self.kind == "transformer":
            return Transformer(self.vocab, self.width, self.heads, self.layers)
        if self.kind == "convnet":
            return ConvNet(self.width, self.classes, self.layers)
        return MLP(self.width, self.layers, self.classes)

    @property
    def loss(self) -> Callable[[nn.Module, Batch], torch.Tensor]:
        """The loss function ``loss(model, batch)``."""
        return lm_loss if self.kind == "transformer" else ce_loss

    @property
    def has_batchnorm(self) -> bool:
        """Whether the model has BatchNorm layers (for the conv-bn eval variants)."""
        return self.kind == "convnet"

    def batch(self, batch_size: int | None = None, *, seed: int = 0, device: Any = "cpu") -> Batch:
        """A batch of ``batch_size`` (default :attr:`batch_size`) samples drawn from ``seed``."""
        n = self.batch_size if batch_size is None else batch_size
        task = torch.Generator().manual_seed(1234)
        g = torch.Generator().manual_seed(10_000 + seed)
        if self.kind == "transformer":
            perm = torch.randperm(self.vocab, generator=task)
            tokens = torch.empty(n, self.seq_len + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
            for t in range(self.seq_len):
                tokens[:, t + 1] = perm[tokens[:, t]]
            x, y = tokens[:, :-1], tokens[:, 1:]
        else:
            if self.kind == "convnet":  # smooth patterns (4x4 upsampled), 0.5 per pixel
                shape: tuple[int, ...] = (3, self.image_size, self.image_size)
                coarse = torch.randn(self.classes, 3, 4, 4, generator=task)
                templates = 0.5 * F.interpolate(coarse, size=shape[1:], mode="bilinear")
            else:  # norm ~4 in unit noise: separable, but it takes some training
                shape, scale = (self.width,), 4.0 / self.width**0.5
                templates = torch.randn(self.classes, self.width, generator=task) * scale
            y = torch.randint(0, self.classes, (n,), generator=g)
            x = torch.randn(n, *shape, generator=g) + templates[y]
        return x.contiguous().to(device), y.contiguous().to(device)

    def describe(self) -> str:
        """A one-line description of the model and its batch."""
        b = self.batch_size
        if self.kind == "transformer":
            return (
                f"transformer d={self.width} x {self.layers} layers, {self.heads} heads, "
                f"{b} x {self.seq_len} tokens, vocab {self.vocab}"
            )
        if self.kind == "convnet":
            return (
                f"convnet width {self.width} x {self.layers} res blocks, "
                f"{b} x 3 x {self.image_size} x {self.image_size} images"
            )
        return f"mlp width {self.width} x {self.layers} layers, batch {b}"

    def as_dict(self) -> dict[str, Any]:
        """The fields that matter for this kind, for JSON.

        Example:
            >>> ModelSpec("mlp", batch_size=2, width=4, layers=3).as_dict()
            {'kind': 'mlp', 'batch_size': 2, 'width': 4, 'layers': 3, 'classes': 10}
        """
        d = asdict(self)
        unused = {
            "transformer": ("image_size", "classes"),
            "convnet": ("seq_len", "heads", "vocab"),
            "mlp": ("seq_len", "image_size", "heads", "vocab"),
        }[self.kind]
        for k in unused:
            d.pop(k)
        return d


def default_spec(kind: str, *, quick: bool = False, **overrides: int | None) -> ModelSpec:
    """The default size of ``kind`` (smaller with ``quick``), with ``overrides`` not ``None``.

    Example:
        >>> default_spec("convnet", quick=True, batch_size=4, seq_len=None).batch_size
        4
        >>> default_spec("mlp").width
        512
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; choose from {', '.join(MODELS)}")
    spec = ModelSpec(kind, **(_QUICK if quick else _DEFAULTS)[kind])
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(spec, **given) if given else spec
