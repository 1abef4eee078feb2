"""benchmarks/gpu_check.py's table and exit status, and gpu_check.sh without CUDA (issue 20.11).

The checks themselves need a GPU (tests/gpu and the script run them there); here the
driver runs fake checks, and the two checks that assert no timing run on the CPU at
tiny sizes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


gc_ = _driver()


def fake(key: str, ok: bool | None, needs: str = "") -> object:
    def fn(cfg):
        if ok is None:
            raise RuntimeError("the feature is not there")
        return gc_.Result(f"{key} measured", f"{key} target", ok)

    return gc_.Check(key, f"fake {key}", fn, needs=needs, cuda_only=False)


def table_rows(out: str) -> list[list[str]]:
    lines = [ln for ln in out.splitlines() if " | " in ln]
    return [[c.strip() for c in ln.split(" | ")] for ln in lines]


def test_all_met_exits_zero_with_one_row_per_check(capsys):
    checks = [fake("G1", True), fake("G2", True, needs="20.5 compile")]
    assert gc_.main(["--device", "cpu"], checks) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows[0] == ["check", "measured", "target", "verdict", "s"]
    assert [r[3] for r in rows[1:]] == ["PASS", "PASS"]
    assert rows[2][0] == "G2 fake G2 [needs 20.5 compile]"  # marked where it needs a feature
    assert rows[1][1:3] == ["G1 measured", "G1 target"]


@pytest.mark.parametrize("outcome", [False, None])  # a missed target; a check that raised
def test_a_miss_or_an_error_exits_non_zero(capsys, outcome):
    checks = [fake("G1", True), fake("G2", outcome), fake("G3", True)]
    assert gc_.main(["--device", "cpu"], checks) == 1
    rows = table_rows(capsys.readouterr().out)
    assert [r[3] for r in rows[1:]] == ["PASS", "FAIL", "PASS"]  # the others still ran
    if outcome is None:
        assert rows[2][1] == "error: RuntimeError: the feature is not there"


def test_only_runs_the_named_checks_and_rejects_unknown_ones(capsys):
    checks = [fake("G1", False), fake("G2", True)]
    assert gc_.main(["--device", "cpu", "--only", "G2"], checks) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows[1:]] == ["G2 fake G2"]
    assert gc_.main(["--device", "cpu", "--only", "G9"], checks) == 2
    assert "unknown check(s) ['G9']" in capsys.readouterr().err
    assert gc_.exit_status([]) == 1  # nothing ran: not a pass


def test_every_check_has_a_function_and_the_ten_are_there():
    assert [c.key for c in gc_.CHECKS] == [f"G{i}" for i in range(1, 11)]
    assert {c.key for c in gc_.CHECKS if c.needs} >= {"G5", "G8"}


def test_the_shell_script_fails_clearly_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable,
           "GPU_CHECK_OUT": str(tmp_path / "out")}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "gpu_check.sh: no CUDA device is visible" in proc.stderr
    assert not (tmp_path / "out").exists()  # stopped before running anything


def test_the_driver_refuses_cuda_without_a_gpu(capsys):
    assert gc_.main([], [fake("G1", True)]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_fp16_check_and_resume_run_on_the_cpu_at_tiny_sizes(capsys):
    """G3 (ftrain fp16 bitwise equal to a GradScaler loop, overflows forced) on the CPU; G6's
    resume (its timing verdict is not asserted here)."""
    status = gc_.main(["--device", "cpu", "--smoke", "--only", "G3", "G6"])
    rows = {r[0][:2]: r for r in table_rows(capsys.readouterr().out)[1:]}
    assert rows["G3"][3] == "PASS", rows["G3"]
    assert rows["G3"][1].startswith("max |diff| 0 over 30 updates; skipped 1 vs 1 (1 forced)")
    assert "resume bit-exact" in rows["G6"][1], rows["G6"]
    assert status in (0, 1)
