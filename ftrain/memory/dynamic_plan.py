"""The dynamic checkpoint planner (United-Perception ``memory_checkpoint``).

Warm-up: per candidate the bytes checkpointing it saves and its forward time, and the whole
forward's memory, keyed by ``size_fn`` of the call. Fit: degree-2 least-squares polynomials
against the size. Plan (cached per rounded size): candidates whose predicted savings cover
``predicted memory - budget`` (all, with a warning, if that is not enough). The state
(:class:`DynamicPlannerState`) is plain data in ``TrainState.transforms``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch

from ftrain._checks import flag
from ftrain.memory import cuda_peak
from ftrain.memory.accounting import ActivationAccountant, ActivationReport, _fmt
from ftrain.memory.apply import CheckpointSwitch
from ftrain.memory.plans import STRATEGIES, DynamicPlan

__all__ = [
    "DynamicPlannerState", "PlanSession", "plan_session", "fit_poly", "poly_eval",
    "choose_modules", "default_size_fn", "cuda_device_of", "complete_cuda_sample",
    "sample_backward_start"
]  # fmt: skip

MODEL = "__model__"


# ------------------------------------------------------------------ fitting
def fit_poly(xs: Sequence[float], ys: Sequence[float], degree: int = 2) -> list[float]:
    """Least-squares polynomial coefficients ``[c0, c1, c2, ...]`` of ``ys`` vs ``xs``.

    Example:
        >>> [round(c, 6) + 0.0 for c in fit_poly([1, 2, 3, 4], [3, 9, 19, 33])]  # 1 + 2x^2
        [1.0, 0.0, 2.0]
    """
    if len(xs) != len(ys) or not xs:
        raise ValueError("fit_poly needs as many ys as xs, at least one.")
    degree = max(0, min(degree, len(set(xs)) - 1))
    scale = max(abs(float(x)) for x in xs) or 1.0
    x = torch.tensor([float(v) / scale for v in xs], dtype=torch.float64)
    y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
    a = torch.stack([x**k for k in range(degree + 1)], dim=1)
    coef = torch.linalg.lstsq(a, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    return [float(c) / scale**k for k, c in enumerate(coef)] + [0.0] * (2 - degree)


def poly_eval(coef: Sequence[float], x: float) -> float:
    """``sum(c_k * x**k)``.

    Example:
        >>> poly_eval([1.0, 0.0, 2.0], 3.0)
        19.0
    """
    return float(sum(c * x**k for k, c in enumerate(coef)))


# ----------------------------------------------------------------- strategies
def _greedy(savings: Mapping[str, float], need: float) -> list[str]:
    pool = sorted(savings, key=lambda n: (-savings[n], n))
    chosen: list[str] = []
    left = need
    while left > 0 and pool:
        covering = [n for n in pool if savings[n] >= left]
        if covering:  # the smallest single module that covers what is left
            return [*chosen, min(covering, key=lambda n: (savings[n], n))]
        pick = pool.pop(0)  # else the largest
        chosen.append(pick)
        left -= savings[pick]
    return chosen


def _knapsack(
    savings: Mapping[str, float], times: Mapping[str, float], need: float, bins: int
) -> list[str] | None:
    """Least total time with savings >= need (0/1, savings floored to need/bins units)."""
    names = [n for n in savings if savings[n] > 0]
    unit = need / bins
    weights = [min(bins, int(savings[n] // unit)) for n in names]
    inf = math.inf
    dp = [0.0] + [inf] * bins
    parents: list[list[int]] = []
    for w, name in zip(weights, names):
        t = max(0.0, float(times[name]))
        par = [-1] * (bins + 1)
        if w > 0:
            for j in range(bins, -1, -1):
                if dp[j] == inf:
                    continue
                k = min(bins, j + w)
                cand = dp[j] + t
                if cand < dp[k]:
                    dp[k] = cand
                    par[k] = j
        parents.append(par)
    if dp[bins] == inf:
        return None
    # walk back: dp was updated in place, so a state's parent is the latest item
    # that improved it, taken from a state of a strictly earlier item layer.
    chosen = []
    k = bins
    i = len(names) - 1
    while k > 0 and i >= 0:
        j = parents[i][k]
        if j >= 0:
            chosen.append(names[i])
            k = j
        i -= 1
    return list(reversed(chosen))


def choose_modules(
    savings: Mapping[str, float],
    times: Mapping[str, float],
    need: float,
    strategy: str = "greedy",
    *,
    bins: int = 512,
) -> list[str]:
    """The modules to checkpoint so that their savings cover ``need`` bytes.

    Example:
        >>> s = {"a": 10.0, "b": 6.0, "c": 5.0}
        >>> t = {"a": 9.0, "b": 2.0, "c": 2.0}
        >>> choose_modules(s, t, 10.0, "greedy"), choose_modules(s, t, 10.0, "memory_time")
        (['a'], ['b', 'c'])
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if need <= 0:
        return []
    savings = {n: float(s) for n, s in savings.items() if s > 0}  # others never help
    if sum(savings.values()) < need:
        return sorted(savings)
    greedy = _greedy(savings, need)
    if strategy == "greedy":
        return greedy
    best = _knapsack(savings, times, need, max(1, int(bins)))
    if best is None or sum(times[n] for n in best) > sum(times[n] for n in greedy):
        return greedy
    return best


# ---------------------------------------------------------------------- state
class DynamicPlannerState:
    """The dynamic planner's state: plain data, ``state_dict``-able.

    Attributes:
        samples: warm-up measurements, each ``{"size", "memory", "modules": {name:
            [saving_bytes, forward_seconds]}, "fragmentation"}`` (CUDA: the sample's peak
            reserved over peak allocated bytes when the allocator grew, else ``None``).
        fits: after warm-up, ``{name: {"saving": coef, "time": coef}}`` plus ``"__model__":
            {"memory": coef}``.
        cache: rounded size -> list of module names to checkpoint.
        baseline: CUDA: the bytes allocated when a forward starts (weights, gradients,
            optimizer state), the largest seen; ``0`` when measuring saved activations.
        fragmentation: CUDA: reserved over allocated bytes, the largest of the warm-up
            samples' (at least 1): plans keep ``fragmentation * (baseline + activations)``
            under the budget, since the caching allocator runs out of memory on reserved
            bytes, not allocated ones.

    Example:
        >>> s = DynamicPlannerState(["a"])
        >>> s2 = DynamicPlannerState()
        >>> s2.load_state_dict(s.state_dict())
        >>> s2.candidates
        ['a']
    """

    def __init__(self, candidates: Sequence[str] = ()) -> None:
        self.candidates: list[str] = list(candidates)
        self.samples: list[dict[str, Any]] = []
        self.fits: dict[str, dict[str, list[float]]] = {}
        self.cache: dict[float, list[str]] = {}
        self.baseline: float = 0.0
        self.fragmentation: float = 1.0
        self.pending: dict[str, Any] | None = None

    @property
    def fitted(self) -> bool:
        return bool(self.fits)

    def copy(self) -> DynamicPlannerState:
        """A copy sharing nothing mutable."""
        return deepcopy(self)

    def state_dict(self) -> dict[str, Any]:
        # candidates, samples, fits, cache, baseline, fragmentation, pending
        return deepcopy(vars(self))

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.candidates = list(saved.get("candidates", self.candidates))
        self.samples = [dict(s) for s in saved.get("samples", [])]
        self.fits = {k: dict(v) for k, v in saved.get("fits", {}).items()}
        self.cache = {k: list(v) for k, v in saved.get("cache", {}).items()}
        self.baseline = float(saved.get("baseline", 0.0))
        self.fragmentation = float(saved.get("fragmentation", 1.0))
        p = saved.get("pending")
        self.pending = None if p is None else dict(p)

    def __repr__(self) -> str:
        phase = f"{len(self.cache)} cached plans" if self.fitted else "warming up"
        return (
            f"DynamicPlannerState({len(self.candidates)} candidates, {len(self.samples)} samples, "
            f"{phase})"
        )

    # ------------------------------------------------------------- samples
    def add_sample(
        self,
        size: float,
        memory: float,
        modules: Mapping[str, tuple[float, float]],
        fragmentation: float | None = None,
    ) -> None:
        """Record one measurement (``modules``: name -> (saving bytes, seconds);
        ``fragmentation``: CUDA's reserved over allocated bytes at the sample's peak)."""
        self.samples.append(
            {
                "size": float(size),
                "memory": float(memory),
                "modules": {k: [float(v[0]), float(v[1])] for k, v in modules.items()},
                "fragmentation": None if fragmentation is None else float(fragmentation),
            }
        )

    def fit(self) -> None:
        """Fit memory/time polynomials to the samples (clears the plan cache)."""
        if not self.samples:
            raise RuntimeError("The dynamic planner has no warm-up samples to fit.")
        xs = [s["size"] for s in self.samples]
        fits: dict[str, dict[str, list[float]]] = {}
        mem = [s["memory"] for s in self.samples]
        fits[MODEL] = {"memory": fit_poly(xs, mem)}
        _check_fit("the model's activation memory", xs, mem, fits[MODEL]["memory"])
        # the first sample's times include one-off costs (lazy init): drop it if we can
        timed = self.samples[1:] if len(self.samples) >= 3 else self.samples
        tx = [s["size"] for s in timed]
        for name in self.candidates:
            sav = [s["modules"].get(name, [0.0, 0.0])[0] for s in self.samples]
            tt = [s["modules"].get(name, [0.0, 0.0])[1] for s in timed]
            fits[name] = {"saving": fit_poly(xs, sav), "time": fit_poly(tx, tt)}
        self.fits = fits
        readings = [s.get("fragmentation") for s in self.samples]
        self.fragmentation = max([1.0, *(float(r) for r in readings if r is not None)])
        self.cache = {}

    # ---------------------------------------------------------------- plans
    def predict(self, size: float) -> tuple[float, dict[str, float], dict[str, float]]:
        """``(memory, savings, times)`` predicted at ``size``."""
        memory = max(0.0, poly_eval(self.fits[MODEL]["memory"], size))
        savings = {n: poly_eval(self.fits[n]["saving"], size) for n in self.candidates}
        times = {n: max(1e-9, poly_eval(self.fits[n]["time"], size)) for n in self.candidates}
        return memory, savings, times

    def activation_budget(self, plan: DynamicPlan) -> float:
        """Bytes left for activations: ``max_memory * (1 - margin) / fragmentation - baseline``.

        Example:
            >>> from ftrain.memory import dynamic
            >>> s = DynamicPlannerState()
            >>> s.baseline, s.fragmentation = 100.0, 1.25
            >>> s.activation_budget(dynamic(1000, margin=0.2))
            540.0
        """
        return plan.max_memory * (1.0 - plan.margin) / self.fragmentation - self.baseline

    def plan_for(self, size: float, plan: DynamicPlan) -> list[str]:
        """The modules to checkpoint at ``size`` (cached per rounded size)."""
        key = _round_up(size, plan.round_to)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        memory, savings, times = self.predict(key)
        limit = self.activation_budget(plan)
        need = memory - limit
        useful = sum(v for v in savings.values() if v > 0)
        if need > 0 and useful < need:
            warnings.warn(
                f"dynamic checkpoint: at input size {key:g} the predicted activation memory is "
                f"{_fmt(memory)}; checkpointing all {len(savings)} candidate modules frees at "
                f"most {_fmt(useful)}, leaving {_fmt(memory - useful)} > the budget "
                f"{_fmt(limit)}{self._budget_terms(plan)}. Checkpointing every candidate; add "
                "candidates, lower the input size or raise max_memory.",
                RuntimeWarning,
                stacklevel=2,
            )
        chosen = choose_modules(savings, times, need, plan.strategy, bins=plan.bins)
        order = {n: i for i, n in enumerate(self.candidates)}
        chosen = sorted(chosen, key=order.__getitem__)
        self.cache[key] = chosen
        return chosen

    def _budget_terms(self, plan: DynamicPlan) -> str:
        if not self.baseline and self.fragmentation == 1.0:
            return ""
        return (
            f" (max_memory {_fmt(plan.max_memory)} x (1 - margin {plan.margin:g}) / CUDA "
            f"fragmentation {self.fragmentation:.3g} - {_fmt(self.baseline)} of weights, "
            "gradients and optimizer state)"
        )


def _round_up(size: float, step: float) -> float:
    key = math.ceil(float(size) / step - 1e-9) * step
    return float(int(key)) if float(key).is_integer() else float(key)


def _check_fit(what: str, xs: list[float], ys: list[float], coef: list[float]) -> None:
    errors = [(abs(poly_eval(coef, x) - y), y) for x, y in zip(xs, ys)]
    worst, where = max(errors, key=lambda e: e[0], default=(0.0, 0.0))
    if worst > 2**20 and worst > 0.1 * abs(where):
        warnings.warn(
            f"dynamic checkpoint: a degree-2 fit of {what} against the input size is poor "
            f"(error {_fmt(worst)} on {_fmt(where)}): memory may not be a "
            "function of size_fn's value; plans may miss the budget. Give a better size_fn "
            "or a margin.",
            RuntimeWarning,
            stacklevel=3,
        )


# ------------------------------------------------------------------- session
def default_size_fn(*args: Any, **kwargs: Any) -> float:
    """``numel`` of the first tensor among the model call's arguments.

    Example:
        >>> import torch
        >>> default_size_fn(torch.zeros(2, 3, 4), mask=None)
        24.0
    """
    for a in (*args, *kwargs.values()):
        inner = a.values() if isinstance(a, Mapping) else a if isinstance(a, (list, tuple)) else [a]
        for b in inner:
            if isinstance(b, torch.Tensor):
                return float(b.numel())
    raise TypeError(
        "dynamic checkpoint: cannot find a tensor among the model's arguments to size the "
        "input; pass dynamic(..., size_fn=lambda *args, **kwargs: ...)."
    )


class PlanSession:
    """One forward pass under a dynamic plan; see :func:`plan_session`.

    On CUDA (``measure="cuda"``) a warm-up sample resets CUDA's peak counters when its
    forward starts (ftrain keeps the maximum so far: :mod:`ftrain.memory.cuda_peak`), so
    its peak is its own even after a higher one (an evaluation, a bigger batch); the
    sample completes after the backward (:meth:`after_backward`).

    Attributes:
        state: the planner state after this forward (a copy of the input).
        size: the input size of this forward (the first model call's).
        checkpointed: the modules checkpointed in this forward.
        report: the accountant's report (warm-up, or ``monitor=True``).
    """

    def __init__(
        self,
        plan: DynamicPlan,
        model: torch.nn.Module,
        state: DynamicPlannerState,
        *,
        monitor: bool = False,
    ) -> None:
        flag("PlanSession: monitor", monitor)
        self.plan = plan
        self.model = model
        self.state = state.copy()
        self.monitor = monitor
        self.size: float | None = None
        self.checkpointed: list[str] = []
        self.report: ActivationReport | None = None
        self._cuda = plan.measure == "cuda" or (
            plan.measure == "auto" and any(p.is_cuda for p in model.parameters())
        )
        self._stack: contextlib.ExitStack | None = None
        self._acc: ActivationAccountant | None = None
        self._switch: CheckpointSwitch | None = None
        self._warming = False
        self._start: tuple[float, float] = (0.0, 0.0)  # CUDA: allocated, reserved
        self._device = cuda_device_of(model) if self._cuda else None

    def after_backward(self) -> None:
        """Complete a CUDA warm-up sample once the backward ran (the step calls this)."""
        if self._cuda:
            complete_cuda_sample(self.state, self._device)

    def __enter__(self) -> PlanSession:
        st = self.state
        if self._cuda:
            _track_baseline(st, self._device)
        if not st.fitted and len(st.samples) >= self.plan.warmup_iters:
            st.fit()
        self._warming = not st.fitted
        stack = contextlib.ExitStack()
        try:
            self._enter_hooks(stack)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def _enter_hooks(self, stack: contextlib.ExitStack) -> None:
        cands = self.state.candidates
        active = cands if (self._warming and self.plan.warmup_checkpoint) else ()
        self._switch = stack.enter_context(CheckpointSwitch(self.model, cands, active=active))
        if self._warming:
            self.checkpointed = list(active)
        for mod in [self.model, *(self.model.get_submodule(n) for n in cands)]:
            h = mod.register_forward_pre_hook(self._on_call, with_kwargs=True)
            stack.callback(h.remove)
        if not (self._warming or self.monitor):
            return
        if self._cuda and self._warming:
            dev = self._device
            self._start = (
                float(torch.cuda.memory_allocated(dev)),
                float(torch.cuda.memory_reserved(dev)),
            )
            cuda_peak.reset_peak_memory_stats(dev)  # this sample's peak, the maximum kept
        self._acc = stack.enter_context(
            ActivationAccountant(
                self.model, modules=cands, tap_checkpoints=self._warming, time=self._warming
            )
        )

    def _on_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.size is not None:
            return None
        fn = self.plan.size_fn or default_size_fn
        self.size = float(fn(*args, **kwargs))
        if not self._warming:
            names = self.state.plan_for(self.size, self.plan)
            self.checkpointed = list(names)
            assert self._switch is not None
            self._switch.active = set(names)
        return None

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None
        if exc[0] is not None or self._acc is None:
            return
        report = self._acc.report()
        self.report = report
        if not self._warming:
            return
        if self.size is None:
            raise RuntimeError(
                "dynamic checkpoint: the model was not called inside the forward, so the input "
                "size is unknown."
            )
        modules: dict[str, tuple[float, float]] = {}
        for name in self.state.candidates:
            s = report.modules.get(name)
            # the saving is negative when checkpointing it keeps more than it frees
            modules[name] = (0.0, 0.0) if s is None else (s.checkpoint_saving, s.forward_time)
        add_back = float(report.eager_bytes - report.total_bytes)  # what checkpoints freed
        if self._cuda:
            self.state.pending = {
                "size": self.size,
                "base": self._start[0],
                "reserved_before": self._start[1],
                "saved": add_back,
                "modules": modules,
                "sampled": float(torch.cuda.memory_allocated(self._device)),
            }
        else:
            self.state.add_sample(self.size, report.eager_bytes, modules)
            if len(self.state.samples) >= self.plan.warmup_iters:
                self.state.fit()


def _track_baseline(state: DynamicPlannerState, device: torch.device | None) -> None:
    """Complete a pending sample; raise the baseline to what is allocated now."""
    if state.pending is not None:  # used by hand without after_backward(): complete now
        complete_cuda_sample(state, device)
    # the baseline (weights, gradients, optimizer state) is re-measured at every
    # forward: it grows after the first optimizer update creates Adam's moments
    level = float(torch.cuda.memory_allocated(device))
    if level > state.baseline:
        state.baseline = level
        state.cache = {}  # plans were chosen for a smaller baseline


def cuda_device_of(model: torch.nn.Module) -> torch.device:
    """The CUDA device the model computes on (FSDP2: its mesh's; else its parameters')."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type == "cuda":
            return local.device
        if mesh is not None and getattr(mesh, "device_type", None) == "cuda":
            break  # CPU offload: compute on this process's current GPU
    return torch.device("cuda", torch.cuda.current_device())


def complete_cuda_sample(state: DynamicPlannerState, device: torch.device | None) -> None:
    """Turn the pending CUDA warm-up sample into a sample.

    Its memory: CUDA's peak allocated bytes since the sample's forward began (the counter
    was reset then) above what was allocated then, plus what its checkpoints freed. Its
    fragmentation: peak reserved over peak allocated bytes, when the allocator had to grow
    during the sample (else the sample ran in memory already cached: no reading).
    """
    pending = state.pending
    if pending is None:
        return
    peak = max(
        float(torch.cuda.max_memory_allocated(device)),
        float(pending.get("sampled", 0.0)),
        float(torch.cuda.memory_allocated(device)),
    )
    reserved = float(torch.cuda.max_memory_reserved(device))
    grew = reserved > float(pending.get("reserved_before", math.inf))
    frag = reserved / peak if grew and peak > 0 else None
    memory = peak - pending["base"] + pending["saved"]
    state.add_sample(pending["size"], memory, pending["modules"], fragmentation=frag)
    state.pending = None


def sample_backward_start(
    state: DynamicPlannerState, loss: torch.Tensor, device: torch.device | None = None
) -> None:
    """Sample the CUDA allocator level on ``device`` when the backward of ``loss`` starts."""
    pending = state.pending
    if pending is None or "sampled" not in pending or not loss.requires_grad:
        return

    def hook(grad: torch.Tensor) -> None:
        level = float(torch.cuda.memory_allocated(device))
        pending["sampled"] = max(pending["sampled"], level)

    loss.register_hook(hook)


@contextlib.contextmanager
def plan_session(
    plan: DynamicPlan,
    model: torch.nn.Module,
    state: DynamicPlannerState | None = None,
    *,
    monitor: bool = False,
) -> Iterator[PlanSession]:
    """Run one forward under ``plan``; ``session.state`` is the updated state.

    Example:
        >>> import torch
        >>> from ftrain.memory import dynamic, modules
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> plan = dynamic(10_000, warmup_iters=1, candidates=modules(["0", "1"]))
        >>> state = DynamicPlannerState(plan.resolve(model))
        >>> with plan_session(plan, model, state) as s:
        ...     loss = model(torch.randn(8, 4)).sum()
        >>> loss.backward()
        >>> state = s.state
        >>> state.fitted
        True
    """
    flag("plan_session: monitor", monitor)
    if state is None:
        state = DynamicPlannerState(plan.resolve(model))
    with PlanSession(plan, model, state, monitor=monitor) as session:
        yield session
