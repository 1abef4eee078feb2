"""Interrupts held until a safe point: SIGINT (Ctrl-C), SIGTERM, SIGUSR1.

While the loop or a hook runs, :class:`Signals` records a signal instead of acting on it;
the loop raises it (:meth:`Signals.raise_pending`) once the running step's event has passed
every hook. SIGINT becomes :class:`Interrupted` (a ``KeyboardInterrupt``), SIGTERM/SIGUSR1
:class:`TerminatedError` (a ``SystemExit``). Under ``torch.distributed`` the ranks vote
(:class:`ftrain._agreement.StopVote`), so all stop after the same update.

Ctrl-C in a script and at a prompt: in a script (the main thread, no interactive prompt:
not IPython/Jupyter, not ``python -i``) the interrupt is :class:`InterruptedExit`, both a
``KeyboardInterrupt`` (``except KeyboardInterrupt`` still catches it) and a ``SystemExit``
with code 130, so a script that does not catch it ends with exit status 130 and no
traceback. At a prompt (Jupyter, IPython, the REPL) it is a plain :class:`Interrupted`:
the cell stops, IPython shows its one line instead of a traceback, and the loop can run on.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import warnings
from types import FrameType
from typing import Any

from ftrain import dist as _dist
from ftrain._agreement import StopVote

__all__ = [
    "Signals",
    "Interrupted",
    "InterruptedExit",
    "TerminatedError",
    "PREEMPTED_EXIT_CODE",
    "INTERRUPTED_EXIT_CODE",
    "STOP_CODES",
    "at_a_prompt",
]

#: The exit status of a run stopped by SIGTERM/SIGUSR1 after saving ``interrupted.pth``:
#: ``EX_TEMPFAIL`` (a job script requeues on it; docs/distributed.md, "Preemption").
PREEMPTED_EXIT_CODE = 75
#: The exit status of a script stopped by Ctrl-C (a shell's 128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130


def at_a_prompt() -> bool:
    """Whether a person is at an interactive prompt (IPython, Jupyter, ``python -i``, the
    REPL) or the code runs off the main thread: then an interrupt must not end the process.

    Example:
        >>> at_a_prompt()  # doctest runs in a script
        False
    """
    if threading.current_thread() is not threading.main_thread():
        return True
    ipython = sys.modules.get("IPython")
    if ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None:
        return True
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run at a safe point; its message says where and what was
    saved ("interrupted at update 7, saved interrupted.pth; run the same call again to
    continue"). IPython and Jupyter show that line instead of a traceback.

    Example:
        >>> Interrupted("interrupted at update 7")._render_traceback_()
        ['KeyboardInterrupt: interrupted at update 7']
    """

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it: one line, no traceback."""
        return [f"KeyboardInterrupt: {self}" if str(self) else "KeyboardInterrupt"]


class InterruptedExit(Interrupted, SystemExit):
    """:class:`Interrupted` in a script: also a ``SystemExit`` with code 130, so an uncaught
    one ends the script with that status and no traceback.

    Example:
        >>> e = InterruptedExit(); e.code, isinstance(e, KeyboardInterrupt)
        (130, True)
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.code = INTERRUPTED_EXIT_CODE


def interrupt() -> Interrupted:
    """The exception Ctrl-C raises here: :class:`InterruptedExit` in a script, else
    :class:`Interrupted` (see the module's docstring)."""
    return Interrupted() if at_a_prompt() else InterruptedExit()


#: The signals the loop holds; several processes: what a rank proposes (the largest wins).
STOP_CODES = {signal.SIGINT: 1, signal.SIGTERM: 3}
if hasattr(signal, "SIGUSR1"):
    STOP_CODES[signal.SIGUSR1] = 2
_HELD_SIGNALS = tuple(STOP_CODES)
SIGNAL_OF_CODE = {code: signum for signum, code in STOP_CODES.items()}


class TerminatedError(SystemExit):
    """Raised in place of SIGTERM or SIGUSR1 at the loop's next safe point.

    A ``SystemExit`` with :data:`PREEMPTED_EXIT_CODE` (raised once every hook's
    ``finally`` has run), so a scheduler can requeue the job; ``signum``: the signal.

    Example:
        >>> TerminatedError().code
        75
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum = signum


class Signals:
    """Hold SIGINT/SIGTERM/SIGUSR1 while ``holding``; the loop raises ``pending`` at a safe point.

    While the caller's code runs a signal acts at once, and so does a second
    Ctrl-C (a hung loader can still be stopped). Several processes (``vote``):
    a signal is only ``requested``; ``pending`` is set when the ranks agree.

    Example:
        >>> s = Signals()
        >>> s.pending = signal.SIGTERM  # what the handler records while the loop holds
        >>> s.raise_pending()
        Traceback (most recent call last):
        ...
        ftrain.loop.signals.TerminatedError: 75
    """

    def __init__(self) -> None:
        self.holding = False
        self.pending: int | None = None
        self._old: dict[int, Any] = {}
        self.vote: StopVote | None = None  # several processes: the run's vote
        self.requested = 0

    def install(self) -> None:
        """Take the signals (SIGUSR1 only from its default action: a cluster tool's stays)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in _HELD_SIGNALS:
            with contextlib.suppress(ValueError, OSError):  # exotic environments
                current = signal.getsignal(sig)
                if sig in self._old and current == self._handler:
                    continue  # already ours: keep the handler we saved
                if sig not in (signal.SIGINT, signal.SIGTERM) and current != signal.SIG_DFL:
                    continue  # someone else's SIGUSR1 handler
                self._old[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Give back the saved handlers, unless someone has replaced ours since."""
        self.pending = None  # the run is ending on an exception already, or was raised
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old.items():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) == self._handler:
                    signal.signal(sig, old)
        self._old.clear()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.vote is not None:  # several processes: held until the ranks agree
            code = STOP_CODES.get(signum, 0)
            if code == self.requested == STOP_CODES[signal.SIGINT]:
                raise interrupt()  # a second Ctrl-C acts at once
            self.requested = max(self.requested, code)
            return
        if not self.holding or (signum == signal.SIGINT and self.pending == signal.SIGINT):
            self.pending = signum
            self.raise_pending()
        if self.pending is None or self.pending == signal.SIGINT:
            self.pending = signum  # a SIGTERM/SIGUSR1 outranks a held Ctrl-C

    def raise_pending(self) -> None:
        """Raise the held signal, if any: :class:`Interrupted` (a ``KeyboardInterrupt``) or
        :class:`TerminatedError`."""
        signum, self.pending = self.pending, None
        if signum == signal.SIGINT:
            raise interrupt()
        if signum is not None:
            raise TerminatedError(signum)

    def start_voting(self) -> None:
        """Several processes: signals stop every rank at the same update (see :meth:`agree`)."""
        self.requested = 0
        self.vote = None
        if _dist.world_size() > 1:
            try:
                self.vote = StopVote()
            except Exception as exc:  # no gloo (or no real process group)
                warnings.warn(
                    f"Ranks cannot vote on stopping ({exc}): a signal then stops only the rank "
                    "it reaches, and the interrupted checkpoint may not be agreed. Install a "
                    "torch build with gloo to have every rank stop at the same update.",
                    stacklevel=4,
                )

    def agree(self) -> None:
        """Every rank, at the same point: ``pending`` becomes the signal any rank holds."""
        if self.vote is not None:
            code = self.vote.settle(self.requested)
            if code:
                self.pending = SIGNAL_OF_CODE[code]

    def vote_after_update(self) -> None:
        """Several processes, after an optimizer update: this rank's vote; all ranks read the
        result at the same later update, so all leave the hot loop there."""
        if self.vote is not None:
            code = self.vote.update(self.requested)
            if code:
                self.pending = SIGNAL_OF_CODE[code]

    def stop_voting(self) -> None:
        vote, self.vote = self.vote, None
        if vote is not None:
            vote.close()
