"""Kill/resume campaigns on tests/resume_train.py, checked by the resume verifier.

Each configuration is run by :func:`ftrain.verify.verify_resume`: uninterrupted twice,
then in subprocesses signalled with SIGINT, SIGTERM or SIGKILL inside the model's forward
of seeded micro-batches (one campaign of two signals a configuration, two of the three
kinds in turn: signalled, resumed with ``resume="auto"``, signalled again, resumed to the
end). Every update (weights, optimizer,
EMA and the other transform state, RNG, the batches it trained on, hook state, the lines
of metrics.jsonl) must equal the uninterrupted run's. A signal's arrival is proven by the
process's exit status (130, ``ftrain.loop.PREEMPTED_EXIT_CODE``, -9), never by timing, and the
same seed repeats the same campaign.

Also: SIGUSR1 and SIGTERM (a cluster's preemption notice) save ``interrupted.pth`` and exit
with ``ftrain.loop.PREEMPTED_EXIT_CODE``; the requeued run resumes from it exactly.
"""

import functools
import signal

import pytest
from resume_train import CONFIGS, verify_build

import ftrain
from ftrain.verify import verify_resume
from ftrain.verify.campaign import EXIT_CODES

pytestmark = pytest.mark.slow

SIGNALS = 2  # one campaign of two signals a configuration (the suite's time budget)
KINDS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


def kinds_of(seed: int) -> list[signal.Signals]:
    """Two kinds a configuration, in turn: over the configurations every kind comes first and
    second, and each pair of kinds is met."""
    return [KINDS[seed % 3], KINDS[(seed + 1) % 3]]


def test_the_configurations_deliver_every_kind():
    kinds = [k for seed in range(len(CONFIGS)) for k in kinds_of(seed)]
    assert len(CONFIGS) >= 3 and set(kinds) == set(KINDS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_signals_then_resume_end_as_an_uninterrupted_run(config, capsys):
    seed = list(CONFIGS).index(config)
    verdict = verify_resume(functools.partial(verify_build, config), points=0, signals=SIGNALS,
                            seed=seed, kinds=kinds_of(seed))  # fmt: skip
    with capsys.disabled():
        print(f"\n{config}: {verdict}" + "".join(f"\n  {s}" for s in verdict.signals))
    assert len(verdict.signals) == SIGNALS
    for s in verdict.signals:  # each arrived: the process ended as that signal ends a run
        assert s.exit_code == EXIT_CODES[signal.Signals[s.signal]], s
    assert verdict.ok, str(verdict)
    assert verdict.equal == verdict.points == SIGNALS


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_preemption_signal_saves_and_exits_for_requeue(sig):
    verdict = verify_resume(functools.partial(verify_build, "sdl0"), points=0, signals=1,
                            kinds=[sig])  # fmt: skip
    (s,) = verdict.signals
    assert (s.signal, s.exit_code) == (sig.name, ftrain.loop.PREEMPTED_EXIT_CODE)
    assert s.resumed_from == "interrupted.pth"  # saved on the signal; the requeued job took it
    assert verdict.ok, str(verdict)
