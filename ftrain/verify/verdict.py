"""What the verifier reports: bitwise equal at N/N resume points, or where a run diverged."""

from __future__ import annotations

import attrs

from ftrain.verify.fingerprint import END

__all__ = ["Divergence", "Signalled", "Verdict"]


@attrs.frozen
class Divergence:
    """Where a run first differs from the uninterrupted one.

    Attributes:
        source: the run compared, e.g. ``"resumed from the snapshot at update 4"``.
        update: the first update that differs (:data:`~ftrain.verify.fingerprint.END`: only
            what the run did after its last update: the end-of-run evaluation, logs...).
        part: what differs first, of ``data order``, ``RNG``, ``hook state``, ``transform
            state``, ``optimizer state``, ``weights``, ``log lines`` (a cause before its effects).
        key: the tensor or key that differs first in that part (``blocks.0.linear1.weight``,
            ``micro-batch 11.0``, ``metrics.jsonl line 7``).
        detail: how it differs (``max difference 0.0123``).
        max_difference: the largest absolute difference there, when values are numbers.
        also: the other parts that differ at that update.

    Example:
        >>> print(Divergence("resumed from the snapshot at update 4", 5, "data order",
        ...                  "micro-batch 11.0", "max difference 36", 36.0, ("weights",)))
        resumed from the snapshot at update 4: first divergence at update 5: data order: micro-batch 11.0: max difference 36 (also: weights)
    """

    source: str
    update: int
    part: str
    key: str
    detail: str
    max_difference: float | None = None
    also: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = "the end of the run" if self.update == END else f"update {self.update}"
        key = f"{self.key}: " if self.key else ""
        also = f" (also: {', '.join(self.also)})" if self.also else ""
        return f"{self.source}: first divergence at {where}: {self.part}: {key}{self.detail}{also}"


@attrs.frozen
class Signalled:
    """A signal delivered to a training process, and how that process ended.

    ``micro_batch``: the signal was raised in the model's forward of this micro-batch
    (counted from 1 over the run). ``exit_code``: the process's (``-9`` for SIGKILL, ``130``
    for Ctrl-C, ``ftrain.loop.PREEMPTED_EXIT_CODE`` for SIGTERM/SIGUSR1): the signal arrived.
    ``resumed_from``: the checkpoint the next process resumed from (``None``: the start).
    """

    signal: str
    micro_batch: int
    exit_code: int
    resumed_from: str | None

    def __str__(self) -> str:
        resumed = self.resumed_from or "the start (no checkpoint)"
        return (
            f"{self.signal} at micro-batch {self.micro_batch}: exit {self.exit_code}, "
            f"resumed from {resumed}"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@attrs.frozen
class Verdict:
    """The verifier's answer: ``ok`` when every resume point continued bitwise as the
    uninterrupted run; ``str(verdict)`` is the report.

    Attributes:
        updates: the optimizer updates of the uninterrupted run.
        snapshots: the updates resumed from (a snapshot taken there, resumed in a new Loop).
        signals: the signals delivered to subprocesses, each a resume point.
        equal: the resume points whose run continued bitwise as the uninterrupted one.
        divergences: each diverging run's first difference (resume points, and a run that
            differs because it saved checkpoints).
        nondeterministic: the uninterrupted run differs from itself (``divergences[0]``
            says where): resume was not checked.
        seconds: the wall time the verification took.
    """

    updates: int
    snapshots: tuple[int, ...]
    signals: tuple[Signalled, ...]
    equal: int
    divergences: tuple[Divergence, ...]
    nondeterministic: bool = False
    seconds: float = 0.0

    @property
    def points(self) -> int:
        """The resume points checked: snapshots and signals."""
        return len(self.snapshots) + len(self.signals)

    @property
    def ok(self) -> bool:
        """Whether every resume point continued bitwise as the uninterrupted run."""
        return not self.divergences and not self.nondeterministic

    def __str__(self) -> str:
        what = f"{_count(len(self.snapshots), 'snapshot')}, {_count(len(self.signals), 'signal')}"
        tail = f" ({what}; {_count(self.updates, 'update')}; {self.seconds:.1f} s)"
        if self.nondeterministic:
            return (
                f"nondeterministic: {self.divergences[0]}\nThe uninterrupted run differs from "
                "itself, so resume was not checked. Seed every generator in build() "
                "(torch.manual_seed, the loader's generator=), avoid nondeterministic "
                "algorithms (torch.use_deterministic_algorithms(True)), and verify again."
            )
        if self.ok:
            return f"bitwise equal at {self.equal}/{self.points} resume points{tail}"
        lines = [f"not exact: bitwise equal at {self.equal}/{self.points} resume points{tail}"]
        lines += [f"  {d}" for d in self.divergences]
        return "\n".join(lines)
