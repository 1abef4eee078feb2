"""``python -m ftrain.bench overhead``: ftrain's per-step overhead vs a plain PyTorch loop,
measured by the repository's ``benchmarks/overhead.py`` (loaded from the source checkout)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from types import ModuleType
from typing import Any

from ftrain.bench.env import BenchError
from ftrain.bench.report import fmt_stats, format_table, progress_bar
from ftrain.bench.verdict import fmt_ratio

__all__ = [
    "find_overhead_script", "load_overhead_module", "run_overhead", "overhead_table",
    "plot_overhead"
]  # fmt: skip

_NEEDED = ("workloads", "all_variants", "run_benchmark", "import_time", "check_targets")


def find_overhead_script() -> Path:
    """``benchmarks/overhead.py`` of the source checkout ``ftrain`` was imported from."""
    import ftrain

    root = Path(ftrain.__file__).resolve().parent.parent
    script = root / "benchmarks" / "overhead.py"
    if not script.is_file():
        raise BenchError(
            f"overhead: the measurement is the repository's benchmarks/overhead.py, and there "
            f"is none next to this ftrain ({root}): ftrain seems to be installed from a wheel. "
            "Run it from a source checkout (git clone ...; pip install -e .)."
        )
    return script


def load_overhead_module(script: Path) -> ModuleType:
    """Import ``script`` as a module (``ftrain_bench_overhead_script``) and check its API."""
    name = "ftrain_bench_overhead_script"
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise BenchError(f"overhead: cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(name, None)
        raise
    missing = [n for n in _NEEDED if not hasattr(module, n)]
    if missing:
        raise BenchError(
            f"overhead: {script} lacks {', '.join(missing)}; the script and ftrain.bench "
            "disagree (update one of them)."
        )
    return module


def run_overhead(
    workloads: Sequence[str] | None,
    *,
    repeats: int,
    import_repeats: int = 0,
    progress: Any = None,
    module: ModuleType | None = None,
    chunk_steps: int | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """Run the script's benchmark on ``workloads`` (default: all of the script's); ``quick``:
    the targets defined on full runs are reported as not judged.

    Example:
        >>> out = run_overhead(["tiny"], repeats=3)  # doctest: +SKIP
        >>> [r["variant"] for r in out["results"]][:2]  # doctest: +SKIP
        ['plain', 'make_step']
    """
    mod = module if module is not None else load_overhead_module(find_overhead_script())
    wls = mod.workloads()
    if chunk_steps is not None:
        import dataclasses

        wls = {n: dataclasses.replace(w, chunk_steps=chunk_steps) for n, w in wls.items()}
    names = list(wls) if not workloads else list(workloads)
    unknown = [n for n in names if n not in wls]
    if unknown:
        raise BenchError(
            f"overhead: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(wls)}"
        )
    variants = mod.all_variants()
    results = []
    progress = progress if progress is not None else progress_bar(0, "overhead", enabled=False)
    progress.total = (progress.total or 0) + len(names) + (1 if import_repeats else 0)
    for name in names:
        progress.set_description(f"overhead {name}")
        results += mod.run_benchmark(wls[name], variants, repeats=repeats, echo=lambda _: None)
        progress.update(1)
    imports = None
    if import_repeats:
        progress.set_description("overhead: import time")
        imports = mod.import_time(import_repeats)
        progress.update(1)
    return {
        "results": [r.as_dict() for r in results],
        "import_s": imports,
        "targets": list(mod.check_targets(results, imports, quick=quick)),
        "descriptions": {n: getattr(wls[n], "description", n) for n in names},
        "script": str(getattr(mod, "__file__", "")),
    }


def overhead_table(rows: Sequence[dict[str, Any]]) -> str:
    """The console table of :func:`run_overhead`'s results, a block per workload.

    Example:
        >>> row = {"workload": "tiny", "variant": "make_step", "reference": "plain",
        ...        "median_us": 60.0, "p25_us": 58.0, "p75_us": 61.0, "ratio": 1.1,
        ...        "added_us": 5.5, "added_interval": {"lo": 4.0, "hi": 7.25, "confidence": 0.94}}
        >>> print(overhead_table([row]))
        workload  variant    us/step    p25-p75  vs     time vs ref  added us      interval
        --------  ---------  -------  ---------  -----  -----------  --------  ------------
        tiny      make_step     60.0  58.0-61.0  plain        1.10x      +5.5  +4.0 to +7.2
    """
    headers = ["workload", "variant", "us/step", "p25-p75", "vs", "time vs ref", "added us",
               "interval"]  # fmt: skip

    def cells(r: dict[str, Any]) -> list[str]:
        med, spread = fmt_stats(r["median_us"], r["p25_us"], r["p75_us"])
        ref, iv = r.get("reference"), r.get("added_interval")
        interval = "" if not iv else f"{iv['lo']:+.1f} to {iv['hi']:+.1f}"
        return [r["workload"], r["variant"], med, spread, ref or "",
                "" if ref is None else fmt_ratio(r["ratio"]),
                "" if ref is None else f"{r['added_us']:+.1f}", interval]  # fmt: skip

    groups = [[cells(r) for r in g] for _, g in groupby(rows, lambda r: r["workload"])]
    return format_table(headers, groups, left=(0, 1, 4))


def plot_overhead(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Microseconds per step per variant (median with p25-p75 bars), a panel per workload.

    Example:
        >>> plot_overhead(rows, "overhead.png")  # doctest: +SKIP
    """
    from ftrain.bench.report import plot_bars

    keys = ("workload", "variant", "median_us", "p25_us", "p75_us")
    plot_bars(rows, keys, path, ylabel="µs per step", title=title)
