"""Kill/resume campaigns: signal a training process at random moments, resume, compare.

Each campaign runs tests/resume_train.py in a subprocess, sends it SIGKILL,
SIGTERM or SIGINT (seeded choice) at a seeded random moment, a few times,
then lets it finish; its outcome (weights, optimizer, EMA, counters, best
checkpoint state, logged metric lines) must equal the uninterrupted run's.
Reading a sample takes a little time, so many signals land while the loader
fetches. Seeds are fixed: a failing campaign reruns with the same choices
(the landing points still vary with machine speed).

Also: SIGUSR1 and SIGTERM (a cluster's preemption notice) save and exit with
``ftrain.PREEMPTED_EXIT_CODE``.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_resume_exact import TRAINING_SECONDS, assert_same, straight

import ftrain

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("resume_train.py")
CAMPAIGNS_PER_CONFIG = 2
SIGNALS_PER_CAMPAIGN = 2
EXIT = {  # what the process may end with, per signal (0: it finished first)
    signal.SIGKILL: {-signal.SIGKILL, 0},
    # before the loop holds signals (start-up, resume): the default action
    signal.SIGTERM: {ftrain.PREEMPTED_EXIT_CODE, -signal.SIGTERM, 0},
    signal.SIGINT: {130, 0},
}


def start(config, work_dir, fetch_seconds=None):
    env = dict(os.environ)
    if fetch_seconds is not None:
        env["RESUME_TRAIN_FETCH_SECONDS"] = str(fetch_seconds)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), config, str(work_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "READY"
    return proc


def finish(proc):
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, "DONE" in out


def campaign(config, work_dir, rng, seconds):
    """Signal the run ``SIGNALS_PER_CAMPAIGN`` times, then finish it; return the signals sent."""
    sent = []
    for _ in range(SIGNALS_PER_CAMPAIGN):
        proc = start(config, work_dir)
        time.sleep(rng.uniform(0.05, 0.6) * seconds)
        sig = rng.choice(list(EXIT))
        proc.send_signal(sig)
        code, done = finish(proc)
        assert code in EXIT[sig], f"{sig.name}: exit status {code}"
        if done:
            return sent  # it finished before the signal landed
        sent.append(sig.name)
    code, done = finish(start(config, work_dir))
    assert code == 0 and done
    return sent


@pytest.mark.parametrize("config", ["accum29", "sdl0", "sdl2", "plain", "dl_nogen"])
def test_random_signals_then_resume_end_as_an_uninterrupted_run(
    config, tmp_path, tmp_path_factory, capsys
):
    expected = straight(config, tmp_path_factory)  # trained in this process
    seconds = TRAINING_SECONDS[config]
    exact, signals, failures = 0, [], []
    for i in range(CAMPAIGNS_PER_CONFIG):
        rng = random.Random(f"{config}-{i}")
        work_dir = tmp_path / f"campaign-{i}"
        signals += campaign(config, work_dir, rng, seconds)
        try:
            assert_same(torch.load(work_dir / "final.pt", weights_only=False), expected)
        except AssertionError as exc:
            failures.append(f"campaign {i} (seed {config}-{i}): {exc}")
        else:
            exact += 1
    with capsys.disabled():
        print(
            f"\n{config}: {exact} exact / {CAMPAIGNS_PER_CONFIG} runs "
            f"({len(signals)} signals: {', '.join(signals) or 'none landed'})"
        )
    assert not failures, "\n".join(failures)
    assert signals, "no signal landed before the run finished"


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_preemption_signal_saves_and_exits_for_requeue(sig, tmp_path, tmp_path_factory):
    expected = straight("sdl0", tmp_path_factory)
    proc = start("sdl0", tmp_path, fetch_seconds=0.004)  # slow enough to signal mid-run
    deadline = time.monotonic() + 120
    while not (tmp_path / "iter_2.pth").exists():  # training has begun
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    code, done = finish(proc)
    assert (code, done) == (ftrain.PREEMPTED_EXIT_CODE, False)
    assert (tmp_path / "interrupted.pth").exists()
    code, done = finish(start("sdl0", tmp_path))  # the requeued job
    assert code == 0 and done
    assert_same(torch.load(tmp_path / "final.pt", weights_only=False), expected)
