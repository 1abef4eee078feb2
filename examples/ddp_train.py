"""Data-parallel training with ftrain under torchrun (DDP or FSDP2).

Launch (CPU with gloo, or one GPU per process with NCCL)::

    torchrun --nproc-per-node 2 examples/ddp_train.py --strategy ddp --work-dir runs/ddp
    torchrun --nproc-per-node 2 examples/ddp_train.py --strategy fsdp2 --work-dir runs/fsdp2

Run it again with the same ``--work-dir`` to resume from the newest checkpoint
(also after a crash, Ctrl-C or preemption). Without torchrun
(``python examples/ddp_train.py``) it trains in one process.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrain
from ftrain import dist


class Net(torch.nn.Module):
    """A small MLP with BatchNorm (kept in sync across ranks by SyncBuffersHook)."""

    def __init__(self, d_in: int = 32, d_hidden: int = 128, n_classes: int = 10) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(
                    torch.nn.Linear(d_in if i == 0 else d_hidden, d_hidden),
                    torch.nn.BatchNorm1d(d_hidden),
                    torch.nn.ReLU(),
                    torch.nn.Dropout(0.1),
                )
                for i in range(3)
            ]
        )
        self.head = torch.nn.Linear(d_hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_loss(device: torch.device):
    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        x, y = (t.to(device, non_blocking=True) for t in batch)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return loss, {"acc": (logits.argmax(-1) == y).float().mean()}

    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--work-dir", default="runs/ddp_example")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per update")
    args = parser.parse_args()

    info = dist.init()  # reads RANK, WORLD_SIZE, LOCAL_RANK; NCCL on CUDA, gloo on CPU
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    # FSDP2 shards each of model.blocks, then the root; on GPUs it gathers and computes in bf16
    bf16 = info.device.type == "cuda"
    mixed = "bf16" if bf16 and args.strategy == "fsdp2" else None
    model = dist.wrap(Net(), args.strategy, mixed_precision=mixed)
    torch.manual_seed(1 + info.rank)  # each rank its own dropout masks (saved per rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrap
    state = ftrain.TrainState.create(model, optimizer)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    dataset = TensorDataset(x, (x[:, :10].argmax(-1) + (x[:, 10] > 1).long()) % 10)
    sampler = DistributedSampler(  # each rank its share; also works without torchrun
        dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=0
    )
    loader = StatefulDataLoader(  # its position is saved per rank in the checkpoints
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(0),  # keeps the global RNG out of the loader
    )

    step = ftrain.make_step(make_loss(info.device))
    step = ftrain.with_grad_accum(step, every=args.accum)  # DDP: one all-reduce per update
    step = ftrain.with_clip(step, "norm", max_norm=1.0)  # the global norm, also for FSDP2
    if bf16:
        step = ftrain.with_amp(step, "bf16")

    hooks = ftrain.default_hooks(log_every=20, checkpoint_every=50, max_keep=2)
    hooks.append(dist.SyncBuffersHook())  # BatchNorm statistics: the mean over ranks
    state = ftrain.Loop(
        step, state, loader, hooks=hooks, epochs=args.epochs, work_dir=args.work_dir, resume="auto"
    ).run()
    if dist.is_main():
        print(f"done: {state.step} updates on {info.world_size} process(es), {info.device}")
    dist.shutdown()


if __name__ == "__main__":
    main()
