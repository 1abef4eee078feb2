"""CUDA generator states in checkpoints, on a real GPU (skipped without CUDA; issue 12, item 7)."""

import pytest
import torch

import ftrain
from ftrain.persist.rng import capture_rng, restore_rng

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_rng_round_trips_on_every_visible_device():
    torch.cuda.init()
    saved = capture_rng()
    assert len(saved["cuda"]) == torch.cuda.device_count()
    want = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    restore_rng(saved)
    got = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_a_ranks_cuda_state_goes_to_its_local_rank_device():
    torch.cuda.init()
    torch.cuda.manual_seed(3)
    state = torch.cuda.get_rng_state(0)
    want = torch.rand(4, device="cuda:0")
    torch.cuda.manual_seed_all(99)
    restore_rng({"cuda_device": {"index": 0, "state": state}}, local_rank=0)
    assert torch.equal(torch.rand(4, device="cuda:0"), want)


def test_resume_on_gpu_is_exact_with_dropout(tmp_path):
    def run(work_dir, steps, resume=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
        ).cuda()
        state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 8, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda())
                for _ in range(6)]  # fmt: skip

        def loss(m, b):
            return torch.nn.functional.mse_loss(m(b[0]), b[1])

        return ftrain.Loop(ftrain.make_step(loss), state, data, [ftrain.CheckpointHook(3)],
                          work_dir=work_dir, resume=resume, max_steps=steps).run()  # fmt: skip

    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "b", 6, resume="auto")
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
