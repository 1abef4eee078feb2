"""A run whose work_dir is on S3, for tests/test_object_store.py.

``python store_train.py ENDPOINT URL MODE``, ``MODE``:

- ``kill:NAME``: train; die (``os._exit(9)``) inside the multipart upload of the object
  ``NAME`` once its first part is on the server (S3 parts of 5 MiB: the checkpoints of this
  model are about 11.5 MB, three parts);
- ``hold``: train to step 4, print ``HOLDING``, then wait (holding the run directory's lock)
  until killed.

Deterministic: the same model, data and steps as :func:`build` gives the test itself.
"""

from __future__ import annotations

import os
import sys

import torch

import ftrain

KILLED = 9


def options(endpoint: str) -> dict:
    """The s3fs options of the test's S3 server (credentials for it alone)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def batches(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 1200, generator=g), torch.randn(4, 1200, generator=g))
            for _ in range(n)]  # fmt: skip


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def build(work_dir, storage_options=None, resume="auto", hooks=()) -> ftrain.Loop:
    """8 updates of a 1200x1200 linear model (SGD with momentum), a checkpoint every 2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1200, 1200)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return ftrain.Loop(
        ftrain.make_step(loss_fn),
        ftrain.TrainState.create(model, opt),
        batches(),
        hooks=[ftrain.CheckpointHook(2), *hooks],
        work_dir=work_dir,
        resume=resume,
        storage_options=storage_options,
    )


def kill_inside_upload(name: str) -> None:
    """Die in the upload of ``name``: after its first part, before its second."""
    import s3fs

    import ftrain.persist.store as store

    store.PART_SIZE = 5 * 2**20  # S3's smallest part
    real = s3fs.S3FileSystem._call_s3

    async def call(self, method, *args, **kwargs):
        if method == "upload_part" and kwargs["Key"].endswith(name) and kwargs["PartNumber"] > 1:
            os._exit(KILLED)
        return await real(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = call


def hold(events):
    for ev in events:
        yield ev
        if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == 4:
            ev.loop.checkpointer.wait()  # iter_4 is in the store
            print("HOLDING", flush=True)
            sys.stdin.readline()  # until the test kills this process


def main(endpoint: str, url: str, mode: str) -> None:
    torch.set_num_threads(1)
    hooks = []
    if mode.startswith("kill:"):
        kill_inside_upload(mode[len("kill:") :])
    elif mode == "hold":
        hooks = [ftrain.hook(hold, priority="LOWEST")]
    build(url, options(endpoint), hooks=hooks).run()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
