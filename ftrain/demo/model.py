"""The demo's model and data: a tiny character-level transformer on shipped text.

Reusable from benchmarks and notebooks::

    from ftrain.demo.model import CharTransformer, make_dataset, lm_loss

    data = make_dataset(context=64)                  # the shipped corpus, no download
    model = CharTransformer(data.vocab_size, context=64)
    x, y = data.sample(32, generator=torch.Generator().manual_seed(0))
    loss = lm_loss(model, (x, y))
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from importlib import resources

import attrs
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "CharTransformer",
    "CharDataset",
    "Block",
    "CausalSelfAttention",
    "load_corpus",
    "make_dataset",
    "lm_loss",
]

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- data
def load_corpus() -> str:
    """The demo's training text, shipped with the package (``corpus.txt``)."""
    return resources.files("ftrain.demo").joinpath("corpus.txt").read_text(encoding="ascii")


@attrs.frozen(repr=False)
class CharDataset:
    """A text encoded as character ids, split into train and validation parts.

    Attributes:
        chars: the vocabulary, one character per id.
        train: the training ids (1-D ``int64`` tensor).
        val: the held-out ids (the last part of the text).
        context: the length of the windows :meth:`sample` returns.
    """

    chars: str
    train: torch.Tensor
    val: torch.Tensor
    context: int

    @property
    def vocab_size(self) -> int:
        """How many distinct characters (the model's vocabulary size)."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Character ids of ``text`` (unknown characters map to id 0)."""
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index.get(c, 0) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of a sequence of ids."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    def sample(
        self,
        batch_size: int,
        *,
        generator: torch.Generator | None = None,
        split: str = "train",
        device: torch.device | str | None = None,
    ) -> Batch:
        """``batch_size`` random windows ``(x, y)``, ``y`` being ``x`` shifted by one.

        Both are ``(batch_size, context)`` int64 tensors.
        """
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.context - 1, (batch_size,), generator=generator)
        offsets = torch.arange(self.context + 1)
        windows = data[starts[:, None] + offsets]  # (batch, context + 1)
        x, y = windows[:, :-1], windows[:, 1:]
        if device is not None and torch.device(device).type != "cpu":
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
        return x, y

    def batches(
        self,
        batch_size: int,
        *,
        seed: int = 0,
        steps: int | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[Batch]:
        """Random training batches from their own generator (``steps=None``: endless)."""
        generator = torch.Generator().manual_seed(seed)
        n = 0
        while steps is None or n < steps:
            yield self.sample(batch_size, generator=generator, device=device)
            n += 1

    def __repr__(self) -> str:
        return (
            f"CharDataset(vocab={self.vocab_size}, train={len(self.train):,} chars, "
            f"val={len(self.val):,} chars, context={self.context})"
        )


def make_dataset(
    text: str | None = None, *, context: int = 64, val_fraction: float = 0.1
) -> CharDataset:
    """A :class:`CharDataset` of ``text`` (default: the shipped corpus).

    The last ``val_fraction`` of the text is held out for validation.

    Example:
        >>> data = make_dataset("hello world, " * 20, context=8)
        >>> data.vocab_size, data.decode(data.encode("hello"))
        (9, 'hello')
    """
    if text is None:
        text = load_corpus()
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"make_dataset: val_fraction must be in [0, 1), got {val_fraction}.")
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n_val = int(len(ids) * val_fraction)
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    if len(train) <= context + 1 or (n_val and len(val) <= context + 1):
        raise ValueError(
            f"make_dataset: a text of {len(text)} characters is too short for windows of "
            f"{context} (with val_fraction={val_fraction})."
        )
    return CharDataset(chars=chars, train=train, val=val if n_val else train, context=context)


# -------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only earlier ones."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}.")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a 4x GELU MLP, both residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A GPT-style character language model.

    Args:
        vocab_size: number of distinct characters.
        context: the longest sequence it reads (learned position embeddings).
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        dropout: dropout probability (0 for the short demo runs).

    ``model(ids)`` maps ``(batch, time)`` int64 ids to ``(batch, time, vocab)``
    logits; the output layer shares its weights with the token embedding.

    Example:
        >>> m = CharTransformer(vocab_size=10, context=16, d_model=32, n_layers=1, n_heads=2)
        >>> m(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 10])
    """

    def __init__(
        self,
        vocab_size: int,
        context: int = 64,
        d_model: int = 128,
        n_layers: int = 3,
        n_heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} ids is longer than the context ({self.context}).")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        n_new: int,
        *,
        temperature: float = 0.8,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend 1-D ``prompt`` ids by ``n_new`` sampled ids; returns all of them."""
        was_training = self.training
        self.eval()
        try:
            ids = prompt.view(1, -1).to(next(self.parameters()).device)
            for _ in range(n_new):
                logits = self(ids[:, -self.context :])[0, -1].float() / max(temperature, 1e-6)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, -math.inf)
                probs = torch.softmax(logits, dim=-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=generator)
                ids = torch.cat([ids, nxt.view(1, 1).to(ids.device)], dim=1)
            return ids[0]
        finally:
            self.train(was_training)


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) of ``model`` on ``batch = (x, y)``."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
