"""Deterministic activation-memory accounting.

Activation memory: the bytes autograd saves for backward (``saved_tensors_hooks``), deduplicated
by storage, parameters and buffers excluded, DTensors by their local part; attributed to the
innermost running module and inclusively to every module on the stack. Checkpointed regions
count only their inputs (``checkpoint_input_bytes``); ``tap_checkpoints=True`` also counts what
they pack and discard (``recomputed_bytes``, via a private torch hook). Selective-checkpoint
caches are counted by :mod:`ftrain.memory.apply`. A reused storage address counts again once
its tensor died (weak references): the figure errs high, never low.

Example:
    >>> import torch
    >>> from ftrain.memory import measure_activations
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> x = torch.randn(16, 4)
    >>> report = measure_activations(model, lambda: model(x).sum())
    >>> report.total_bytes  # x (16x4), relu output (16x8): 4-byte floats
    768
    >>> report.modules["1"].saved_bytes
    512
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_leaves

from ftrain._checks import flag
from ftrain.memory import cuda_peak

__all__ = [
    "ActivationAccountant", "ActivationReport", "ModuleStats", "measure_activations",
    "current_accountant", "tensor_bytes", "OUTSIDE"
]  # fmt: skip

#: Key of the bytes saved while no tracked module was running (e.g. the loss).
OUTSIDE = "<outside>"

_ACTIVE: list[ActivationAccountant] = []


def current_accountant() -> ActivationAccountant | None:
    """The innermost :class:`ActivationAccountant` currently measuring, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 shards, tensor parallel); ``t`` otherwise."""
    to_local = getattr(t, "to_local", None) if type(t) is not torch.Tensor else None
    try:
        return t if to_local is None else to_local()
    except Exception:  # not a DTensor after all
        return t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """``(data_ptr, nbytes)`` of the storage behind ``t`` (``(0, n)`` if it has none)."""
    t = _local_tensor(t)
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, functional...
        return 0, t.numel() * t.element_size()


def _is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ``nn.Parameter`` or a view of one (e.g. ``weight.t()``).

    Also parameters outside ``model.parameters()``: FSDP2's unsharded all-gathered weights."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors among ``tensors``.

    Example:
        >>> import torch
        >>> x = torch.zeros(10)
        >>> tensor_bytes([x, x[:5], "not a tensor"])
        40
    """
    return sum(n for _, n in _distinct(tensors))


def _distinct(leaves: Iterable[Any]) -> list[tuple[int, int]]:
    """``(data_ptr, nbytes)`` of the distinct storages among the tensors in ``leaves``."""
    out: dict[int, int] = {}
    anon = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            ptr, nbytes = _storage_key(t)
            if ptr:
                out[ptr] = nbytes
            else:
                anon.append((0, nbytes))
    return [*out.items(), *anon]


def _within(owner: str, name: str) -> bool:
    """Whether module ``owner`` is ``name`` or nested in it (by qualified name)."""
    return owner == name or name == "" or owner.startswith(name + ".")


def _alive(entry: tuple[weakref.ref | None, str, str] | None) -> bool:
    """Whether a dedup entry's tensor (so, at least, its storage) is still alive."""
    return entry is not None and (entry[0] is None or entry[0]() is not None)


def _add(acc: Counter, kind: str, nbytes: int, *, top: bool) -> None:
    """Count ``nbytes`` of ``kind`` in ``acc`` (keys: :class:`ModuleStats`' field names)."""
    if kind == "recomputed":
        acc["recomputed_bytes"] += nbytes
        return
    acc["inclusive_bytes"] += nbytes
    if top:
        acc["saved_bytes"] += nbytes
    if kind == "selective":
        acc["selective_bytes"] += nbytes
    elif kind == "checkpoint_input":
        acc["checkpoint_input_bytes"] += nbytes


def _in_backward() -> bool:
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1


@attrs.frozen
class ModuleStats:
    """What one module (all its calls summed) did during a measurement.

    Attributes:
        saved_bytes: bytes first saved while it was the innermost tracked module running.
        inclusive_bytes: bytes first saved while it was running at any depth.
        recomputed_bytes: bytes checkpointed regions inside it packed and discarded (only with
            ``tap_checkpoints=True``).
        selective_bytes: the part of ``inclusive_bytes`` kept by selective-checkpoint caches
            (``checkpoint_input_bytes``: as inputs of checkpoints) inside it.
        input_bytes: distinct storages passed to it; ``input_elsewhere_bytes``: the part
            another module already saved (or would have, in a checkpointed region).
        output_bytes: distinct storages it returned (not among its inputs);
            ``output_self_bytes``: the part it or its submodules saved (or would have).
        forward_time: seconds in its forward (inclusive, wall clock); ``calls``: its calls.
    """

    saved_bytes: int
    inclusive_bytes: int
    recomputed_bytes: int
    selective_bytes: int
    checkpoint_input_bytes: int
    input_bytes: int
    input_elsewhere_bytes: int
    output_bytes: int
    output_self_bytes: int
    forward_time: float = attrs.field(converter=float)
    calls: int

    @property
    def eager_bytes(self) -> int:
        """Estimate of the bytes it would save without checkpointing."""
        return self.inclusive_bytes - self.checkpoint_input_bytes + self.recomputed_bytes

    @property
    def checkpoint_saving(self) -> int:
        """Estimated bytes freed by checkpointing this module (may be negative).

        ``eager - kept inputs - own outputs`` (its consumer saves those instead); additive
        along a chain of modules."""
        kept = self.input_bytes - self.input_elsewhere_bytes
        return self.eager_bytes - kept - self.output_self_bytes


@attrs.frozen
class ActivationReport:
    """The result of a measurement (see :func:`measure_activations`).

    The byte fields are the whole forward's, as :class:`ModuleStats`' (``total_bytes`` is
    ``inclusive_bytes``); ``modules`` by qualified name (:data:`OUTSIDE` for saves outside every
    tracked module); ``cuda_peak_bytes``: on CUDA, the allocator peak of forward and backward
    above what was allocated before (``None`` on CPU).
    """

    total_bytes: int
    recomputed_bytes: int
    selective_bytes: int
    checkpoint_input_bytes: int
    modules: Mapping[str, ModuleStats]
    forward_time: float = 0.0
    backward_time: float = 0.0
    cuda_peak_bytes: int | None = None

    @property
    def eager_bytes(self) -> int:
        """Estimate without checkpointing: ``total - checkpoint_input + recomputed``."""
        return self.total_bytes - self.checkpoint_input_bytes + self.recomputed_bytes

    def table(self, top: int | None = 20) -> str:
        """A text table of the modules saving the most (inclusive) bytes.

        Example:
            >>> import torch
            >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
            >>> print(measure_activations(m, lambda: m(torch.ones(3, 2)).sum()).table())  # doctest: +ELLIPSIS
            module ...
        """
        rows = sorted(self.modules.items(), key=lambda kv: -kv[1].inclusive_bytes)[:top]
        width = max([len("module")] + [len(k or "<root>") for k, _ in rows])
        lines = [
            f"{'module':<{width}}  {'saved':>10}  {'inclusive':>10}  {'recomputed':>10}  "
            f"{'fwd ms':>8}  calls"
        ]
        for name, s in rows:
            lines.append(
                f"{name or '<root>':<{width}}  {_fmt(s.saved_bytes):>10}  "
                f"{_fmt(s.inclusive_bytes):>10}  {_fmt(s.recomputed_bytes):>10}  "
                f"{s.forward_time * 1e3:>8.2f}  {s.calls}"
            )
        lines.append(f"total saved {_fmt(self.total_bytes)}")
        return "\n".join(lines)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}B"


class ActivationAccountant:
    """Context manager measuring the tensors saved for backward inside it.

    Args:
        model: the module whose parameters/buffers are excluded and whose submodules are
            tracked (``modules``: only these qualified names).
        sync: synchronise CUDA around module timings (default: for a model on CUDA).
        tap_checkpoints: also count what checkpointed regions pack and discard.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sigmoid())
        >>> with ActivationAccountant(m) as acc:
        ...     loss = m(torch.ones(2, 3)).sum()
        >>> acc.report().modules["1"].saved_bytes  # sigmoid saves its 2x3 output
        24
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        modules: Iterable[str] | None = None,
        time: bool = True,
        sync: bool | None = None,
        tap_checkpoints: bool = False,
    ) -> None:
        for what, value in (("time", time), ("tap_checkpoints", tap_checkpoints)):
            flag(f"ActivationAccountant: {what}", value)
        flag("ActivationAccountant: sync (None: when the model is on CUDA)", sync, none=True)
        self.model = model
        self._names = None if modules is None else set(modules)
        self._time = time
        if sync is None:
            sync = any(p.is_cuda for p in model.parameters())
        self._sync = bool(sync and torch.cuda.is_available())
        self.tap_checkpoints = tap_checkpoints
        self._excluded: set[int] = set()
        # storage pointer -> (weakref to a tensor on it, kind, owning module)
        self._seen: dict[int, tuple[weakref.ref | None, str, str]] = {}
        self._tapped: dict[int, tuple[weakref.ref | None, str, str]] = {}
        self._prologue = 0
        self._stack: list[tuple[str, float]] = []
        self._acc: dict[str, Counter] = {}
        self._handles: list[Any] = []
        self._hooks: contextlib.ExitStack | None = None
        self._all: Counter = Counter()  # the whole forward's counts

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> ActivationAccountant:
        self._excluded = {
            _storage_key(p)[0] for p in (*self.model.parameters(), *self.model.buffers())
        }
        self._excluded.discard(0)
        self._seen.clear()
        self._tapped.clear()
        self._stack.clear()
        for name, mod in self.model.named_modules():
            if self._names is not None and name not in self._names:
                continue
            self._handles.append(
                mod.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(mod.register_forward_hook(self._post_hook(name), always_call=True))
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._hooks is not None:
            self._hooks.close()
            self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    # ---------------------------------------------------------------- hooks
    def _pre_hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if _in_backward():
                return None
            acc = self._acc.setdefault(name, Counter())
            acc["calls"] += 1
            for ptr, nbytes in _distinct(tree_leaves((args, kwargs))):
                acc["input_bytes"] += nbytes
                owner = self._owner(ptr)
                if owner is not None and not _within(owner, name):
                    acc["input_elsewhere_bytes"] += nbytes
            if self._time and self._sync:  # only to time: no host sync per module otherwise
                torch.cuda.synchronize()
            self._stack.append((name, time.perf_counter() if self._time else 0.0))
            return None

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if _in_backward():
                return None
            # pop up to (and including) this module; tolerates a raising submodule
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i][0] == name:
                    _, t0 = self._stack[i]
                    del self._stack[i:]
                    acc = self._acc[name]
                    if self._time:
                        if self._sync:
                            torch.cuda.synchronize()
                        acc["forward_time"] += time.perf_counter() - t0
                    inputs = {p for p, _ in _distinct(tree_leaves(args))}
                    for ptr, nbytes in _distinct(tree_leaves(output)):
                        if ptr in inputs:
                            continue
                        acc["output_bytes"] += nbytes
                        owner = self._owner(ptr)
                        if owner is not None and _within(owner, name):
                            acc["output_self_bytes"] += nbytes
                    break
            return None

        return hook

    def _owner(self, ptr: int) -> str | None:
        """The module that first saved (or, in a checkpointed region, would have
        saved) storage ``ptr``; a checkpoint's input save owns nothing."""
        if not ptr:
            return None
        real = self._seen.get(ptr)
        if real is not None and real[1] != "checkpoint_input" and _alive(real):
            return real[2]
        tapped = self._tapped.get(ptr)
        if tapped is not None and _alive(tapped):
            return tapped[2]
        return None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _in_backward():
            self.record(t, "checkpoint_input" if self._prologue else "saved")
        return t

    # -------------------------------------------------------------- record
    def record(self, t: torch.Tensor, kind: str = "saved") -> int:
        """Count ``t``'s storage once; returns the bytes newly counted."""
        if _is_parameter(t):
            return 0  # a weight, not an activation (FSDP2's gathered ones included)
        ptr, nbytes = _storage_key(t)
        tapped = kind == "recomputed"
        if ptr:
            if ptr in self._excluded:
                return 0
            seen = self._owner(ptr) is not None if tapped else _alive(self._seen.get(ptr))
            if seen:
                return 0
            # a view (x.t(), x[0]) may die at once while its storage lives on:
            # watch its base instead
            base = t._base if t._base is not None else t
            try:
                ref: weakref.ref | None = weakref.ref(base)
            except TypeError:
                ref = None
            owner = self._stack[-1][0] if self._stack else OUTSIDE
            (self._tapped if tapped else self._seen)[ptr] = (ref, kind, owner)
        if nbytes == 0:
            return 0
        _add(self._all, kind, nbytes, top=True)
        names = [name for name, _ in self._stack] or [OUTSIDE]
        for i, name in enumerate(names):
            _add(self._acc.setdefault(name, Counter()), kind, nbytes, top=i == len(names) - 1)
        return nbytes

    @property
    def total(self) -> int:
        """Bytes saved for backward counted so far."""
        return self._all["saved_bytes"]

    @contextlib.contextmanager
    def checkpoint_prologue(self) -> Iterator[None]:
        """Saves made inside count as a checkpoint's inputs (see :meth:`record`)."""
        self._prologue += 1
        try:
            yield
        finally:
            self._prologue -= 1

    @contextlib.contextmanager
    def tap(self) -> Iterator[None]:
        """Inside a checkpointed region: count what it packs as ``recomputed``."""
        top_fn = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        top = top_fn(False) if (self.tap_checkpoints and top_fn is not None) else None
        if top is None:
            yield
            return
        inner_pack, inner_unpack = top

        def pack(t: torch.Tensor) -> Any:
            self.record(t, "recomputed")
            return inner_pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
            yield

    def current_module(self) -> str | None:
        """Name of the innermost tracked module running now."""
        return self._stack[-1][0] if self._stack else None

    # -------------------------------------------------------------- report
    def report(self, **extra: Any) -> ActivationReport:
        """The measurement so far as an :class:`ActivationReport`."""
        fields = [f.name for f in attrs.fields(ModuleStats)]
        modules = {name: ModuleStats(**{f: a[f] for f in fields}) for name, a in self._acc.items()}
        return ActivationReport(
            total_bytes=self._all["saved_bytes"],
            recomputed_bytes=self._all["recomputed_bytes"],
            selective_bytes=self._all["selective_bytes"],
            checkpoint_input_bytes=self._all["checkpoint_input_bytes"],
            modules=modules,
            **extra,
        )


def measure_activations(
    model: torch.nn.Module,
    fn: Callable[[], Any],
    *,
    backward: bool = True,
    modules: Iterable[str] | None = None,
    tap_checkpoints: bool = False,
    time: bool = True,
) -> ActivationReport:
    """Run ``fn()`` (a forward pass of ``model``) and measure its activations.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> r = measure_activations(m, lambda: m(torch.randn(4, 8)).sum())
        >>> r.total_bytes == 2 * 4 * 8 * 4  # linear input, GELU input
        True
    """
    for what, value in (
        ("backward", backward),
        ("tap_checkpoints", tap_checkpoints),
        ("time", time),
    ):
        flag(f"measure_activations: {what}", value)
    cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        cuda_peak.reset_peak_memory_stats()  # the peak so far stays in ftrain's maximum
    t0 = _now(cuda)
    with ActivationAccountant(
        model, modules=modules, tap_checkpoints=tap_checkpoints, time=time
    ) as acc:
        out = fn()
    t1 = _now(cuda)
    t2 = t1
    if backward:
        loss = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            (loss if loss.numel() == 1 else loss.sum()).backward()
        t2 = _now(cuda)
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    del out
    return acc.report(forward_time=t1 - t0, backward_time=t2 - t1, cuda_peak_bytes=peak)


def _now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
