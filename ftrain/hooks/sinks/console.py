"""The console sink: a progress bar (Jupyter, a terminal) or one line per log (pipes, CI)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ftrain._checks import flag
from ftrain.hooks.sinks.base import Scalars, SinkBase, Start
from ftrain.hooks.timer import format_seconds

if TYPE_CHECKING:
    from ftrain.run import Run

__all__ = ["ConsoleSink", "format_line"]

_OFF = ("", "0", "false", "no", "off")  # TQDM_DISABLE values that leave the bar on


def _format_value(key: str, value: float) -> str:
    if key in ("eta", "elapsed"):
        return format_seconds(value)
    if key.endswith("_mib") and value == value:
        return f"{value:.0f}MiB"
    if (key.endswith("_per_s") or key.endswith("/s")) and value == value and abs(value) >= 100:
        return f"{value:.0f}"
    if key in ("step", "epoch") and float(value).is_integer():
        return str(int(value))
    if value != value or value in (math.inf, -math.inf):
        return str(value)
    if value == 0:
        return "0"
    mag = abs(value)
    if key.startswith("lr") or mag < 1e-3 or mag >= 1e5:
        return f"{value:.3e}"
    return f"{value:.4f}" if mag < 100 else f"{value:.2f}"


def format_line(step: int, scalars: Scalars, total: int | None = None) -> str:
    """One human-readable log line.

    Example:
        >>> format_line(20, {"epoch": 0, "loss": 0.12345, "lr": 0.1, "eta": 75.0}, total=100)
        'step 20/100  epoch 0  loss 0.1235  lr 1.000e-01  eta 0:01:15'
    """
    head = f"step {step}" + (f"/{total}" if total else "")
    parts = [f"{k} {_format_value(k, v)}" for k, v in scalars.items()]
    return "  ".join([head, *parts])


def _bar_can_show() -> bool:
    """A bar redraws in place: only in Jupyter or on a terminal, never into a pipe or CI log."""
    ip = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if type(ip).__name__ == "ZMQInteractiveShell":  # a Jupyter kernel
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class ConsoleSink(SinkBase):
    """Console output: a progress bar (``tqdm.auto``: a widget in Jupyter) or lines.

    The bar advances at log time only (updates out of ``max_steps``, else batches
    out of ``epochs x len(data)``). With ``progress=False`` or ``TQDM_DISABLE``
    set, each log is one printed line. When a run starts it prints the run's line
    ("starting fresh", "resumed from iter_400.pth (update 400, epoch 3)"); a resumed
    run shows nothing at or before the update it resumed from (an evaluation due at
    the checkpoint is done again, not shown again).

    Example:
        >>> sink = ConsoleSink(progress=False)
        >>> sink.start(Start(message="starting fresh"))
        starting fresh
        >>> sink.write(10, {"loss": 0.5})
        step 10  loss 0.5000
        >>> sink.close()
    """

    #: Tags a line leaves out unless ``keys`` names them (the file sinks have them all).
    HIDDEN: tuple[str, ...] = ("data_time", "iter_time", "compute_time", "elapsed", "memory/")

    #: Shorter labels for a console line.
    LABELS: dict[str, str] = {
        "perf/samples_per_s": "samples/s",
        "perf/tokens_per_s": "tokens/s",
        "perf/tflops": "TFLOP/s",
        "perf/mfu": "mfu",
        "perf/ckpt_blocked_s": "ckpt blocked s",
        "perf/ckpt_waited_s": "ckpt waited s",
    }

    def __init__(
        self,
        loop: Run | None = None,
        *,
        progress: bool = True,
        desc: str | None = None,
        bar_format: str | None = None,
        postfix: Sequence[str] = ("loss", "lr"),
        keys: Sequence[str] | None = None,
        epoch_end: bool = False,
        bar_kwargs: dict[str, Any] | None = None,
    ) -> None:
        flag("ConsoleSink: progress", progress)
        flag("ConsoleSink: epoch_end", epoch_end)
        self.loop = loop
        self.total, self.unit = self._extent(loop)
        self.bar: Any = None
        self.postfix = tuple(postfix)
        self.keys = None if keys is None else tuple(keys)
        self.epoch_end = epoch_end
        self._after = -1  # a resumed run shows rows after the update it resumed from
        env_off = os.environ.get("TQDM_DISABLE", "").strip().lower() not in _OFF
        if progress and not env_off and _bar_can_show():
            from tqdm.auto import tqdm  # lazily: only runs that show a bar pay for it

            self.bar = tqdm(
                total=self.total,
                initial=self._position(),
                unit=self.unit,
                desc=desc or "train",
                dynamic_ncols=True,
                disable=False,  # the environment was checked above, when the run started
                **({} if bar_format is None else {"bar_format": bar_format}),
                **(bar_kwargs or {}),
            )

    def _shown(self, scalars: Scalars) -> Scalars:
        """The tags a console line shows (``keys``, or all but :attr:`HIDDEN`), labelled."""
        if self.keys is not None:
            kept = {k: v for k, v in scalars.items() if k in self.keys or k == "epoch"}
        else:
            kept = {k: v for k, v in scalars.items() if not k.startswith(self.HIDDEN)}
        return {self.LABELS.get(k, k): v for k, v in kept.items()}

    @staticmethod
    def _extent(loop: Run | None) -> tuple[int | None, str]:
        if loop is None or loop.max_steps is not None:
            return (None if loop is None else loop.max_steps), "step"
        per_epoch = loop.batches_per_epoch
        return (loop.epochs * per_epoch if loop.epochs and per_epoch else None), "batch"

    def _position(self) -> int:
        loop = self.loop
        if loop is None:
            return 0
        state = loop.state
        if self.unit == "step":
            return state.step
        return state.epoch * (loop.batches_per_epoch or 0) + loop.batch_in_epoch

    def say(self, line: str) -> None:
        """Print ``line`` (above the bar, when there is one)."""
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def start(self, at: Start) -> None:
        """Print the run's line; a resumed run shows nothing up to where it resumed."""
        if at.message:
            self.say(at.message)
        self._after = -1 if at.fresh else at.step

    def write(self, step: int, scalars: Scalars) -> None:
        if step <= self._after:
            return
        if self.bar is None:
            total = self.total if self.unit == "step" else None
            print(format_line(step, self._shown(scalars), total), flush=True)
            return
        postfix = [f"{k} {_format_value(k, scalars[k])}" for k in self.postfix if k in scalars]
        if postfix:
            self.bar.set_postfix_str("  ".join(postfix), refresh=False)
        if not self._advance():
            self.bar.refresh()

    def _advance(self) -> bool:
        """Move the bar to the run's position; whether it moved."""
        step = self._position() - self.bar.n
        if step > 0:
            self.bar.update(step)
        return step > 0

    def write_eval(self, step: int, scalars: Scalars, *, best: Sequence[str] = ()) -> None:
        """An evaluation's line; ``best``: tags that are a new best (marked ``*best``)."""
        if step <= self._after:  # done again after a resume: the first run showed it
            return
        line = format_line(step, scalars)
        if best:
            line += "  *best" if len(best) == 1 else f"  *best ({', '.join(best)})"
        self.say(line)

    def close(self, status: str = "FINISHED") -> None:
        if self.bar is not None:
            self._advance()
            self.bar.close()
            self.bar = None
