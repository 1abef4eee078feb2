"""A small training run used by the crash test: ``python crash_train.py WORK_DIR [KILL]``.

Deterministic; resumes with ``resume="auto"``; prints DONE at the end and writes the final
parameters to ``WORK_DIR/final.pt``. ``KILL`` sends this process SIGKILL at one chosen point:

- ``batch:K``: in the K-th micro-batch this process trains (outside any write);
- ``write:NAME:BYTES``: inside the write of checkpoint NAME, once BYTES of it are written
  (the background writer's thread: the temporary file is left half written);
- ``commit:NAME``: once NAME is renamed into place, before the manifest records it;
- ``prune:NAME``: when NAME is deleted, after the manifest that dropped it was written.
"""

import os
import signal
import sys

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
import ftrain.persist.files as files
from ftrain.persist.rundir import RunDir


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill: str) -> int | None:
    """Install the kill point ``kill``; returns K for ``batch:K`` (the loss kills there)."""
    kind, _, what = kill.partition(":")
    if kind == "batch":
        return int(what)
    if kind == "write":
        name, at = what.rsplit(":", 1)
        real_write = files._HashingWriter.write

        def write(self, data):
            if f".{name}{files.TMP_MARK}" in str(self.f.name) and self.size >= int(at):
                die()
            return real_write(self, data)

        files._HashingWriter.write = write
    elif kind in ("commit", "prune"):
        method = "commit" if kind == "commit" else "delete"
        real = getattr(RunDir, method)

        def patched(self, *args):
            if kind == "prune" and args[-1] == what:
                die()  # the manifest without it is written; the file is still there
            real(self, *args)
            if kind == "commit" and args[-1] == what:
                die()  # in place, not recorded

        setattr(RunDir, method, patched)
    else:
        raise SystemExit(f"unknown kill point {kill!r}")
    return None


def main(work_dir: str, kill: str | None) -> None:
    torch.set_num_threads(1)
    kill_batch = arm(kill) if kill else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 8),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(240, 64, generator=g), torch.randn(240, 8, generator=g)
    )
    loader = StatefulDataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    trained = []

    def loss_fn(model, batch):
        trained.append(1)
        if len(trained) == kill_batch:
            die()
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    step = ftrain.with_clip(
        ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2), max_norm=1.0
    )
    hooks = [ftrain.CheckpointHook(interval=1, max_keep=2), ftrain.hooks.AutoCheckpointHook()]
    lp = ftrain.Loop(
        step,
        ftrain.TrainState.create(model, opt),
        loader,
        hooks=hooks,
        epochs=3,
        work_dir=work_dir,
        resume="auto",
    )
    state = lp.run()
    torch.save([p.detach() for p in state.model.parameters()], f"{work_dir}/final.pt")
    print("DONE", state.step, state.micro_step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
