"""A model summary: parameters per top-level module, and the memory of weights, grads and optimizer.

:class:`~ftrain.hooks.logging.LoggerHook` prints one when a run starts (not
on resume) and logs its numbers with the run's config (``model.*``)::

    >>> import torch, ftrain
    >>> from ftrain.summary import model_summary
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters()))
    >>> print(model_summary(state))
    model Sequential: 49 parameters (49 trainable)
      module      params  trainable
      0               40         40
      2                9          9
      memory: weights 196 B, grads 196 B, optimizer state 392 B (estimated: AdamW keeps 2 per parameter)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from ftrain.state import TrainState

__all__ = ["ModelSummary", "model_summary", "format_bytes"]

# Optimizer state tensors kept per trainable parameter (same size), before the first step
_STATE_PER_PARAM: dict[str, int | None] = {
    **dict.fromkeys(("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta"), 2),
    "Adagrad": 1,
    "SGD": None,  # 1 with momentum, else 0: read from the param groups
    "RMSprop": None,
}


def format_bytes(n: float) -> str:
    """Bytes in B, KiB, MiB or GiB.

    Example:
        >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(1.5 * 2**30)
        ('512 B', '3.0 MiB', '1.50 GiB')
    """
    if n < 1024:
        return f"{int(n)} B"
    for unit, digits in (("KiB", 1), ("MiB", 1), ("GiB", 2)):
        n /= 1024  # exact: a power of two
        if n < 1024 or unit == "GiB":
            return f"{n:.{digits}f} {unit}"


@attrs.frozen
class ModelSummary:
    """What :func:`model_summary` found: rows per top-level module and memory in bytes.

    ``rows``: ``(module, parameters, trainable)`` per direct child, then ``(self)``;
    ``weight_bytes`` counts parameters and buffers; ``optimizer_bytes`` is estimated
    before the first step (``optimizer_note`` says how).
    """

    name: str
    rows: list[tuple[str, int, int]]
    params: int
    trainable: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int | None
    optimizer_note: str = ""

    @property
    def optimizer_estimated(self) -> bool:
        """Whether the optimizer memory is an estimate (its state is still empty)."""
        return bool(self.optimizer_note)

    def config(self) -> dict[str, Any]:
        """The numbers as flat config entries (``model.params``, ``model.weights_mib``...)."""
        out: dict[str, Any] = {
            "model.params": self.params,
            "model.trainable_params": self.trainable,
            "model.weights_mib": round(self.weight_bytes / 2**20, 3),
            "model.grads_mib": round(self.grad_bytes / 2**20, 3),
        }
        if self.optimizer_bytes is not None:
            out["model.optimizer_state_mib"] = round(self.optimizer_bytes / 2**20, 3)
        for module, n, t in self.rows:
            out[f"model.params.{module}"] = n
            if t != n:
                out[f"model.trainable_params.{module}"] = t
        return out

    def __str__(self) -> str:
        width = max([len("module"), *(len(r[0]) for r in self.rows)])
        lines = [f"model {self.name}: {self.params:,} parameters ({self.trainable:,} trainable)"]
        if self.rows:
            lines.append(f"  {'module':<{width}}  {'params':>10}  {'trainable':>9}")
            rows, rest = self.rows, self.rows[11:]
            if len(rows) > 12:  # the 12th line sums the rest
                n, t = sum(r[1] for r in rest), sum(r[2] for r in rest)
                rows = [*rows[:11], (f"({len(rest)} more)", n, t)]
            for module, n, t in rows:
                lines.append(f"  {module:<{width}}  {n:>10,}  {t:>9,}")
        opt = "?" if self.optimizer_bytes is None else format_bytes(self.optimizer_bytes)
        note = f" ({self.optimizer_note})" if self.optimizer_note else ""
        lines.append(
            f"  memory: weights {format_bytes(self.weight_bytes)}, grads "
            f"{format_bytes(self.grad_bytes)}, optimizer state {opt}{note}"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ModelSummary({self.name}, params={self.params}, trainable={self.trainable})"


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """``(module, parameters, trainable)`` per direct child, then ``(self)``; a parameter
    shared by two modules counts in the first."""
    seen: set[int] = set()
    rows: list[tuple[str, int, int]] = []
    for name, part in [*model.named_children(), ("(self)", model)]:  # (self): its own
        new = [p for p in part.parameters() if id(p) not in seen]
        seen.update(id(p) for p in new)
        if new:
            trainable = sum(p.numel() for p in new if p.requires_grad)
            rows.append((name, sum(p.numel() for p in new), trainable))
    return rows


def _optimizer_bytes(optimizer: torch.optim.Optimizer, grads: int) -> tuple[int | None, str]:
    """The optimizer state's bytes, measured, or estimated before the first step (the note
    says how; ``grads``: the trainable parameters' bytes)."""
    tensors = [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    if tensors:
        return sum(_tensor_bytes(v) for v in tensors if v.dim() > 0), ""
    kind = type(optimizer).__name__
    per = _STATE_PER_PARAM.get(kind, -1)
    if per is None:  # SGD / RMSprop: one buffer with momentum (RMSprop: one more)
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        per = int(momentum) + (kind == "RMSprop")
    if per < 0:
        return None, ""
    return per * grads, f"estimated: {kind} keeps {per} per parameter"


def model_summary(
    state_or_model: TrainState | torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ModelSummary:
    """Summarise a :class:`~ftrain.state.TrainState` (or a module and an optional optimizer).

    Parameters are counted once even when shared; a wrapped model (DDP) is
    summarised through its ``module``. Under FSDP2 the counts are this
    rank's shards.

    Example:
        >>> import torch
        >>> s = model_summary(torch.nn.Linear(3, 2))
        >>> s.params, s.trainable, s.weight_bytes, s.optimizer_bytes
        (8, 8, 32, None)
    """
    if isinstance(state_or_model, torch.nn.Module):
        model = state_or_model
    else:
        model = state_or_model.model
        optimizer = optimizer or state_or_model.optimizer
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(_tensor_bytes(t) for t in [*params, *model.buffers()])
    grads = sum(_tensor_bytes(p) for p in trainable)
    opt_bytes, note = (None, "") if optimizer is None else _optimizer_bytes(optimizer, grads)
    return ModelSummary(
        type(model).__name__, _rows(model), sum(p.numel() for p in params),
        sum(p.numel() for p in trainable), weights, grads, opt_bytes, note,
    )  # fmt: skip
