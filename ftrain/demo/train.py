"""``python -m ftrain.demo``: a small transformer learns to write Python documentation.

A character-level language model trains on the docstrings of standard-library
modules (read from the running Python: nothing is downloaded). Read this file
top to bottom; it is the whole demo:

1. the data: a text, its characters as ids, a resumable shuffled loader;
2. the model and its loss, ``loss_fn(model, batch)``;
3. the step: :func:`ftrain.make_step` with transforms composed on it;
4. the hooks: ftrain's defaults (timer, logger, checkpoints) plus evaluation
   and a best checkpoint;
5. the run: :class:`ftrain.Loop`, into a run directory, resuming what is there
   (:func:`build`; ``python -m ftrain.verify ftrain.demo:build_short`` checks it
   resumes bitwise from every update).

Run it again and it continues from its newest checkpoint (bitwise as if it had
never stopped; the library says "resumed from iter_400.pth (update 400, epoch 3)");
a finished run trains nothing unless ``--steps`` is raised. Ctrl-C saves a checkpoint
to resume from and says so. ``--help`` lists the few options.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

import ftrain

__all__ = ["corpus", "CharTransformer", "loss_fn", "build", "build_short", "sample", "main"]

# ---------------------------------------------------------------------------- 1. the data
#: Well-documented pure-Python modules whose docstrings are the training text.
MODULES = (
    "textwrap", "string", "functools", "collections", "heapq", "bisect", "statistics",
    "fractions", "random", "contextlib", "dataclasses", "enum", "copy", "pprint", "difflib",
    "fnmatch", "shutil", "tempfile", "pathlib", "argparse", "json", "csv", "calendar",
    "queue", "threading", "logging", "inspect", "typing", "subprocess", "datetime",
)  # fmt: skip


@functools.lru_cache(maxsize=4)  # every build reads it
def corpus(size: int = 200_000) -> str:
    """About ``size`` characters of standard-library documentation, pydoc-like.

    Example:
        >>> text = corpus(2_000)
        >>> text.startswith("module textwrap"), len(text) >= 2_000
        (True, True)
    """
    parts: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(f"module {name}\n\n{inspect.getdoc(module) or ''}\n")
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, attr, None)
            doc = inspect.getdoc(obj) if inspect.isfunction(obj) or inspect.isclass(obj) else None
            if attr.startswith("_") or not doc or getattr(obj, "__module__", None) != name:
                continue
            try:
                sig = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                sig = "(...)"
            kind = "class" if inspect.isclass(obj) else "def"
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            parts.append(f"{kind} {attr}{sig}:\n{body}\n")
        if sum(map(len, parts)) >= size:
            break
    text = "\n".join(parts).replace("\t", "    ")
    return "".join(c for c in text if c.isascii() and (c.isprintable() or c == "\n"))


class Windows(torch.utils.data.Dataset):
    """Item ``i``: the ``context`` characters from ``i`` and the same shifted by one."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i : i + self.context + 1]
        return window[:-1], window[1:]


# -------------------------------------------------------------------- 2. the model, the loss
class CharTransformer(nn.Module):
    """A GPT-style model: ``(batch, time)`` character ids -> next-character logits.

    Example:
        >>> m = CharTransformer(vocab_size=10, context=16, d_model=32, layers=1)
        >>> m(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 10])
    """

    def __init__(self, vocab_size: int, context: int, d_model: int = 128, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, d_model // 32, 4 * d_model, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """``ids`` (1-D) extended by ``n`` sampled characters (temperature 0.8)."""
        context = self.pos.num_embeddings
        for _ in range(n):
            logits = self(ids[None, -context:].to(self.head.weight.device))[0, -1].float().cpu()
            nxt = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=generator)
            ids = torch.cat([ids, nxt])
        return ids


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-character cross-entropy, in nats (ln(vocabulary) when guessing)."""
    x, y = (t.to(model.head.weight.device, non_blocking=True) for t in batch)
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


# ----------------------------------------------------------------------- the command line
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's options (``python -m ftrain.demo --help``)."""
    p = argparse.ArgumentParser(
        prog="python -m ftrain.demo",
        description="Train a small character-level transformer into --run-dir. Run again to "
        "resume; a larger --steps (e.g. 5000) trains on, to a better model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=400, help="train until this many updates")
    p.add_argument("--run-dir", default="runs/demo", help="checkpoints and logs; resumed")
    p.add_argument("--lines", action="store_true", help="log lines instead of a progress bar")
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu, cuda, cuda:1...")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


# ------------------------------------- the run as a function: the data, model, step, hooks, Loop
CONTEXT, BATCH_SIZE = 64, 32


def _vocabulary() -> list[str]:
    return sorted(set(corpus()))


def _data() -> tuple[StatefulDataLoader, tuple[torch.Tensor, torch.Tensor]]:
    """The training loader and 256 fixed validation windows (the last 10% of the text)."""
    index = {c: i for i, c in enumerate(_vocabulary())}
    ids = torch.tensor([index[c] for c in corpus()])
    n_val = len(ids) // 10
    # a StatefulDataLoader: its position goes into each checkpoint, so a resumed run
    # reads exactly the batches an uninterrupted one would have
    data = StatefulDataLoader(
        Windows(ids[:-n_val], CONTEXT),
        batch_size=BATCH_SIZE,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    starts = torch.randint(n_val - CONTEXT, (256, 1), generator=torch.Generator().manual_seed(1))
    windows = ids[-n_val:][starts + torch.arange(CONTEXT + 1)]
    return data, (windows[:, :-1], windows[:, 1:])


def sample(model: CharTransformer, n: int = 70) -> str:
    """``n`` characters the model writes after "def " (the same random draws each time)."""
    chars = _vocabulary()
    start = torch.tensor([chars.index(c) for c in "def "])
    out = model.generate(start, n, torch.Generator().manual_seed(0))
    return "".join(chars[i] for i in out)


def _hooks(
    steps: int, val: tuple[torch.Tensor, torch.Tensor], progress: bool
) -> ftrain.hooks.base.Hooks:
    """ftrain's defaults (timer, logger, checkpoints), plus evaluation and the best checkpoint."""

    def evaluate(state: ftrain.TrainState) -> dict[str, torch.Tensor]:
        # EvalHook calls this in eval mode under torch.no_grad()
        tqdm.write(f"  sample at update {state.step}: {sample(state.model)!r}")  # above a bar
        return {"val_loss": loss_fn(state.model, val)}

    eval_every = max(1, steps // 5)
    return ftrain.default_hooks(
        log_every=max(1, steps // 10),
        checkpoint_every=eval_every,
        max_keep=2,
        progress=progress,  # a bar in a terminal or notebook; lines in a pipe or log
        summary=False,
    ).add(
        ftrain.EvalHook(evaluate, every=eval_every, by_epoch=False, at_end=True),
        ftrain.BestCheckpointHook("val_loss"),
    )


def build(
    work_dir: str | os.PathLike,
    resume: str | os.PathLike | None = "auto",
    *,
    steps: int = 400,
    device: str | None = None,
    progress: bool = False,
) -> ftrain.Loop:
    """The demo's run, ``steps`` updates into ``work_dir``, as a :class:`ftrain.Loop` to run.

    ``resume``: ``"auto"`` continues from the newest checkpoint in ``work_dir``. This is the
    function ``python -m ftrain.verify`` takes (see :func:`build_short`).

    Example:
        >>> import tempfile
        >>> lp = build(tempfile.mkdtemp(), steps=2, device="cpu")  # lp.run() trains it
        >>> lp.max_steps, lp.resume, [h.name for h in lp.hooks][-2:]
        (2, 'auto', ['best_val_loss', 'auto_checkpoint'])
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # a model this small gains little from more threads, and on a busy machine threads
        # that wait for each other make it many times slower: one, unless OMP_NUM_THREADS says
        torch.set_num_threads(1)
    torch.manual_seed(0)  # the model's initial weights (the data order has its own seed)
    data, val = _data()  # 1. the data

    # 2. the model and 3. the step: a pure function (state, batch) -> (new state, metrics)
    model = CharTransformer(len(_vocabulary()), CONTEXT).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.99))
    state = ftrain.TrainState.create(model, optimizer)
    step = ftrain.make_step(loss_fn)
    step = ftrain.with_clip(step, "norm", max_norm=1.0)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():  # on a CPU: often slower
        step = ftrain.with_amp(step, dtype="bf16")

    hooks = _hooks(steps, val, progress)  # 4. the hooks
    # 5. the run: resume="auto" continues from the newest checkpoint in work_dir
    return ftrain.Loop(
        step, state, data, hooks=hooks, max_steps=steps, work_dir=work_dir, resume=resume
    )


def build_short(work_dir: str | os.PathLike, resume: str | os.PathLike | None) -> ftrain.Loop:
    """The demo in 12 updates on the CPU: ``python -m ftrain.verify ftrain.demo:build_short``
    checks that it resumes bitwise from every update."""
    return build(work_dir, resume, steps=12, device="cpu")


def main(argv: Sequence[str] | None = None) -> ftrain.TrainState:
    """Train as the command line says; return the final :class:`ftrain.TrainState`."""
    args = parse_args(argv)
    lp = build(args.run_dir, "auto", steps=args.steps, device=args.device, progress=not args.lines)
    model, text = lp.state.model, corpus()
    print(
        f"ftrain demo: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter "
        f"transformer, {len(text):,} characters of text ({len(_vocabulary())} distinct), "
        f"{args.steps} updates of {BATCH_SIZE} x {CONTEXT} on {torch.device(args.device)}\n"
        f"  step: {lp.step!r}"
    )
    # Ctrl-C or SIGTERM: the library saves interrupted.pth, says so in one line and exits
    # (130, or 75 for SIGTERM) without a traceback; the same command then resumes
    state = lp.run()

    run_dir = Path(args.run_dir)
    print(f"sample:\n{sample(state.model, 200)}")
    resumed = f" (this run resumed from {lp.resumed_from.name})" if lp.resumed_from else ""
    print(
        f"checkpoints and metrics.jsonl in {run_dir}/{resumed}: run again to resume, with "
        f"--steps {2 * args.steps} to train further (tensorboard --logdir {run_dir / 'tb'})"
    )
    return state
