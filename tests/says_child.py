"""A plain user script, for tests/test_run_says.py: ``python says_child.py WORK_DIR HOOKS
[SIGNAL UPDATE]``.

8 updates of a linear model with ``resume="auto"``; ``WORK_DIR`` ``-`` runs without one.
``HOOKS``: ``default`` (``ftrain.default_hooks``: a console), ``quiet`` (checkpoints and
save-on-interrupt, no console) or ``periodic`` (checkpoints every 2 updates, nothing saved
on an interruption, ``resume=None``). With SIGNAL the script sends itself that signal from
inside the loss function of update UPDATE (mid-step: the loop holds it until the update's
hooks have run). It catches nothing: what the user sees is the library's.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import ftrain


def main(work_dir: str, hooks_kind: str, signum: int | None, at: int | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls = [0]

    def loss_fn(m, batch):
        calls[0] += 1
        if signum is not None and calls[0] == at:
            os.kill(os.getpid(), signum)
        return m(batch).pow(2).mean()

    if hooks_kind == "default":
        hooks = ftrain.default_hooks(log_every=2, progress=False, summary=False)
    elif hooks_kind == "quiet":
        hooks = [ftrain.CheckpointHook(2), ftrain.hooks.AutoCheckpointHook()]
    else:
        hooks = [ftrain.CheckpointHook(2)]
    lp = ftrain.Loop(
        ftrain.make_step(loss_fn), state, [torch.ones(2, 4)] * 8, hooks, max_steps=8,
        work_dir=None if work_dir == "-" else work_dir,
        resume=None if hooks_kind == "periodic" or work_dir == "-" else "auto",
    )  # fmt: skip
    print("DONE", lp.run().step, flush=True)


if __name__ == "__main__":
    work, kind, *rest = sys.argv[1:]
    main(work, kind, getattr(signal, rest[0]) if rest else None, int(rest[1]) if rest else None)
