"""Small models and data shared by the tests."""

import orjson
import torch


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4, dropout: float = 0.0):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def mse_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make_batches(n: int, batch_size: int = 8, d_in: int = 8, d_out: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, d_in, generator=g), torch.randn(batch_size, d_out, generator=g))
        for _ in range(n)
    ]


def make_model(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


def plain_losses(batches, epochs=1, seed=0, lr=0.1):
    """The per-step losses of the same run in a plain PyTorch loop (SGD, MSE)."""
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(epochs):
        for batch in batches:
            opt.zero_grad()
            loss = mse_loss(model, batch)
            loss.backward()
            opt.step()
            out.append(loss.item())
    return out


def read_jsonl(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def mean(xs):
    return sum(xs) / len(xs)
