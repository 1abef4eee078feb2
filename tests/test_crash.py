"""SIGKILL a training process at chosen points (in a step, inside a checkpoint write, between
a write and its record, between a record and its deletes); resuming must end bitwise equal,
with no file left behind. Each kill point is injected (tests/crash_train.py), never timed.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import torch

import ftrain
from ftrain.checkpoint import find_resumable

SCRIPT = Path(__file__).with_name("crash_train.py")
ROOT = Path(ftrain.__file__).parent.parent  # the ftrain under test


def run(work_dir, kill=None):
    """Run the script (killed at ``kill``); its exit status and stdout."""
    args = [sys.executable, str(SCRIPT), str(work_dir), *([kill] if kill else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def listed(d):
    return [e["name"] for e in orjson.loads((d / "manifest.json").read_bytes())["files"]]


def test_sigkill_at_chosen_points_then_resume_is_exact(tmp_path):
    straight_dir = tmp_path / "straight"
    status, out = run(straight_dir)
    assert status == 0 and "DONE 45 90" in out, out[-2000:]
    expected = torch.load(straight_dir / "final.pt")

    d = tmp_path / "crash"
    # (kill point, what it leaves on disk); each attempt resumes from the one before
    points = [
        ("batch:7", lambda: True),  # mid window, no write under way
        ("write:iter_9.pth:20000", lambda: list(d.glob(".iter_9.pth.tmp-*"))),  # half written
        (
            "commit:iter_14.pth",
            lambda: (d / "iter_14.pth").exists() and "iter_14.pth" not in listed(d),
        ),  # complete, not recorded  # fmt: skip
        (
            "prune:iter_16.pth",
            lambda: (d / "iter_16.pth").exists() and "iter_16.pth" not in listed(d),
        ),  # dropped, not yet deleted  # fmt: skip
        ("batch:20", lambda: True),
    ]
    for kill, left in points:
        status, out = run(d, kill)
        assert status == -signal.SIGKILL, (kill, out[-2000:])  # the kill point was reached
        assert left(), (kill, sorted(p.name for p in d.iterdir()))
        assert all((d / n).exists() for n in listed(d)), kill  # never a name without its file
        assert find_resumable(d) is not None, f"{kill} left no loadable checkpoint"
    status, out = run(d)
    assert status == 0 and "DONE 45 90" in out, out[-2000:]
    got = torch.load(d / "final.pt")
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    # no temporary, orphan or kept-beyond-max_keep file is left
    assert sorted(p.name for p in d.iterdir()) == [
        "final.pt", "iter_44.pth", "iter_45.pth", "manifest.json",
    ]  # fmt: skip
