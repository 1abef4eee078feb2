"""SIGKILL a training process at random moments; resuming must end bitwise equal."""

import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from ftrain.checkpoint import find_resumable

SCRIPT = Path(__file__).with_name("crash_train.py")


def run(work_dir, kill_after=None):
    """Run the script; SIGKILL it ``kill_after`` seconds after READY. True if it finished."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(work_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "READY"
    if kill_after is None:
        start = time.perf_counter()
        out = proc.stdout.read()
        assert proc.wait(timeout=300) == 0
        run.seconds = time.perf_counter() - start
        return "DONE" in out
    time.sleep(kill_after)
    proc.kill()
    proc.wait()
    out = proc.stdout.read()
    return "DONE" in out


def test_sigkill_at_random_moments_then_resume_is_exact(tmp_path):
    straight_dir = tmp_path / "straight"
    assert run(straight_dir)
    expected = torch.load(straight_dir / "final.pt")

    crash_dir = tmp_path / "crash"
    rng = random.Random(1234)
    kills = 0
    hit_a_write = 0
    finished = False
    while kills < 6 and not finished:
        # kill early enough that the run needs many restarts: each attempt gets at most
        # ~10% of the straight run's time (resuming eats into it), whatever the speed
        finished = run(crash_dir, kill_after=0.02 + rng.uniform(0.03, 0.09) * run.seconds)
        if finished:
            break
        kills += 1
        if list(crash_dir.glob(".*.tmp-*")):
            hit_a_write += 1  # killed in the middle of a checkpoint write
        if (crash_dir / "manifest.json").exists():
            found = find_resumable(crash_dir)
            assert found is not None, "a kill left no loadable checkpoint"
    while not finished:
        finished = run(crash_dir)
    assert kills >= 5, f"the run finished after only {kills} kills; slow the script down"
    assert hit_a_write >= 1, "no kill landed during a checkpoint write"
    got = torch.load(crash_dir / "final.pt")
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
