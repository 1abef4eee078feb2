"""ProfilerHook: real torch.profiler traces over a window of updates, one file per rank."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
from ftrain.hooks.profiler import ProfilerHook

TESTS = Path(__file__).parent


def new_state():
    model = make_model(0)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))


def load_trace(path: Path) -> dict:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return json.loads(raw)


def profiler_steps(trace: dict) -> list[int]:
    """The ``ProfilerStep#n`` spans of a Chrome trace (one per traced update)."""
    names = {e.get("name", "") for e in trace["traceEvents"]}
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"ProfilerStep#(\d+)", n)))


def test_trace_of_the_chosen_updates_is_a_chrome_trace(tmp_path):
    seen = []

    def watch(events):
        for ev in events:
            if type(ev) is ftrain.events.StepEnd and ev.is_update:
                seen.append(ev.state.step)
            yield ev

    # window from update 3: wait 1 (update 3), warmup 1 (4), active 2 (5, 6)
    prof = ProfilerHook(start=3, wait=1, warmup=1, active=2)
    hooks = [prof, ftrain.hook(watch, priority="LOWEST")]
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(10), hooks, work_dir=tmp_path
    ).run()
    files = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert files == prof.traces and len(files) == 1
    assert files[0].name.startswith("rank0_")
    trace = load_trace(files[0])
    # Chrome trace format (what Perfetto and TensorBoard's profiler plugin read)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    events = trace["traceEvents"]
    assert all({"ph", "name"} <= set(e) for e in events if e.get("ph") == "X")
    steps = profiler_steps(trace)
    assert len(steps) == 2  # the two active updates
    names = {e.get("name") for e in events}
    assert "aten::addmm" in names or "aten::linear" in names  # the model ran inside
    assert seen == list(range(1, 11))


def test_the_hook_asks_for_no_event_outside_its_window():
    # the update before the window (2), then its 4 schedule steps (3..6); none after
    assert ProfilerHook(start=3, wait=1, warmup=1, active=2).cadence == ftrain.Every(at=range(2, 7))
    assert ProfilerHook(active=2).cadence == ftrain.Every(at=range(1, 5))
    assert ProfilerHook(start=5, repeat=0).cadence == ftrain.Every(steps=1)  # until the end


def test_repeat_writes_one_trace_per_cycle_and_gzip(tmp_path):
    prof = ProfilerHook(start=1, wait=0, warmup=1, active=1, repeat=2, use_gzip=True)
    ftrain.Loop(
        ftrain.make_step(mse_loss), new_state(), make_batches(8), [prof], work_dir=tmp_path
    ).run()
    files = sorted((tmp_path / "profile").glob("*.pt.trace.json.gz"))
    assert len(files) == 2 and len(prof.traces) == 2
    for f in files:
        assert len(profiler_steps(load_trace(f))) == 1


def test_the_cycle_note_is_silenced_without_a_process_wide_filter(tmp_path):
    import warnings

    import torch.profiler.profiler as tprof

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inside = list(warnings.filters)
        for run in range(2):
            getattr(tprof, "_WARNINGS_SHOWN", set()).clear()  # torch warns once per process
            prof = ProfilerHook(start=1, wait=0, warmup=1, active=1, repeat=2)
            ftrain.Loop(
                ftrain.make_step(mse_loss),
                new_state(),
                make_batches(6),
                [prof],
                work_dir=tmp_path / str(run),
            ).run()
            assert len(prof.traces) == 2
            assert warnings.filters == inside  # nothing added by a run
    assert not [w for w in seen if "clears events" in str(w.message)]
    assert warnings.filters == before


def test_a_run_resumed_past_the_window_does_not_profile(tmp_path):
    step = ftrain.make_step(mse_loss)
    ftrain.Loop(
        step, new_state(), make_batches(6), [ftrain.CheckpointHook(6)], work_dir=tmp_path
    ).run()
    prof = ProfilerHook(start=1, active=1)
    ftrain.Loop(
        step, new_state(), make_batches(6), [prof], epochs=2, work_dir=tmp_path, resume="auto"
    ).run()
    assert prof.traces == [] and not (tmp_path / "profile").exists()


def test_profiler_arguments_are_checked():
    with pytest.raises(ValueError, match="active"):
        ProfilerHook(active=0)
    with pytest.raises(ValueError, match="start"):
        ProfilerHook(start=0)
    with pytest.raises(ValueError, match="out_dir="):
        ftrain.Loop(
            ftrain.make_step(mse_loss), new_state(), make_batches(2), [ProfilerHook()]
        ).run()


@pytest.mark.dist
def test_each_rank_writes_its_own_trace(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(TESTS / "dist_watch_worker.py"),
        "profile",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    files = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert sorted(f.name.split("_")[0] for f in files) == ["rank0", "rank1"]
    for rank in (0, 1):
        listed = json.loads((tmp_path / f"profile_rank{rank}.json").read_text())["traces"]
        assert [Path(p).name for p in listed] == [
            f.name for f in files if f.name.startswith(f"rank{rank}_")
        ]
    for f in files:
        trace = load_trace(f)
        assert len(profiler_steps(trace)) == 2
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("allreduce" in n.lower() for n in names), "DDP's all-reduce is in the trace"
    # the logged throughput is the job's: both ranks' samples (rank 0 writes)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8]
    for r in records:
        assert r["perf/samples_per_s"] > 0
