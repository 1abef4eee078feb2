"""Activation-checkpointing plans: which modules to checkpoint.

Example:
    >>> import torch
    >>> from ftrain.memory.plans import pattern, resolve_plan
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True)),
    ...     torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU()))
    >>> resolve_plan(pattern(level=2), model)
    ('0.0', '1.0', '1.1')
    >>> resolve_plan(["0", "1"], model)
    ('0', '1')
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ftrain._checks import flag, whole

__all__ = [
    "ModulesPlan", "PatternPlan", "SelectivePlan", "DynamicPlan", "Plan", "modules", "pattern",
    "selective", "dynamic", "as_plan", "resolve_plan", "DEFAULT_SAVE_OPS", "parse_bytes"
]  # fmt: skip


def _ops(*names: str) -> tuple[Any, ...]:
    ops = (getattr(getattr(torch.ops.aten, n, None), "default", None) for n in names)
    return tuple(op for op in ops if op is not None)


#: Ops whose outputs the default selective policy keeps (compute-heavy: matmuls,
#: convolutions, attention); every other op is recomputed.
DEFAULT_SAVE_OPS: tuple[Any, ...] = _ops(
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)  # fmt: skip


# ----------------------------------------------------------------- helpers
def _check_names(model: torch.nn.Module, names: Iterable[str], kind: str = "module") -> None:
    known = [n for n, _ in model.named_modules()]
    unknown = [n for n in names if n not in set(known)]
    if not unknown:
        return
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        hint = f"; close matches: {', '.join(repr(c) for c in close)}" if close else ""
        lines.append(f"  {name!r}{hint}")
    sample = ", ".join(repr(n) for n in known[1:8])
    raise ValueError(
        f"Unknown {kind} name(s) for this model:\n"
        + "\n".join(lines)
        + f"\nNames come from model.named_modules(), e.g. {sample}..."
    )


def _outermost(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` in order, without duplicates and without names nested in another."""
    ordered = list(dict.fromkeys(names))
    chosen = set(ordered)

    def nested(name: str) -> bool:  # "" (the root) and each dotted prefix are its ancestors
        parts = name.split(".")
        return bool(name) and any(".".join(parts[:i]) in chosen for i in range(len(parts)))

    return tuple(name for name in ordered if not nested(name))


def _is_inplace(module: torch.nn.Module) -> bool:
    return getattr(module, "inplace", False) is True


def parse_bytes(value: int | float | str) -> float:
    """Bytes from a number or a string with a unit (``"512MB"``, ``"8GiB"``, ``"1.5e9"``).

    Example:
        >>> parse_bytes("2KiB"), parse_bytes("1.5MB"), parse_bytes(100)
        (2048.0, 1500000.0, 100.0)
    """
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip().replace(" ", "")
    units = {
        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
        "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1,
    }  # fmt: skip
    low = s.lower()
    for unit in sorted(units, key=len, reverse=True):
        if low.endswith(unit):
            return float(low[: -len(unit)]) * units[unit]
    return float(low)


# ------------------------------------------------------------- static plans
@attrs.frozen
class ModulesPlan:
    """Checkpoint exactly these modules (by ``named_modules`` name).

    Example:
        >>> import torch
        >>> m = torch.nn.Module()
        >>> m.encoder = torch.nn.Linear(2, 2)
        >>> ModulesPlan(("encodr",)).resolve(m)
        Traceback (most recent call last):
        ...
        ValueError: Unknown module name(s) for this model:
          'encodr'; close matches: 'encoder'
        Names come from model.named_modules(), e.g. 'encoder'...
    """

    names: tuple[str, ...] = attrs.field(converter=tuple)

    def resolve(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The names, validated against ``model`` (outermost only)."""
        bad = [n for n in self.names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"Module names must be strings, got {bad!r}.")
        _check_names(model, self.names)
        for name in self.names:
            if _is_inplace(model.get_submodule(name)):
                raise ValueError(
                    f"Module {name!r} has inplace=True: checkpointing it would let it overwrite "
                    "the input the checkpoint keeps for recomputation. Checkpoint its parent."
                )
        return _outermost(self.names)


@attrs.frozen
class PatternPlan:
    """Modules selected by depth, name globs and/or types under prefixes."""

    under: tuple[str, ...] = ("",)
    level: int | None | tuple[tuple[str, int], ...] = None
    names: tuple[str, ...] = ()
    types: tuple[type, ...] = ()
    leaves: bool = True
    every: int = 1

    def resolve(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The selected module names in ``model`` (outermost only)."""
        lv = self.level
        levels = dict(lv) if isinstance(lv, tuple) else dict.fromkeys(self.under, lv)
        _check_names(model, list(levels), "prefix")
        selected: list[str] = []
        for prefix, level in levels.items():
            base = model.get_submodule(prefix)
            subs = [(rel, m) for rel, m in base.named_modules() if rel]
            if not subs:
                continue
            filtered = not (self.names or self.types)
            if level is None and filtered:
                deepest = max(rel.count(".") + 1 for rel, _ in subs)
                level = max(1, math.ceil(deepest / 2))
            found = []
            for rel, m in subs:
                depth = rel.count(".") + 1
                if self.names and not any(fnmatch.fnmatchcase(rel, p) for p in self.names):
                    continue
                if self.types and not isinstance(m, self.types):
                    continue
                if level is not None:
                    leaf = next(m.children(), None) is None
                    if not (depth == level or (self.leaves and leaf and depth < level)):
                        continue
                if _is_inplace(m):
                    continue
                found.append(f"{prefix}.{rel}" if prefix else rel)
            found = list(_outermost(found))
            selected.extend(found[:: self.every])
        out = _outermost(selected)
        if not out:
            raise ValueError(f"{self!r} selects no module of {type(model).__name__}.")
        return out


@attrs.frozen
class SelectivePlan:
    """Checkpoint ``modules`` with a selective per-op policy. See :func:`selective`."""

    modules: ModulesPlan | PatternPlan
    policy: Callable[..., Any] | tuple[Any, ...] = DEFAULT_SAVE_OPS

    def resolve(self, model: torch.nn.Module) -> tuple[str, ...]:
        return self.modules.resolve(model)

    def context_fn(self) -> Callable[[], tuple[Any, Any]]:
        """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint``."""
        policy = self.policy
        if isinstance(policy, tuple):
            saved = frozenset(policy)
            policy = functools.partial(_save_listed, saved)
        return functools.partial(create_selective_checkpoint_contexts, policy)


def _save_listed(saved: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


@attrs.frozen
class DynamicPlan:
    """Checkpoint per input size under a memory budget. See :func:`dynamic`."""

    max_memory: float
    warmup_iters: int = 10
    strategy: str = "greedy"
    size_fn: Callable[..., float] | None = None
    candidates: ModulesPlan | PatternPlan = attrs.field(factory=PatternPlan)
    round_to: float = 1.0
    margin: float = 0.0
    measure: str = "auto"
    warmup_checkpoint: bool = True
    bins: int = 512

    def resolve(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The candidate modules."""
        return self.candidates.resolve(model)


Plan: TypeAlias = "ModulesPlan | PatternPlan | SelectivePlan | DynamicPlan"


# ------------------------------------------------------------ constructors
def modules(names: Iterable[str]) -> ModulesPlan:
    """Checkpoint exactly the modules named (as in ``model.named_modules()``).

    Example:
        >>> modules(["encoder.layers.0", "encoder.layers.1"]).names
        ('encoder.layers.0', 'encoder.layers.1')
    """
    if isinstance(names, str):
        names = [names]
    return ModulesPlan(tuple(names))


def pattern(
    *,
    under: str | Sequence[str] = "",
    level: int | Mapping[str, int] | None = None,
    names: str | Sequence[str] = (),
    types: type | Sequence[type] = (),
    leaves: bool = True,
    every: int = 1,
) -> PatternPlan:
    """Select modules like United-Perception's ``checkpoint_patterns``.

    Args:
        under: prefix(es) to search under (``""``: the whole model).
        level: depth below each prefix (1 = its children), or ``{prefix: level}``; default
            (no ``names``/``types``): half the maximum depth under the prefix (UP's).
        names: glob patterns on the name relative to the prefix (``"layers.*"``, ``"*attn"``).
        types: module classes to select.
        leaves: with a level, also select leaf modules shallower than it (UP does: they have
            nothing at the level below them).
        every: keep every ``every``-th match under each prefix (2: every other block).

    Filters combine with AND; ``inplace=True`` modules are excluded; nested matches keep the
    outermost.

    Example:
        >>> import torch
        >>> net = torch.nn.Module()
        >>> net.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
        >>> from ftrain.memory.plans import resolve_plan
        >>> resolve_plan(pattern(under="blocks", level=1, every=2), net)
        ('blocks.0', 'blocks.2')
    """
    if isinstance(under, str):
        under = (under,)
    if isinstance(names, str):
        names = (names,)
    if isinstance(types, type):
        types = (types,)
    whole("pattern: every", every, 1)
    flag("pattern: leaves", leaves)
    lv: Any = level
    if isinstance(level, Mapping):
        lv = tuple((str(k), int(v)) for k, v in level.items())
        if any(v < 1 for _, v in lv):
            raise ValueError(f"pattern: levels must be >= 1, got {dict(level)!r}.")
    elif level is not None and level < 1:
        raise ValueError(f"pattern: level must be >= 1 (1 = children), got {level!r}.")
    return PatternPlan(tuple(under), lv, tuple(names), tuple(types), leaves, every)


def selective(
    plan: Iterable[str] | ModulesPlan | PatternPlan,
    policy: Callable[..., Any] | Iterable[Any] | None = None,
) -> SelectivePlan:
    """Checkpoint ``plan``'s modules, keeping the outputs of some ops.

    ``policy``: ``torch.ops.aten`` overloads to keep (default :data:`DEFAULT_SAVE_OPS`; all
    other ops are recomputed) or a function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``
    as :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` takes.

    Example:
        >>> import torch
        >>> p = selective(["0"], [torch.ops.aten.mm.default])
        >>> p.modules.names
        ('0',)
    """
    base = as_plan(plan)
    if not isinstance(base, (ModulesPlan, PatternPlan)):
        raise TypeError(f"selective: plan must be module names or a pattern, got {plan!r}.")
    if policy is None:
        pol: Callable[..., Any] | tuple[Any, ...] = DEFAULT_SAVE_OPS
    elif callable(policy):
        pol = policy
    else:
        pol = tuple(policy)
        for op in pol:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(
                    f"selective: ops must be OpOverloads such as torch.ops.aten.mm.default, "
                    f"got {op!r}."
                )
    return SelectivePlan(base, pol)


STRATEGIES = ("greedy", "memory_time")


def dynamic(
    max_memory: int | float | str,
    *,
    warmup_iters: int = 10,
    strategy: str = "greedy",
    size_fn: Callable[..., float] | None = None,
    candidates: Iterable[str] | ModulesPlan | PatternPlan | None = None,
    round_to: float = 1.0,
    margin: float = 0.0,
    measure: str = "auto",
    warmup_checkpoint: bool = True,
    bins: int = 512,
) -> DynamicPlan:
    """Checkpoint per input size so activation memory stays under ``max_memory``.

    Args:
        max_memory: the budget in bytes (or ``"512MiB"``-style). On CUDA it bounds the
            caching allocator's *reserved* bytes: weights, gradients, optimizer state and
            activations times the fragmentation (reserved / allocated) measured in warm-up.
        warmup_iters: forward passes measured before planning.
        strategy: ``"greedy"`` (largest saving first) or ``"memory_time"`` (0/1 knapsack: the
            least recompute time that frees enough).
        size_fn: ``size_fn(*args, **kwargs)`` of the model's call -> a number memory grows
            with (sequence length, ``H*W``...).
        candidates: the modules the planner may checkpoint (default: :func:`pattern`'s).
        round_to: sizes are rounded *up* to a multiple of this.
        margin: keep predicted memory under ``max_memory * (1 - margin)``.
        measure: ``"saved"``, ``"cuda"`` or ``"auto"`` (``"cuda"`` for a model on CUDA).
        warmup_checkpoint: checkpoint every candidate during warm-up (safe against OOM; what
            they would have saved is still measured) rather than warming up eagerly.
        bins: resolution of the ``memory_time`` knapsack.

    Example:
        >>> p = dynamic("64MiB", warmup_iters=3, strategy="memory_time", round_to=64)
        >>> p.max_memory, p.strategy
        (67108864.0, 'memory_time')
    """
    _check_dynamic(strategy, warmup_iters, measure, round_to, margin, warmup_checkpoint)
    return DynamicPlan(
        max_memory=_budget(max_memory),
        warmup_iters=int(warmup_iters),
        strategy=strategy,
        size_fn=size_fn,
        candidates=_candidates(candidates),
        round_to=float(round_to),
        margin=float(margin),
        measure=measure,
        warmup_checkpoint=bool(warmup_checkpoint),
        bins=int(bins),
    )


def _check_dynamic(
    strategy: str,
    warmup_iters: int,
    measure: str,
    round_to: float,
    margin: float,
    warmup_checkpoint: bool,
) -> None:
    """Raise on a bad :func:`dynamic` argument, naming it and what it takes."""
    flag("dynamic: warmup_checkpoint", warmup_checkpoint)
    if strategy not in STRATEGIES:
        raise ValueError(f"dynamic: strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if warmup_iters < 1:
        raise ValueError(f"dynamic: warmup_iters must be >= 1, got {warmup_iters!r}.")
    if measure not in ("auto", "saved", "cuda"):
        raise ValueError(f"dynamic: measure must be 'auto', 'saved' or 'cuda', got {measure!r}.")
    if not round_to > 0:
        raise ValueError(f"dynamic: round_to must be > 0, got {round_to!r}.")
    if not 0 <= margin < 1:
        raise ValueError(f"dynamic: margin must be in [0, 1), got {margin!r}.")


def _budget(max_memory: int | float | str) -> float:
    budget = parse_bytes(max_memory)
    if not budget > 0:
        raise ValueError(f"dynamic: max_memory must be > 0, got {max_memory!r}.")
    return budget


def _candidates(
    candidates: Iterable[str] | ModulesPlan | PatternPlan | None,
) -> ModulesPlan | PatternPlan:
    cand = PatternPlan() if candidates is None else as_plan(candidates)
    if not isinstance(cand, (ModulesPlan, PatternPlan)):
        raise TypeError(f"dynamic: candidates must be names or a pattern, got {candidates!r}.")
    return cand


def as_plan(plan: Any) -> Plan:
    """A plan value from a plan or a list of module names.

    Example:
        >>> as_plan(["a", "b"])
        ModulesPlan(names=('a', 'b'))
    """
    if isinstance(plan, (ModulesPlan, PatternPlan, SelectivePlan, DynamicPlan)):
        return plan
    if isinstance(plan, str):
        return ModulesPlan((plan,))
    if isinstance(plan, Iterable):
        names = tuple(plan)
        if all(isinstance(n, str) for n in names):
            return ModulesPlan(names)
    raise TypeError(
        "An activation-checkpoint plan is a list of module names, pattern(...), "
        f"selective(...) or dynamic(...); got {plan!r}."
    )


def resolve_plan(plan: Any, model: torch.nn.Module) -> tuple[str, ...]:
    """The module names ``plan`` checkpoints (candidates, for a dynamic plan)."""
    return as_plan(plan).resolve(model)
