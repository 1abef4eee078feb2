"""One training process of a signal campaign: ``python -m ftrain.verify.child SPEC``.

It builds the user's run with ``resume="auto"`` (what a restarted job does), raises the
planned signal in the model's forward of the planned micro-batch (inside the step, where a
real signal lands while the loop holds it), and writes, flushed as it goes, a record per
micro-batch (its digest) and per update (each part's digest) for the campaign to compare.
At its first update that differs from the uninterrupted run it also keeps that update's
full fingerprint, to explain the difference down to the tensor.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

import attrs
import orjson
import torch

from ftrain.events import StepEnd
from ftrain.loop import Loop
from ftrain.persist.rng import restore_rng
from ftrain.verify.fingerprint import END, Summary, capture, digest, flatten, summarize
from ftrain.verify.record import Build, open_loop

__all__ = ["ChildSpec", "main"]


@attrs.frozen
class ChildSpec:
    """What one campaign process runs (pickled by the campaign, read by :func:`main`)."""

    build: Build
    work_dir: str
    records: str
    details: str
    index: int
    reference: dict[int, Summary]
    rng: dict
    threads: int
    volatile: tuple[str, ...]
    signal: tuple[int, int] | None  # (signum, micro-batch of the run, counted from 1)


def arm(loop: Loop, signum: int, micro_batch: int) -> Callable[[int], None]:
    """Raise ``signum`` in the training forward of ``micro_batch``; returns ``start(micro_step)``,
    to call once the loop has resumed (the micro-batches done before this process)."""
    seen: list[int] = []

    def pre_hook(module: torch.nn.Module, args: object) -> None:
        if seen and torch.is_grad_enabled():  # a training step (evaluations run without grad)
            seen[0] += 1
            if seen[0] == micro_batch:
                signal.raise_signal(signum)

    loop.state.model.register_forward_pre_hook(pre_hook)
    return lambda done: seen.append(done)


def _write(out: IO[bytes], record: dict) -> None:
    out.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))  # one write: a whole line


def _differs(spec: ChildSpec, update: int, summary: Summary) -> bool:
    ref = spec.reference.get(update)
    return ref is None or bool(ref.differing(summary, data_keys=summary.data.keys()))


def _update(
    spec: ChildSpec, loop: Loop, update: int, batches: dict, out: IO[bytes], *, explain: bool
) -> bool:
    """Record ``update``; with ``explain``, keep its full fingerprint if it differs."""
    fp = capture(loop, batches, spec.volatile)
    summary = summarize(fp)
    detail = None
    if explain and _differs(spec, update, summary):
        detail = str(Path(spec.details) / f"{spec.index}-{update}.pt")
        torch.save(fp, detail)
    _write(out, {"child": spec.index, "update": update, "digests": summary.digests,
                 "data": summary.data, "detail": detail})  # fmt: skip
    return detail is not None


def follow(spec: ChildSpec, loop: Loop, out: IO[bytes], start: Callable[[int], None]) -> None:
    """Run ``loop`` to its end (or its signal), writing the campaign's records."""
    batches: dict[int, object] = {}
    first, explained = True, False
    for ev in loop:
        if first:  # RunBegin: the loop has resumed
            first = False
            start(ev.state.micro_step)
            name = None if loop.resumed_from is None else Path(loop.resumed_from).name
            _write(out, {"child": spec.index, "start": ev.state.micro_step, "resumed_from": name})
        if type(ev) is not StepEnd:
            continue
        if ev.batch is not None:
            micro = ev.state.micro_step
            batches[micro] = ev.batch
            flat = flatten(ev.batch, f"micro-batch {micro}")
            _write(out, {"child": spec.index, "micro": micro, "digest": digest(flat)})
        if ev.is_update:
            update = ev.state.step
            explained = (
                _update(spec, loop, update, batches, out, explain=not explained) or explained
            )
            batches = {}
    _update(spec, loop, END, {}, out, explain=not explained)


def main(spec_path: str) -> int:
    """Run one campaign process; its exit status is the run's (130 on Ctrl-C)."""
    with open(spec_path, "rb") as f:
        spec: ChildSpec = pickle.load(f)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the parent ignores it
    torch.set_num_threads(spec.threads)
    restore_rng(spec.rng)  # every run starts from the same global random state
    loop = open_loop(spec.build, Path(spec.work_dir), "auto")
    start: Callable[[int], None] = lambda done: None  # noqa: E731
    if spec.signal is not None:
        start = arm(loop, *spec.signal)
    with open(spec.records, "ab", buffering=0) as out:
        try:
            follow(spec, loop, out, start)
        except KeyboardInterrupt:
            return 130
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main(sys.argv[1]))
