"""A small run logging to every sink, for tests/test_sink_resume.py.

``python sink_resume_child.py WORK_DIR [SIGNAL UPDATE]``: 12 updates (an evaluation every 3,
a log every 2, a checkpoint every 6) into WORK_DIR with ``resume="auto"``; with SIGNAL
(``SIGKILL``, ``SIGINT``, ``SIGTERM``) the run sends itself that signal from a hook when
update UPDATE has passed every other hook. Deterministic: the same rows every time.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import make_batches, make_model, mse_loss  # noqa: E402

import ftrain  # noqa: E402

UPDATES, LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY = 12, 2, 3, 6


def trackers() -> list[str]:
    """The tracker sinks whose packages are installed."""
    return [n for n in ("mlflow", "wandb") if importlib.util.find_spec(n) is not None]


def build(work_dir: str, signum: int | None, at: int | None) -> ftrain.Loop:
    torch.manual_seed(0)
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    val = make_batches(2, seed=7)

    def evaluate(s: ftrain.TrainState) -> dict[str, float]:
        return {"val_loss": sum(float(mse_loss(s.model, b)) for b in val) / len(val)}

    def signal_self(events):
        for ev in events:
            yield ev
            if signum is not None and type(ev).__name__ == "StepEnd" and ev.state.step == at:
                os.kill(os.getpid(), signum)  # SIGKILL: no hook runs after this

    hooks = [
        ftrain.TimerHook(skip_first_k=0),
        ftrain.EvalHook(evaluate, every=EVAL_EVERY, by_epoch=False),
        ftrain.LoggerHook(
            every=LOG_EVERY, progress=False, sinks=["csv", *trackers()], config={"seed": 0}
        ),
        ftrain.CheckpointHook(CHECKPOINT_EVERY, max_keep=2),
        ftrain.BestCheckpointHook("val/loss"),  # the name the console shows
        ftrain.hooks.AutoCheckpointHook(),
        ftrain.hook(
            signal_self,
            priority="LOWEST",
            name="signal_self",
            cadence=ftrain.Every(at=(at,)) if at else ftrain.Every(),
        ),  # fmt: skip
    ]
    batches = make_batches(UPDATES, seed=3)
    return ftrain.Loop(
        ftrain.make_step(mse_loss), state, batches, hooks, max_steps=UPDATES,
        work_dir=work_dir, resume="auto",
    )  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    work, *rest = sys.argv[1:]
    signum = getattr(signal, rest[0]) if rest else None
    build(work, signum, int(rest[1]) if rest else None).run()
    print("DONE", flush=True)
