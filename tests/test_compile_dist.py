"""``with_compile`` under DDP and FSDP2 on 2 CPU processes (gloo), launched by torchrun.

Each test launches ``tests/compile_dist_worker.py`` (as ``tests/test_dist.py::launch`` does
its worker): both ranks train the same wrapped transformer eagerly and compiled (inductor)
for 20 updates of 2 micro-batches, with accumulation, clipping, the non-finite check and a
learning-rate schedule. Compiled means: the model's blocks (DDP: the wrapped module; FSDP2:
each ``fully_shard`` unit) and the update, with no graph break and no eager fallback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
WORKER = TESTS / "compile_dist_worker.py"


def launch(scenario: str, out: Path, *args: str, nproc: int = 2, timeout: float = 900) -> None:
    """Run a worker scenario under torchrun; fail with its output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), scenario, str(out), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun {scenario} {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_compiled_step_under_data_parallel_equals_eager(tmp_path, strategy):
    launch("compiled", tmp_path, strategy, "inductor")
    ranks = [
        json.loads((tmp_path / f"compiled_{strategy}_inductor_rank{r}.json").read_text())
        for r in range(2)
    ]
    for r in ranks:
        assert r["strategy"] == strategy and r["updates"] == 20
        # compiled, all of it: no eager fallback, no graph break, no recompile
        assert r["fallbacks"] == [] and r["graph_breaks"] == 0, r
        assert r["recompiles"] == 0
        # the blocks' forward (one graph for every block), clipping, the optimizer's rule (its
        # first update creates the momentum buffers: a second graph)
        assert r["graphs"] == 4, r
        # equal to eager: every loss and gradient norm, and the weights after 20 updates
        assert set(r["metrics_diff"]) == {"loss", "grad_norm", "skipped"}
        assert max(r["metrics_diff"].values()) < 1e-5, r["metrics_diff"]
        assert r["weights_diff"] < 1e-5 and r["weights_moved"] > 0.1, r
