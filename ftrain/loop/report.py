"""What a run says, one line each: where it starts, and where an interruption left it.

The start line goes on :class:`~ftrain.events.RunBegin` (``message``): the logger's console
prints it; a run without a console prints only a resume's line, to stderr, on rank 0. The
stop line is the message of the interruption (:class:`~ftrain.loop.signals.Interrupted`,
:class:`~ftrain.loop.signals.TerminatedError`), set once every hook's ``finally`` has run
(so it knows whether ``interrupted.pth`` was saved), and printed to stderr on rank 0 in a
script (at a prompt, IPython or the REPL shows the exception's line).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from ftrain import dist as _dist
from ftrain.loop.signals import TerminatedError
from ftrain.persist.manifest import Manifest
from ftrain.persist.rundir import RunDir

__all__ = ["start_line", "stop_line", "say", "saved_now", "newest_resumable"]


def start_line(
    resumed_from: Path | None, step: int, epoch: int, *, continued: bool, looked_in: Path | None
) -> str:
    """The run's first line.

    Example:
        >>> start_line(Path("runs/a/iter_400.pth"), 400, 3, continued=False, looked_in=None)
        'resumed from iter_400.pth (update 400, epoch 3)'
        >>> start_line(None, 0, 0, continued=False, looked_in=Path("runs/a"))
        'starting fresh (no checkpoint in runs/a)'
        >>> start_line(None, 7, 0, continued=True, looked_in=None)
        'continuing at update 7 (epoch 0)'
    """
    if continued:
        return f"continuing at update {step} (epoch {epoch})"
    if resumed_from is not None:
        return f"resumed from {resumed_from.name} (update {step}, epoch {epoch})"
    return "starting fresh" + ("" if looked_in is None else f" (no checkpoint in {looked_in})")


def say(line: str) -> None:
    """Print ``line`` to stderr on rank 0 (the other ranks say nothing)."""
    if _dist.rank() == 0:
        print(line, file=sys.stderr, flush=True)


def _manifests(dirs: Sequence[Path]) -> list[Manifest]:
    return [Manifest(d, main=False) for d in map(RunDir, dirs) if d.is_dir()]


def saved_now(dirs: Sequence[Path], run_id: str, step: int, micro_step: int) -> str | None:
    """The interrupted checkpoint this run saved at this position (its name), if any."""
    for manifest in _manifests(dirs):
        for entry in manifest.resumable():
            same = (entry.get("run"), entry.get("step"), entry.get("micro_step"))
            if entry.get("kind") == "interrupted" and same == (run_id, step, micro_step):
                return str(entry["name"])
    return None


def newest_resumable(dirs: Sequence[Path]) -> tuple[str, int] | None:
    """The newest resumable checkpoint in ``dirs``: its name and update."""
    found = [e for m in _manifests(dirs) for e in m.resumable()[:1]]
    best = max(found, key=lambda e: (e.get("step", -1), e.get("seq", -1)), default=None)
    return None if best is None else (str(best["name"]), int(best.get("step", 0)))


def stop_line(
    signum: int,
    step: int,
    *,
    saved: str | None,
    newest: tuple[str, int] | None,
    auto: bool,
    prompt: bool,
) -> str:
    """The line an interruption says: where it stopped, what was saved, how to go on.

    Example:
        >>> stop_line(signal.SIGINT, 7, saved="interrupted.pth", newest=None, auto=True, prompt=False)
        'interrupted at update 7, saved interrupted.pth; run the same call again to continue'
        >>> stop_line(signal.SIGTERM, 7, saved=None, newest=("iter_4.pth", 4), auto=False,
        ...           prompt=False)
        "interrupted at update 7 (SIGTERM), nothing saved at it; run again with resume='auto' to continue from iter_4.pth (update 4)"
    """
    name = signal.Signals(signum).name
    head = f"interrupted at update {step}" + ("" if signum == signal.SIGINT else f" ({name})")
    again = "run the same call again" if auto or prompt else "run again with resume='auto'"
    if saved is not None:
        return f"{head}, saved {saved}; {again} to continue"
    if prompt:  # the loop continues from memory in this process
        disk = f" (on disk: {newest[0]}, update {newest[1]})" if newest else ""
        return f"{head}, nothing saved at it{disk}; run the same call again to continue"
    if newest is not None:
        return f"{head}, nothing saved at it; {again} to continue from {newest[0]} (update {newest[1]})"
    return (
        f"{head}; nothing was saved (the run has no work_dir or no checkpoint hook), so "
        "running it again starts from the beginning"
    )


def signal_of(exc: BaseException) -> int:
    """The signal an interruption stands for (``TerminatedError.signum``, else SIGINT).

    Example:
        >>> signal_of(TerminatedError(signal.SIGUSR1)) == signal.SIGUSR1
        True
    """
    return int(exc.signum) if isinstance(exc, TerminatedError) else int(signal.SIGINT)
