"""Signal campaigns: the user's run in subprocesses, signalled at chosen moments, resumed.

A campaign starts the run in a fresh process (``python -m ftrain.verify.child``), which raises
a signal (SIGINT, SIGTERM, SIGKILL, SIGUSR1) in the model's forward of a chosen micro-batch;
the process must end as that signal ends a run (its exit status says the signal arrived:
no clock is involved); the next process resumes with ``resume="auto"`` in the same run
directory, as a restarted job does, and may be signalled in turn; the last one finishes.
Where the signals land is drawn from a seeded generator: a campaign reruns identically.
"""

from __future__ import annotations

import os
import pickle
import random
import runpy
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import orjson
import torch

from ftrain.loop import PREEMPTED_EXIT_CODE, Loop
from ftrain.verify.child import ChildSpec
from ftrain.verify.fingerprint import DATA, Summary, difference
from ftrain.verify.record import Build, Trace, fresh_dir
from ftrain.verify.verdict import Divergence, Signalled

__all__ = ["EXIT_CODES", "PER_CAMPAIGN", "plan", "Campaigns", "Outcome"]

#: How a run ends on each signal the campaigns send: the proof it arrived.
EXIT_CODES = {
    signal.SIGINT: 130,
    signal.SIGTERM: PREEMPTED_EXIT_CODE,
    signal.SIGKILL: -signal.SIGKILL,
}
if hasattr(signal, "SIGUSR1"):
    EXIT_CODES[signal.SIGUSR1] = PREEMPTED_EXIT_CODE
#: Signals per campaign: a run signalled, resumed and signalled again, then finished.
PER_CAMPAIGN = 2

Delivery = tuple[int, int]  # (signal, micro-batch counted from 1 over the run)


def plan(n: int, kinds: Sequence[int], micro_batches: int, seed: int) -> list[list[Delivery]]:
    """``n`` signals, ``PER_CAMPAIGN`` a campaign, at seeded micro-batches of the run; the
    kinds in turn (each appears once ``n >= len(kinds)``), in a seeded order.

    Example:
        >>> import signal
        >>> [[s.name for s, _ in c] for c in plan(3, [signal.SIGINT, signal.SIGKILL], 20, 0)]
        [['SIGINT', 'SIGINT'], ['SIGKILL']]
    """
    if n and micro_batches < PER_CAMPAIGN + 1:
        raise ValueError(
            f"verify_resume(signals={n}): the run has {micro_batches} micro-batches, too few to "
            "signal it and resume: build a run of a few updates at least."
        )
    rng = random.Random(f"ftrain.verify-{seed}")
    sigs = [signal.Signals(kinds[i % len(kinds)]) for i in range(n)]  # each kind in turn
    rng.shuffle(sigs)
    out = []
    for first in range(0, n, PER_CAMPAIGN):
        k = min(PER_CAMPAIGN, n - first)
        micros = sorted(rng.sample(range(1, micro_batches), k))
        out.append(list(zip(sigs[first : first + k], micros)))
    return out


@attrs.frozen
class Outcome:
    """What the campaigns found: the signals, the runs that diverged after one, how many
    continued exactly, and a fresh process differing before any signal (nondeterminism)."""

    signalled: list[Signalled]
    divergences: list[Divergence]
    equal: int
    nondeterministic: Divergence | None


@attrs.frozen
class FromScript:
    """A build function of the script run as ``__main__``, found by path in a subprocess
    (its ``if __name__ == "__main__":`` block does not run there)."""

    path: str
    name: str

    def __call__(self, work_dir: Path, resume: str | Path | None) -> Loop:
        found = runpy.run_path(self.path, run_name="__ftrain_verify__")[self.name]
        return found(work_dir, resume)


def portable(build: Build) -> Build:
    """``build`` as a subprocess can load it (pickled by reference); raises a clear error
    when it cannot.

    Example:
        >>> import functools, pickle, ftrain.demo
        >>> portable(ftrain.demo.build_short) is ftrain.demo.build_short
        True
    """
    main = sys.modules.get("__main__")
    name = getattr(build, "__qualname__", "")
    if getattr(build, "__module__", None) == "__main__" and getattr(main, "__file__", None):
        if "." not in name and "<" not in name:
            build = FromScript(os.path.abspath(main.__file__), name)
    try:
        pickle.dumps(build)
    except Exception as exc:
        raise TypeError(
            f"verify_resume(signals=...): the subprocesses cannot load build={build!r} ({exc}): "
            "define it at the top level of a module or script (not a lambda or a function "
            "inside another), or pass a functools.partial of such a function."
        ) from None
    return build


def _env() -> dict[str, str]:
    """This process's import path for the child (the user's module must import there too)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *paths])
    env.setdefault("TQDM_DISABLE", "1")
    return env


@attrs.define
class Campaigns:
    """Runs the planned campaigns of ``build`` and compares them with ``reference``."""

    build: Build
    root: Path
    reference: Trace
    rng: dict
    volatile: tuple[str, ...]
    quiet: bool = True
    say: Callable[[str], None] = print

    def run(self, planned: list[list[Delivery]]) -> Outcome:
        signalled: list[Signalled] = []
        divergences: list[Divergence] = []
        fresh: Divergence | None = None
        for c, deliveries in enumerate(planned):
            got, found = self._campaign(c, deliveries)
            signalled += got
            fresh = fresh or found.pop(0, None)
            divergences += found.values()
        return Outcome(signalled, divergences, len(signalled) - len(divergences), fresh)

    def _campaign(self, c: int, deliveries: list[Delivery]) -> tuple[list[Signalled], dict]:
        """Run one campaign; its signals, and the first divergence of each of its processes."""
        side = fresh_dir(self.root / f"campaign-{c}")
        fresh_dir(side / "details")
        codes = [self._process(side, i, d) for i, d in enumerate([*deliveries, None])]
        records = _read(side / "records.jsonl")
        starts = {r["child"]: r.get("resumed_from") for r in records if "start" in r}
        signalled = [
            Signalled(signal.Signals(sig).name, micro, codes[i], starts.get(i + 1))
            for i, (sig, micro) in enumerate(deliveries)
        ]
        sources = [_source(c, None), *(_source(c, s) for s in signalled)]
        found = _divergent(self.reference, records)
        return signalled, {i: self._explain(*f, sources[i]) for i, f in found.items()}

    def _process(self, side: Path, index: int, delivery: Delivery | None) -> int:
        spec = ChildSpec(
            self.build, str(side / "run"), str(side / "records.jsonl"), str(side / "details"),
            index, self.reference.summaries, self.rng, torch.get_num_threads(), self.volatile,
            delivery,
        )  # fmt: skip
        path = side / f"spec-{index}.pkl"
        path.write_bytes(pickle.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "ftrain.verify.child", str(path)],
            env=_env(),
            stdout=subprocess.DEVNULL if self.quiet else None,
            stderr=subprocess.PIPE,
            text=True,
        )
        expected = 0 if delivery is None else EXIT_CODES[delivery[0]]
        if proc.returncode != expected:
            raise RuntimeError(_failed(index, delivery, proc.returncode, expected, proc.stderr))
        what = "ran to the end" if delivery is None else (
            f"{signal.Signals(delivery[0]).name} at micro-batch {delivery[1]}"
        )  # fmt: skip
        self.say(f"{side.name}, process {index}: {what}, exit {proc.returncode}")
        return proc.returncode

    def _explain(self, update: int, parts: list[str], rec: dict | None, source: str) -> Divergence:
        part, also = parts[0], tuple(parts[1:])
        if rec is None:
            return Divergence(source, update, part, "", "never reached", None, also)
        detail = rec.get("detail")
        if detail and Path(detail).is_file():
            got = torch.load(detail, weights_only=False)
            return Divergence(
                source, update, part, *difference(part, self.reference.full(update), got), also
            )
        ref = self.reference.summaries[update]
        keys = (
            [k for k in ref.data if ref.data.get(k) != rec["data"].get(k)] if part == DATA else []
        )
        return Divergence(source, update, part, keys[0] if keys else "", "differs", None, also)


def _failed(index: int, delivery: Delivery | None, code: int, expected: int, stderr: str) -> str:
    what = "the final process" if delivery is None else (
        f"the process signalled with {signal.Signals(delivery[0]).name} at micro-batch {delivery[1]}"
    )  # fmt: skip
    why = "it finished: the signal never arrived" if code == 0 else "see its output below"
    tail = "\n".join(stderr.strip().splitlines()[-25:])
    return (
        f"verify_resume: {what} (#{index}) exited with {code}, expected {expected} ({why}).\n{tail}"
    )


def _source(campaign: int, signalled: Signalled | None) -> str:
    if signalled is None:
        return f"a fresh run in a subprocess (campaign {campaign}, before its first signal)"
    return f"resumed after {signalled.signal} at micro-batch {signalled.micro_batch} (campaign {campaign})"


def _read(path: Path) -> list[dict]:
    out = []
    for raw in path.read_bytes().splitlines() if path.is_file() else []:
        try:
            out.append(orjson.loads(raw))
        except orjson.JSONDecodeError:  # a line cut by SIGKILL
            continue
    return out


def _divergent(
    reference: Trace, records: list[dict]
) -> dict[int, tuple[int, list[str], dict | None]]:
    """Per process, its first update (as last recorded) that differs from the reference."""
    updates = {r["update"]: r for r in records if "update" in r}
    micro = {r["micro"]: r["digest"] for r in records if "micro" in r}
    last_child = max((r["child"] for r in records), default=0)
    found: dict[int, tuple[int, list[str], dict | None]] = {}
    for update, ref in reference.summaries.items():
        rec = updates.get(update)
        if rec is None:
            found.setdefault(last_child, (update, [DATA], None))
            continue
        data = {k: v for k, v in rec["data"].items() if not k.startswith("micro-batch ")}
        data.update(
            {k: micro.get(int(k.split()[1])) for k in ref.data if k.startswith("micro-batch ")}
        )
        parts = ref.differing(Summary(rec["digests"], data))
        if parts:
            found.setdefault(rec["child"], (update, parts, rec))
    return found
