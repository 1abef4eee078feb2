import os

import pytest
import torch

torch.set_num_threads(1)  # deterministic, and kind to a 2-core CI machine
os.environ.setdefault("TQDM_DISABLE", "1")


@pytest.fixture
def batches():
    from helpers import make_batches

    return make_batches(12)
