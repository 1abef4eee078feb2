"""Output: console tables, number formatting, the progress bar and the JSON file.

Example:
    >>> print(format_table(["variant", "ms"], [[["fp32", "1.0"], ["bf16", "12.5"]]]))
    variant    ms
    -------  ----
    fp32      1.0
    bf16     12.5
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "format_table", "fmt_mib", "fmt_stats", "plot_bars", "progress_bar", "is_terminal",
    "write_json"
]  # fmt: skip


def format_table(
    headers: Sequence[str],
    groups: Sequence[Sequence[Sequence[str]]],
    left: int | Collection[int] = 1,
) -> str:
    """Align ``groups`` of rows under ``headers``, a blank line between groups.

    Example:
        >>> print(format_table(["a", "b"], [[["x", "1"]], [["y", "22"]]]))
        a   b
        -  --
        x   1
        <BLANKLINE>
        y  22
    """
    rows = [r for g in groups for r in g]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    lefts = set(range(left)) if isinstance(left, int) else set(left)

    def line(cells: Sequence[str]) -> str:
        out = [
            c.ljust(w) if i in lefts else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    lines = [line(headers), line(["-" * w for w in widths])]
    for i, group in enumerate(groups):
        if i:
            lines.append("")
        lines += [line(r) for r in group]
    return "\n".join(lines)


def fmt_mib(n: float | None, digits: int = 2) -> str:
    """Bytes as MiB (``"-"`` for ``None``).

    Example:
        >>> fmt_mib(3 * 2**20), fmt_mib(None)
        ('3.00', '-')
    """
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return f"{n / 2**20:.{digits}f}"


def fmt_stats(median: float, p25: float, p75: float, digits: int = 1) -> tuple[str, str]:
    """``(median, "p25-p75")`` as text.

    Example:
        >>> fmt_stats(10.04, 9.5, 11.25)
        ('10.0', '9.5-11.2')
    """
    if math.isnan(median):
        return "-", "-"
    return f"{median:.{digits}f}", f"{p25:.{digits}f}-{p75:.{digits}f}"


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a bar can redraw there; a file or a pipe gets none).

    Example:
        >>> import io
        >>> is_terminal(io.StringIO())
        False
    """
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed stream
        return False


def progress_bar(total: int, desc: str, *, enabled: bool = True, stream: Any = None) -> Any:
    """A tqdm bar on ``stream`` (default: stderr), shown only when ``stream`` is a terminal
    (``enabled=False`` or ``TQDM_DISABLE=1`` hide it there too); elsewhere a silent stand-in.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = progress_bar(2, "demo", stream=out)
        >>> bar.update(2); bar.close()
        >>> out.getvalue()
        ''
    """
    from tqdm.auto import tqdm

    stream = sys.stderr if stream is None else stream
    kwargs: dict[str, Any] = {"total": total, "desc": desc, "unit": "step", "leave": False,
                              "file": stream}  # fmt: skip
    if not enabled or not is_terminal(stream):
        kwargs["disable"] = True  # else TQDM_DISABLE in the environment decides
    return tqdm(**kwargs)


def write_json(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON (orjson; NaN becomes ``null``); returns the path.

    Example:
        >>> import tempfile, orjson
        >>> p = write_json(tempfile.mktemp(suffix=".json"), {"ms": float("nan"), "n": 1})
        >>> orjson.loads(p.read_bytes())
        {'ms': None, 'n': 1}
    """
    import orjson

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(
        orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    )
    return p


def plot_bars(
    rows: Sequence[Mapping[str, Any]],
    keys: tuple[str, str, str, str, str],
    path: str | Path,
    *,
    ylabel: str,
    title: str = "",
) -> None:
    """One bar chart per panel; ``keys``: the rows' panel, label, median, p25 and p75 keys.

    Example:
        >>> rows = [{"model": "mlp", "precision": "fp32", "ms": 2.0, "lo": 1.9, "hi": 2.1}]
        >>> plot_bars(rows, ("model", "precision", "ms", "lo", "hi"), "amp.png", ylabel="ms")  # doctest: +SKIP
    """
    plt = pyplot()
    panels: dict[str, list[tuple[Any, ...]]] = {}
    for r in rows:
        panels.setdefault(r[keys[0]], []).append(tuple(r[k] for k in keys[1:]))
    names = list(panels)
    fig, axes = plt.subplots(1, len(names), figsize=(5.0 * len(names), 4.0), squeeze=False)
    for ax, name in zip(axes[0], names):
        bars = panels[name]
        xs = range(len(bars))
        meds = [b[1] for b in bars]
        err = [[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]]
        ax.bar(xs, meds, yerr=err, capsize=3, color="tab:orange")
        ax.set_xticks(list(xs), [b[0] for b in bars], rotation=30, ha="right")
        ax.set_title(name)
        ax.set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or an error naming the extra."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'ftrain[bench]')"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
