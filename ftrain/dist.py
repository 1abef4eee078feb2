"""Scale out on ``torch.distributed``: DDP and FSDP2 under ``torchrun`` (or ``srun``).

No engine of its own: :func:`init` from the launcher's environment, :func:`wrap` in DDP or
FSDP2, and the helpers the rest of ftrain uses to behave the same on every rank (see
``docs/distributed.md``). Outside ``torchrun`` every function is a cheap no-op (world size 1).
"""

from __future__ import annotations

import copy
import datetime
import fnmatch
import gc
import itertools
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as tdist

__all__ = [
    "DistInfo", "init", "shutdown", "info", "is_distributed", "is_main", "rank", "world_size",
    "local_rank", "barrier", "broadcast_object", "wrap", "unwrap", "strategy", "is_sharded",
    "reduce_metrics", "sync_buffers", "sync_pending_grads", "hsdp_mesh", "skip_init", "meta_copy",
]  # fmt: skip

# Names ftrain.dist exported before issue 21: what the loop and the saver use internally.
_MOVED = {
    **dict.fromkeys(["StopVote", "side_group", "all_arrive", "gather_object"], "ftrain._agreement"),
    "local_tensor": "ftrain._tensors",
    "SLURM_PORT_BASE": "ftrain._slurm",
    "param_dtypes": "ftrain.transforms.amp",
}

_STRATEGIES = ("ddp", "fsdp2", "hsdp")


# ------------------------------------------------------------------ process group
@attrs.frozen
class DistInfo:
    """Where this process stands: its rank, the world size, its device.

    Example:
        >>> import ftrain
        >>> info = ftrain.dist.init()     # not under torchrun: one process
        >>> info.rank, info.world_size, info.backend
        (0, 1, None)
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the process that writes files)."""
        return self.rank == 0


def _default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _cuda_device(local: int, local_world: int | None) -> torch.device:
    """``cuda:LOCAL_RANK``; more processes on this machine than GPUs is an error."""
    count = torch.cuda.device_count()
    if local >= count or (local_world is not None and local_world > count):
        n = local_world if local_world is not None else local + 1
        raise RuntimeError(
            f"ftrain.dist.init: {n} processes on this machine (local rank {local}) but only "
            f"{count} visible CUDA device(s); several processes on one GPU would share it "
            "silently and slowly (and NCCL refuses it). Start one process per GPU "
            f"(torchrun --nproc-per-node {count}, srun --ntasks-per-node {count}), or pass "
            "backend='gloo' to train on the CPU."
        )
    return torch.device("cuda", local)


def _launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_init(backend: object, timeout: object) -> None:
    if backend is not None and not (isinstance(backend, str) and backend.strip()):
        raise TypeError(
            f"init: backend must be a backend name ('nccl', 'gloo', 'cuda:nccl,cpu:gloo') or "
            f"None (NCCL on CUDA, else gloo), got {backend!r}."
        )
    from ftrain._checks import number  # (dist is a leaf: nothing of ftrain at import)

    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    number("init: timeout", timeout, 0, low_open=True, none=True, why="seconds")


def init(
    backend: str | None = None, *, timeout: float | datetime.timedelta | None = None
) -> DistInfo:
    """Initialise ``torch.distributed`` from the environment ``torchrun`` or ``srun`` sets.

    NCCL on CUDA (device ``cuda:LOCAL_RANK``), gloo otherwise. Idempotent; not launched: world
    size 1.

    Args:
        backend: ``"nccl"``, ``"gloo"``, or e.g. ``"cuda:nccl,cpu:gloo"``.
        timeout: collective timeout, in seconds or as a ``timedelta``.

    Example:
        >>> import ftrain
        >>> info = ftrain.dist.init()
        >>> info.world_size, info.is_main
        (1, True)
    """
    _check_init(backend, timeout)  # in one process too: the script fails here, not under torchrun
    if tdist.is_available() and tdist.is_initialized():
        return info()
    if tdist.is_available() and not _launched():
        from ftrain._slurm import slurm_env  # (dist is a leaf: nothing of ftrain at import)

        os.environ.update(slurm_env(os.environ) or {})  # srun: every task is one process
    if not tdist.is_available() or not _launched():
        return DistInfo(device=_default_device())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    use_cuda = torch.cuda.is_available() and (backend is None or "nccl" in backend)
    if use_cuda:
        device = _cuda_device(local, int(local_world) if local_world else None)
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    kwargs: dict[str, Any] = {"backend": backend}
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None:
        kwargs["timeout"] = timeout
    if use_cuda:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    tdist.init_process_group(**kwargs)
    return info()


def shutdown() -> None:
    """Destroy the process group (end of a ``torchrun`` script); a no-op otherwise.

    Drop your references to the model first: a wrapper destroyed after its process group can
    abort the interpreter (garbage is collected around the call).
    """
    if tdist.is_available() and tdist.is_initialized():
        gc.collect()
        tdist.destroy_process_group()
        gc.collect()


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised."""
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return tdist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes (1 when not distributed)."""
    return tdist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """This process's rank on its machine (``LOCAL_RANK``; 0 when not distributed)."""
    return int(os.environ.get("LOCAL_RANK", "0")) if is_distributed() else 0


def is_main() -> bool:
    """Whether this process is rank 0 (True when not distributed).

    Example:
        >>> import ftrain
        >>> ftrain.dist.is_main()
        True
    """
    return rank() == 0


def info() -> DistInfo:
    """The :class:`DistInfo` of this process, without initialising anything."""
    if not is_distributed():
        return DistInfo(device=_default_device())
    backend = str(tdist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return DistInfo(rank(), world_size(), local_rank(), device, backend)


def barrier() -> None:
    """Wait until every rank gets here (a no-op when not distributed)."""
    if is_distributed():
        tdist.barrier()


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (picklable objects; a no-op alone).

    Example:
        >>> import ftrain
        >>> ftrain.dist.broadcast_object({"path": "runs/x"})
        {'path': 'runs/x'}
    """
    if world_size() == 1:
        return obj
    box = [obj if rank() == src else None]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


# ------------------------------------------------------------------------ wrapping
def strategy(model: torch.nn.Module) -> str | None:
    """``"ddp"``, ``"fsdp2"`` or ``None`` (a plain module).

    Example:
        >>> import torch, ftrain
        >>> ftrain.dist.strategy(torch.nn.Linear(2, 1)) is None
        True
    """
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod  # torch.compile
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if is_sharded(model):
        return "fsdp2"
    return None


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2 ``fully_shard``, tensor parallel)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _to_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or ``t`` (as :func:`ftrain._tensors.local_tensor`: a leaf)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP, FSDP1, ``DataParallel`` and ``torch.compile`` wrappers.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> ftrain.dist.unwrap(m) is m
        True
    """
    # torch.compile's wrapper class, if torch.compile was ever used (importing dynamo
    # just to find out it was not would cost a second)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = eval_frame.OptimizedModule if eval_frame is not None else ()
    while True:
        if compiled and isinstance(model, compiled):
            model = model._orig_mod
        elif type(model).__name__ in _WRAPPERS and isinstance(
            getattr(model, "module", None), torch.nn.Module
        ):
            model = model.module
        else:
            return model


_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


ShardSpec = Sequence[torch.nn.Module | type | str] | Callable[[str, torch.nn.Module], bool]


def _shard_units(model: torch.nn.Module, shard: ShardSpec | None) -> list[torch.nn.Module]:
    """The submodules to ``fully_shard`` before the root, deepest first."""
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    if shard is None:
        picked = [
            m
            for _, ml in named
            if isinstance(ml, torch.nn.ModuleList)
            for m in ml
            if any(True for _ in m.parameters())
        ]
        if not picked:
            picked = [c for c in model.children() if any(True for _ in c.parameters())]
    elif callable(shard) and not isinstance(shard, (list, tuple)):
        picked = [m for n, m in named if shard(n, m)]
    else:
        picked = []
        for spec in shard:
            if isinstance(spec, torch.nn.Module):
                if spec is not model and all(spec is not m for _, m in named):
                    raise ValueError(f"wrap(shard=...): {type(spec).__name__} is not in the model.")
                picked.append(spec)
            elif isinstance(spec, type):
                picked.extend(m for _, m in named if isinstance(m, spec))
            elif isinstance(spec, str):
                found = [m for n, m in named if fnmatch.fnmatchcase(n, spec)]
                if not found:
                    raise ValueError(
                        f"wrap(shard=...): no submodule name matches {spec!r}; names are like "
                        f"{[n for n, _ in named[:5]]}."
                    )
                picked.extend(found)
            else:
                raise TypeError(
                    f"wrap(shard=...): give modules, module classes or name patterns, got {spec!r}."
                )
    depth = {id(m): n.count(".") for n, m in named}
    unique = {id(m): m for m in picked if m is not model}  # first position of each module
    return sorted(unique.values(), key=lambda m: -depth.get(id(m), 0))


def hsdp_mesh(shard_size: int | None = None, device_type: str | None = None) -> Any:
    """A 2-D ``DeviceMesh`` of every rank, ``("replicate", "shard")``, for ``wrap(m, "hsdp")``.

    Each replica of the model is sharded over ``shard_size`` ranks (default: the ranks of one
    machine, ``LOCAL_WORLD_SIZE``) and the ``world_size / shard_size`` replicas average their
    gradients. A collective (every rank calls it).

    Example:
        >>> import torch, ftrain
        >>> m = ftrain.dist.wrap(torch.nn.Linear(4, 2), "hsdp")  # one process: unchanged
        >>> type(m).__name__        # under torchrun: mesh=ftrain.dist.hsdp_mesh(8) by default
        'Linear'
    """
    from torch.distributed.device_mesh import init_device_mesh

    n = world_size()
    size = shard_size if shard_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", n))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or n % size:
        raise ValueError(
            f"hsdp_mesh: shard_size must be a whole number >= 1 dividing the world size {n} "
            f"(ranks that shard one replica), got {size!r}."
        )
    return init_device_mesh(
        device_type or info().device.type, (n // size, size), mesh_dim_names=("replicate", "shard")
    )


def _mp_policy(mixed_precision: Any) -> Any:
    """``wrap(mixed_precision=)`` as FSDP2's ``MixedPrecisionPolicy`` (fp32 reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = dtypes.get(mixed_precision, mixed_precision)  # type: ignore[call-overload]
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            "wrap: mixed_precision must be 'bf16', 'fp16', torch.bfloat16, torch.float16 or a "
            f"torch.distributed.fsdp.MixedPrecisionPolicy, got {mixed_precision!r}."
        )
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _wrap_keywords(strategy: str) -> list[str]:
    """The keyword arguments ``wrap(strategy=...)`` passes on: DistributedDataParallel's or
    fully_shard's (read from torch's signatures, so a torch version's own are accepted)."""
    import inspect

    if strategy == "ddp":
        target, own = torch.nn.parallel.DistributedDataParallel.__init__, {"self", "module"}
        own.add("mixed_precision")  # wrap's own argument (FSDP2's policy)
    else:
        from torch.distributed.fsdp import fully_shard

        target, own = fully_shard, {"module"}
    return [k for k in inspect.signature(target).parameters if k not in own]


def _check_wrap(model: Any, strategy: str, mixed_precision: Any, kwargs: dict) -> None:
    if strategy not in _STRATEGIES:
        raise ValueError(f"wrap: strategy must be one of {_STRATEGIES}, got {strategy!r}.")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap: model must be a torch.nn.Module, got {type(model).__name__}.")
    from ftrain._checks import known_keywords  # (dist is a leaf: nothing of ftrain at import)

    # checked in one process too, where they are otherwise unused: the script fails here,
    # not when it is first launched under torchrun
    known_keywords(f"wrap(strategy={strategy!r})", kwargs, _wrap_keywords(strategy))
    if mixed_precision is None:
        return
    if strategy == "ddp":
        raise ValueError(
            "wrap: mixed_precision is FSDP2's parameter policy; DDP keeps fp32 weights and "
            "computes under with_amp's autocast. Leave mixed_precision out for 'ddp'."
        )
    if "mp_policy" in kwargs:
        raise ValueError("wrap: pass mixed_precision or mp_policy, not both.")
    _mp_policy(mixed_precision)  # a bad value fails before anything is moved


def wrap(
    model: torch.nn.Module,
    strategy: str = "ddp",
    *,
    device: torch.device | str | None = None,
    shard: ShardSpec | None = None,
    init: Callable[[torch.nn.Module], None] | None = None,
    mixed_precision: str | torch.dtype | Any | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """Move ``model`` to this rank's device and wrap it for data parallelism.

    ``"ddp"``: ``DistributedDataParallel(model, **kwargs)``. ``"fsdp2"``: ``fully_shard`` each
    unit of ``shard`` (submodules, classes, name patterns or a ``(name, module) -> bool``;
    default: the members of every ``nn.ModuleList``, else each child with parameters), deepest
    first, then the root; ``"hsdp"``: on :func:`hsdp_mesh` (or a 2-D ``mesh=``). FSDP2's
    ``mixed_precision``: ``"bf16"``/``"fp16"`` (gathered and computed in, gradients reduced in
    fp32) or a ``MixedPrecisionPolicy``; ``with_amp`` needs it. Build the optimizer after
    this call. A meta-device model is filled with NaN, initialised (``init(model)``, else each
    submodule's ``reset_parameters()``/``_reset_parameters()``, children first) and checked.

    Example:
        >>> import torch, ftrain
        >>> model = ftrain.dist.wrap(torch.nn.Linear(4, 2), "ddp")   # one process: unchanged
        >>> type(model).__name__
        'Linear'
    """
    _check_wrap(model, strategy, mixed_precision, kwargs)
    dev = torch.device(device) if device is not None else info().device
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if not is_distributed() or strategy == "ddp":
        model = _materialise(model, dev, init) if on_meta else model.to(dev)
    if not is_distributed():
        return model
    if strategy == "ddp":
        if dev.type == "cuda":
            kwargs.setdefault("device_ids", [dev.index if dev.index is not None else 0])
        wrapped = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        _WRAPS[wrapped] = {"strategy": "ddp", "kwargs": dict(kwargs)}
        return wrapped
    if mixed_precision is not None:
        kwargs["mp_policy"] = _mp_policy(mixed_precision)
    _shard(model, strategy, dev, shard, kwargs)
    if on_meta:
        offload = kwargs.get("offload_policy")
        target = torch.device("cpu") if type(offload).__name__ == "CPUOffloadPolicy" else dev
        _materialise(model, target, init)
    return model


def _shard(
    model: torch.nn.Module, strategy: str, dev: torch.device, shard: Any, kwargs: dict
) -> None:
    """``fully_shard`` the units, then the root, on a 1-D (FSDP2) or 2-D (HSDP) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if "mesh" not in kwargs:
        two_d = strategy == "hsdp"
        kwargs["mesh"] = hsdp_mesh() if two_d else init_device_mesh(dev.type, (world_size(),))
    if strategy == "hsdp" and kwargs["mesh"].ndim != 2:
        raise ValueError(
            f"wrap(strategy='hsdp'): mesh must be 2-D (replicate x shard), got a "
            f"{kwargs['mesh'].ndim}-D one; use ftrain.dist.hsdp_mesh(shard_size)."
        )
    # No model.to(device): fully_shard moves one unit at a time, keeping only this rank's shard
    # (the whole model never sits on one GPU); a meta model stays so until initialised.
    units = _shard_units(model, shard)
    names = {id(m): n for n, m in model.named_modules()}
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    _WRAPS[model] = {
        "strategy": strategy,
        "kwargs": dict(kwargs),
        "units": [names[id(u)] for u in units],
    }


# ------------------------------------------------------------- meta-device init
def skip_init(model: torch.nn.Module) -> None:
    """``wrap(init=skip_init)``: leave a meta-device model's tensors unset (NaN) because a
    checkpoint will fill them (``ftrain.checkpoint.load_weights``); no check after wrap.

    Example:
        >>> import torch, ftrain
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> model = ftrain.dist.wrap(model, "ddp", init=ftrain.dist.skip_init)
        >>> bool(model.weight.isnan().all())
        True
    """


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(itertools.chain(model.named_parameters(), model.named_buffers()))


def _materialise(
    model: torch.nn.Module, device: torch.device, init: Callable[[torch.nn.Module], None] | None
) -> torch.nn.Module:
    """Allocate a meta model's tensors on ``device`` (real ones keep their values), fill
    them with NaN, initialise, and check that nothing was left unset."""
    real = {n: t for n, t in _tensors(model).items() if not t.is_meta}
    model = model.to_empty(device=device)
    marks: dict[str, tuple[torch.Tensor, int]] = {}
    with torch.no_grad():
        for name, t in _tensors(model).items():
            if name in real:
                _to_local(t).copy_(_to_local(real[name]))
                continue
            if t.is_floating_point() or t.is_complex():
                _to_local(t).fill_(float("nan"))
            marks[name] = (t, t._version)
        if init is skip_init:
            return model
        if init is not None:
            init(model)
        else:
            _reset(model, set())
    _check_initialised(model, marks)
    return model


def _reset(module: torch.nn.Module, seen: set[int]) -> None:
    """``reset_parameters()`` (else ``_reset_parameters()``) of each submodule, children
    first: the order their ``__init__`` ran in."""
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        _reset(child, seen)
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def _unset(t: torch.Tensor, before: tuple[torch.Tensor, int]) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(_to_local(t)).any())
    return t is before[0] and t._version == before[1]  # never written


def _check_initialised(model: torch.nn.Module, marks: dict[str, tuple[torch.Tensor, int]]) -> None:
    now = _tensors(model)
    names = [n for n in marks if n in now]
    flags = torch.tensor([_unset(now[n], marks[n]) for n in names], dtype=torch.uint8)
    if is_distributed() and names:  # a shard left unset on any rank: every rank raises
        flags = flags.to(info().device)
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
    unset = [n for n, bad in zip(names, flags.tolist()) if bad]
    if unset:
        raise RuntimeError(
            f"dist.wrap: after initialising the meta-device model, {unset} still hold no "
            "values (they were filled with NaN before initialisation). wrap calls each "
            "submodule's reset_parameters() (else _reset_parameters(), as "
            "nn.MultiheadAttention has), children first, or your init=(model). Set these in "
            "their module's reset_parameters() (a buffer computed in __init__, e.g. a RoPE "
            "table, must be computed again there), create such a buffer with an explicit "
            "device= in __init__ (real tensors keep their values), or pass init=. If a "
            "checkpoint fills them, pass init=ftrain.dist.skip_init."
        )


#: What wrap() did to each model it returned (clone() wraps copies the same way).
_WRAPS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------- copying
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_HOOK_FLAGS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _is_torch_dist_hook(fn: Any) -> bool:
    fn = getattr(fn, "func", fn)  # functools.partial
    owner = getattr(fn, "__self__", None)
    where = getattr(getattr(fn, "__func__", fn), "__module__", "") or ""
    if owner is not None:
        where = type(owner).__module__ + " " + where
    return "torch.distributed" in where


def _plain_copy(
    module: torch.nn.Module, params: dict[int, torch.Tensor], done: dict[int, torch.nn.Module]
) -> torch.nn.Module:
    """A copy of ``module``'s tree without FSDP2: new module objects of the user's classes,
    parameters from ``params`` (by id), buffers cloned, torch.distributed's hooks and
    markers left out; other attributes shared (shallow)."""
    if id(module) in done:
        return done[id(module)]
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        mro = cls.__mro__
        cls = mro[mro.index(FSDPModule) + 1]
    new = cls.__new__(cls)
    done[id(module)] = new
    state = {
        k: v
        for k, v in module.__dict__.items()
        if not (k.startswith("_fsdp") or k.startswith("_is_fsdp") or "composable" in k)
    }
    state["_parameters"] = {
        k: None if p is None else params[id(p)] for k, p in module._parameters.items()
    }
    state["_buffers"] = {
        k: None if b is None else b.detach().clone() for k, b in module._buffers.items()
    }
    state["_modules"] = {
        k: None if m is None else _plain_copy(m, params, done) for k, m in module._modules.items()
    }
    for name in _HOOK_DICTS:
        if name in state:
            kept = ((k, fn) for k, fn in state[name].items() if not _is_torch_dist_hook(fn))
            state[name] = type(state[name])(kept)
    for name in _HOOK_FLAGS:
        if name in state:
            state[name] = type(state[name])(state[name])
    new.__dict__.update(state)
    return new


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of ``model``'s tree with parameters on the meta device, at full shape.

    DDP, FSDP2 and ``torch.compile`` wrappers and torch.distributed's hooks are left out;
    each parameter keeps its global (unsharded) shape, dtype and ``requires_grad``; buffers
    are cloned. For counting (FLOPs, shapes) with no collective and no weights in memory.

    Example:
        >>> import torch, ftrain
        >>> copy = ftrain.dist.meta_copy(torch.nn.Linear(4, 2))
        >>> copy.weight.device.type, tuple(copy.weight.shape)
        ('meta', (2, 4))
    """
    model = unwrap(model)
    meta = {
        id(p): torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
        )
        for p in model.parameters()
    }
    return _plain_copy(model, meta, {})


def copy_wrapped(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, transforms: dict[str, Any]
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]] | None:
    """``TrainState.clone()`` of a DDP or FSDP2 model (``None``: not one)."""
    kind = strategy(model)
    if kind == "ddp":
        return _copy_ddp(model, optimizer, transforms)
    if kind == "fsdp2":
        return _copy_fsdp2(model, optimizer, transforms)
    return None


def _copy_ddp(
    model: Any, optimizer: torch.optim.Optimizer, transforms: dict[str, Any]
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    inner = model.module
    memo: dict[int, Any] = {}
    inner2, opt2, tr2 = copy.deepcopy((inner, optimizer, transforms), memo)
    for src, dst in zip(inner.parameters(), inner2.parameters(), strict=True):
        if src.grad is not None:
            dst.grad = src.grad.detach().clone()
    kwargs = dict(_WRAPS.get(model, {}).get("kwargs", {}))
    if not kwargs:
        kwargs = {
            "device_ids": model.device_ids,
            "output_device": model.output_device,
            "broadcast_buffers": model.broadcast_buffers,
            "find_unused_parameters": model.find_unused_parameters,
            "gradient_as_bucket_view": model.gradient_as_bucket_view,
            "process_group": model.process_group,
        }
    return torch.nn.parallel.DistributedDataParallel(inner2, **kwargs), opt2, tr2


def _copy_fsdp2(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, transforms: dict[str, Any]
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    spec = _WRAPS.get(model, {})
    # gradients of a partial window that FSDP2 holds unsharded go into the sharded
    # .grad first (a reduce-scatter now instead of at the boundary: the same sum)
    _fsdp2_reduce_pending(model)
    old_params = list(model.parameters())
    meta = {
        id(p): torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
        )
        for p in old_params
    }
    new = _plain_copy(model, meta, {})
    kwargs = {"mesh": old_params[0].device_mesh, **spec.get("kwargs", {})}
    names = spec.get("units")
    if names is None:
        names = [n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n]
        names.sort(key=lambda n: -n.count("."))
    for name in names:
        fully_shard(new.get_submodule(name), **kwargs)
    fully_shard(new, **kwargs)
    new.to_empty(device=old_params[0].to_local().device)
    new_params = list(new.parameters())
    with torch.no_grad():
        for src, dst in zip(old_params, new_params, strict=True):
            dst.to_local().copy_(src.to_local())
            if src.grad is not None:
                dst.grad = src.grad.detach().clone()
        for src, dst in zip(model.buffers(), new.buffers(), strict=True):
            dst.copy_(src)
    memo = {id(p): q for p, q in zip(old_params, new_params)}
    opt2, tr2 = copy.deepcopy((optimizer, transforms), memo)
    _WRAPS[new] = spec
    return new, opt2, tr2


# ----------------------------------------------------------- partial windows
def sync_pending_grads(model: torch.nn.Module) -> None:
    """All-reduce gradients that accumulated without synchronisation; a collective.

    A partial accumulation window at the end of the data had no synchronising backward: call
    this before ``step.flush(state)`` in a hand-written loop (the loop does). Idempotent.
    """
    kind = strategy(model)
    if kind == "fsdp2":
        _fsdp2_reduce_pending(model)
    elif kind == "ddp" and world_size() > 1:
        _ddp_average_grads(model)


def _ddp_average_grads(model: torch.nn.Module) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    has = has.to(info().device)
    tdist.all_reduce(has, op=tdist.ReduceOp.MAX)  # a rank may lack a gradient
    for p, flag in zip(params, has.tolist()):
        if flag and p.grad is None:
            p.grad = torch.zeros_like(p)
    _reduce_flat([("mean", p.grad) for p in params if p.grad is not None])


def _reduce_flat(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Average (``"mean"``) or broadcast from rank 0 each tensor in place (one flat buffer
    per kind, device and dtype)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple[str, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for how, t in tensors:
        groups.setdefault((how, t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (how, _, _), ts in groups.items():
            flat = _flatten_dense_tensors([t.detach() for t in ts])
            if how == "mean":
                tdist.all_reduce(flat)
                flat /= world_size()
            else:
                tdist.broadcast(flat, src=0)
            for t, synced in zip(ts, _unflatten_dense_tensors(flat, ts)):
                t.copy_(synced)


def _fsdp2_reduce_pending(model: torch.nn.Module) -> None:
    """Reduce-scatter the gradients FSDP2 accumulated unsharded (no public API does)."""
    from torch.distributed.fsdp import FSDPModule

    try:
        states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
        if not states or getattr(states[0], "_is_root", None) is None:
            return  # no forward ran yet (a fresh clone): nothing is pending
        for st in reversed(states):  # the order backward would reach them
            for group in st._fsdp_param_groups:
                group.reduce_grads = True
                group.post_backward()
        for st in states:
            for group in st._fsdp_param_groups:
                group.finalize_backward()
                group._training_state = type(group._training_state).IDLE
        comm = states[0]._comm_ctx
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None
        for rs in comm.reduce_scatter_states:
            if rs.event is not None and stream is not None:
                stream.wait_event(rs.event)
        comm.reduce_scatter_states.clear()
    except AttributeError as exc:  # pragma: no cover - FSDP2 internals of another torch
        raise RuntimeError(
            "ftrain could not reduce the gradients of a partial accumulation window with this "
            f"torch's FSDP2 ({exc}). Make each epoch a whole number of windows (len(data) "
            "divisible by with_grad_accum's `every`) or report this."
        ) from exc


# ------------------------------------------------------------------------ metrics
def _mean(values: list[float]) -> float:
    """The mean; exactly the value when every rank has the same one (no rounding)."""
    first = values[0]
    if all(v == first for v in values):
        return first
    return sum(values) / len(values)


_OPS: dict[str, Callable[[list[float]], float]] = {
    "mean": _mean,
    "sum": sum,
    "max": max,
    "min": min,
}


def _as_number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and not value.is_complex() else None
    return float(value) if isinstance(value, (bool, int, float)) else None


def _agree_names(names: list[str]) -> list[str]:
    """The union of every rank's metric names, sorted (two small tensor all-reduces)."""
    device = info().device
    mine = torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([mine.numel()], device=device)
    tdist.all_reduce(length, op=tdist.ReduceOp.MAX)
    table = torch.zeros(world_size(), int(length), dtype=torch.uint8, device=device)
    table[rank(), : mine.numel()] = mine
    tdist.all_reduce(table)  # each rank fills its own row: a gather
    rows = (bytes(row.tolist()).rstrip(b"\0").decode() for row in table.cpu())
    return sorted({n for row in rows for n in row.split("\n") if n})


#: The metric names agreed by the last reduce_metrics: [default group, names]
_NAMES: list[Any] = [None, []]


def _metric_table(local: dict[str, float]) -> tuple[list[str], torch.Tensor]:
    """Every rank's values of the agreed names, and whether each rank has each, in one
    float64 all-reduce: row r is rank r's ``[values, present, has a name not agreed]``."""
    world = tdist.group.WORLD
    names = _NAMES[1] if _NAMES[0] is world else []
    while True:
        n, index = len(names), {k: i for i, k in enumerate(names)}
        row = torch.zeros(2 * n + 1, dtype=torch.float64)
        for key, value in local.items():
            if key in index:
                row[index[key]], row[n + index[key]] = value, 1.0
            else:
                row[2 * n] = 1.0
        table = torch.zeros(world_size(), 2 * n + 1, dtype=torch.float64, device=info().device)
        table[rank()] = row.to(table.device)
        tdist.all_reduce(table)
        table = table.cpu()
        if not table[:, 2 * n].any():
            return names, table
        names = _agree_names(sorted(set(names) | set(local)))  # a new name somewhere
        _NAMES[:] = [world, names]


def reduce_metrics(
    metrics: Mapping[str, Any], op: str = "mean", *, ops: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Combine each rank's numbers into one value per name, on every rank.

    A collective: one float64 all-reduce of ``world_size x (2 x names + 1)`` numbers (the
    names are agreed again, with two more, only when a rank reports a new one). ``op`` (or
    per name, ``ops={"skipped": "sum"}``): ``"mean"``, ``"sum"``, ``"max"``, ``"min"``;
    names only some ranks report combine over those ranks.

    Example:
        >>> import torch, ftrain
        >>> ftrain.dist.reduce_metrics({"loss": torch.tensor(0.5), "n": 3})
        {'loss': 0.5, 'n': 3.0}
    """
    for name in (op, *(ops or {}).values()):
        if name not in _OPS:
            raise ValueError(f"reduce_metrics: op must be one of {sorted(_OPS)}, got {name!r}.")
    local = {k: n for k, v in metrics.items() if (n := _as_number(v)) is not None}
    if world_size() == 1:
        return local
    names, table = _metric_table(local)
    n, out = len(names), {}
    for key in [*local, *(k for k in names if k not in local)]:
        i = names.index(key)
        values = [float(v) for v, has in zip(table[:, i], table[:, n + i]) if has]
        if values:
            out[key] = float(_OPS[(ops or {}).get(key, op)](values))
    return out


# ------------------------------------------------------------------------ buffers
def sync_buffers(model: torch.nn.Module, mode: str = "mean") -> None:
    """Make ``model``'s buffers equal on every rank (BatchNorm running statistics).

    ``"mean"`` averages float buffers and copies the others from rank 0; ``"broadcast"``
    copies all from rank 0. A collective; a no-op when not distributed.
    """
    if mode not in ("mean", "broadcast"):
        raise ValueError(f"sync_buffers: mode must be 'mean' or 'broadcast', got {mode!r}.")
    if world_size() == 1:
        return
    _reduce_flat([("mean" if mode == "mean" and b.is_floating_point() else "broadcast", b)
                  for b in model.buffers()])  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "SyncBuffersHook":  # a hook, so it lives with the hooks; reachable here too
        from ftrain.hooks.sync_buffers import SyncBuffersHook

        return SyncBuffersHook
    from ftrain._moved import moved  # (dist is a leaf: nothing of ftrain at import)

    raise moved("ftrain.dist", name, _MOVED)
