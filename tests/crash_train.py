"""A small training run used by the crash test: ``python crash_train.py WORK_DIR``.

Deterministic; resumes with ``resume="auto"``; prints READY once imports are
done and DONE at the end; writes the final parameters to ``WORK_DIR/final.pt``.
"""

import sys

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain


def main(work_dir: str) -> None:
    torch.set_num_threads(1)
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

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    step = ftrain.with_clip(
        ftrain.with_grad_accum(ftrain.make_step(loss_fn), every=2), max_norm=1.0
    )
    hooks = [ftrain.CheckpointHook(interval=1, max_keep=2), ftrain.AutoCheckpointHook()]
    print("READY", flush=True)
    lp = ftrain.Loop(
        step,
        ftrain.TrainState.create(model, opt),
        loader,
        hooks=hooks,
        epochs=8,
        work_dir=work_dir,
        resume="auto",
    )
    state = lp.run()
    torch.save([p.detach() for p in state.model.parameters()], f"{work_dir}/final.pt")
    print("DONE", state.step, state.micro_step, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
