"""Switch activation checkpointing on and off per module, per call.

Example:
    >>> import torch
    >>> from ftrain.memory.apply import CheckpointSwitch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> x = torch.randn(8, 4)
    >>> with CheckpointSwitch(model, ["0", "1"]):
    ...     model(x).sum().backward()
    >>> [n for n, _ in model.named_parameters()]  # names unchanged
    ['0.weight', '0.bias', '2.weight', '2.bias']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from ftrain.memory.accounting import current_accountant

__all__ = [
    "CheckpointSwitch", "checkpoint_call", "norm_layers", "restore_forwards",
    "restore_running_stats"
]  # fmt: skip

ContextFn = Callable[
    [], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]
]


def norm_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Normalization layers inside ``module`` that keep running statistics."""
    return [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]


class restore_running_stats(contextlib.AbstractContextManager):
    """Snapshot the running statistics of ``norms`` on enter, restore them on exit.

    Example:
        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> with restore_running_stats([bn]):
        ...     _ = bn(torch.randn(5, 3))
        >>> bn.num_batches_tracked.item(), bn.running_mean.abs().sum().item()
        (0, 0.0)
    """

    def __init__(self, norms: Iterable[torch.nn.Module]) -> None:
        self.norms = list(norms)
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> restore_running_stats:
        bufs = [
            b for m in self.norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
        ]
        with torch.no_grad():
            self._saved = [(b, b.clone()) for b in bufs if b is not None]
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for buf, value in self._saved:
                buf.copy_(value)
        self._saved = []


@contextlib.contextmanager
def _forward_context(inner: contextlib.AbstractContextManager | None) -> Iterator[None]:
    """The checkpoint's forward context: the user's, then SAC cache accounting."""
    done = False
    with inner if inner is not None else contextlib.nullcontext():
        yield
        done = True  # not when the block raised (even if ``inner`` suppressed it)
    acc, storage = current_accountant(), getattr(inner, "storage", None)
    if done and acc is not None and storage is not None:
        for t in _cached_tensors(list(storage.values())):
            acc.record(t, "selective")


def _cached_tensors(entry: Any) -> Iterable[torch.Tensor]:
    for leaf in tree_leaves(entry):
        leaf = getattr(leaf, "val", leaf)  # torch's _VersionWrapper
        if isinstance(leaf, torch.Tensor):
            yield leaf


@contextlib.contextmanager
def _recompute_context(
    inner: contextlib.AbstractContextManager | None, norms: list[torch.nn.Module]
) -> Iterator[None]:
    """The recomputation's context: the user's, and the norms' running statistics restored."""
    with restore_running_stats(norms), inner if inner is not None else contextlib.nullcontext():
        yield


def _context_fn(norms: list[torch.nn.Module], user: ContextFn | None) -> ContextFn | None:
    """The ``context_fn`` for one checkpointed call (``None``: torch's no-op default)."""
    if not norms and user is None and current_accountant() is None:
        return None

    def context_fn():
        fwd, rec = user() if user is not None else (None, None)
        return _forward_context(fwd), _recompute_context(rec, norms)

    return context_fn


def checkpoint_call(
    fn: Callable[..., Any],
    *args: Any,
    norms: list[torch.nn.Module] | None = None,
    context_fn: ContextFn | None = None,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpointing, RNG preserved.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> checkpoint_call(lambda t: torch.tanh(lin(t)), x).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 3])
    """
    acc = current_accountant()
    ctx_fn = _context_fn(norms or [], context_fn)
    extra = {} if ctx_fn is None else {"context_fn": ctx_fn}
    calls, run = [0], fn
    if acc is not None:
        prologue = acc.checkpoint_prologue()

        def run(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] > 1:  # a recomputation
                return fn(*a, **k)
            prologue.__exit__(None, None, None)  # the inputs are saved: the region starts
            with acc.tap():  # a no-op unless the accountant taps checkpoints
                return fn(*a, **k)

        prologue.__enter__()
    try:
        return checkpoint(
            run, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs
        )
    finally:
        if acc is not None and calls[0] == 0:
            prologue.__exit__(None, None, None)


class CheckpointSwitch(contextlib.AbstractContextManager):
    """Checkpoint the named modules of ``model`` while the block runs.

    ``names``: the modules that *may* be checkpointed; ``active``: those checkpointed for now
    (default: all); ``context_fn``: a ``torch.utils.checkpoint`` ``context_fn`` (selective).

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> with CheckpointSwitch(m, ["0", "1"], active={"1"}) as sw:
        ...     m(torch.ones(1, 2)).sum().backward()
        ...     sw.active = set()  # the next call checkpoints nothing
        >>> "forward" in vars(m[0])  # the instance forward is restored
        False
    """

    def __init__(
        self,
        model: torch.nn.Module,
        names: Iterable[str],
        *,
        active: Iterable[str] | None = None,
        context_fn: ContextFn | None = None,
    ) -> None:
        self.model = model
        self.names = tuple(dict.fromkeys(names))
        self.active: set[str] = set(self.names if active is None else active)
        self.context_fn = context_fn
        self._patched: list[tuple[torch.nn.Module, bool, Any]] = []

    def __enter__(self) -> CheckpointSwitch:
        done: set[int] = set()
        try:
            for name in self.names:
                module = self.model.get_submodule(name)
                if id(module) in done:
                    continue
                done.add(id(module))
                had = "forward" in vars(module)
                previous = vars(module).get("forward")
                module.forward = self._patched_forward(name, module, module.forward)
                self._patched.append((module, had, previous))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_forwards(self._patched)

    def _patched_forward(
        self, name: str, module: torch.nn.Module, original: Callable[..., Any]
    ) -> Callable[..., Any]:
        norms = norm_layers(module)
        switch = self

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if name not in switch.active or not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return checkpoint_call(
                original, *args, norms=norms, context_fn=switch.context_fn, **kwargs
            )

        return forward


def restore_forwards(patched: list[tuple[torch.nn.Module, bool, Any]]) -> None:
    """Undo instance ``forward`` patches, newest first."""
    while patched:
        module, had, previous = patched.pop()
        if had:
            module.forward = previous
        else:
            vars(module).pop("forward", None)
