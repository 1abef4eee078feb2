"""torch.distributed: DDP and FSDP2 on 2 CPU processes (gloo), launched by torchrun.

Each ``dist`` test launches ``tests/dist_worker.py`` with
``torchrun --standalone --nproc-per-node 2`` (a free port each time); the
workers assert inside and write their results for the checks here.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_batches, make_model, mse_loss

import ftrain
import ftrain.checkpoint
from ftrain import dist
from ftrain._slurm import SLURM_PORT_BASE

TESTS = Path(__file__).parent
WORKER = TESTS / "dist_worker.py"


def launch(
    scenario: str,
    out: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 180,
    fails: bool = False,
) -> float:
    """Run a worker scenario under torchrun; fail with its output if it fails (or not)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        scenario,
        str(out),
        *args,
    ]
    # gloo on the CPU even on a GPU machine (the NCCL checks are tests/gpu's)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=timeout)
    if fails:
        assert proc.returncode != 0, proc.stdout[-3000:]
    elif proc.returncode != 0:
        pytest.fail(
            f"torchrun {scenario} {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return time.perf_counter() - start


def result(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------ single process
def test_single_process_is_a_no_op():
    info = dist.init()
    assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
    assert not dist.is_distributed() and dist.is_main() and dist.world_size() == 1
    model = make_model(0)
    assert dist.wrap(model, "ddp") is model and dist.wrap(model, "fsdp2") is model
    assert dist.strategy(model) is None and dist.unwrap(model) is model
    assert dist.reduce_metrics({"loss": torch.tensor(2.0), "x": "text"}) == {"loss": 2.0}
    dist.barrier()
    dist.sync_buffers(model)
    dist.sync_pending_grads(model)
    assert dist.broadcast_object([1, 2]) == [1, 2]
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = ftrain.Loop(
        ftrain.make_step(mse_loss), state, make_batches(2), hooks=[dist.SyncBuffersHook()]
    ).run()
    assert state.step == 2
    with pytest.raises(ValueError, match="strategy"):
        dist.wrap(model, "fsdp")
    with pytest.raises(ValueError, match="op must be"):
        dist.reduce_metrics({}, "median")


def test_checkpoints_of_one_process_record_world_size(tmp_path):
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    lp = ftrain.Loop(ftrain.make_step(mse_loss), state, make_batches(2), hooks=[])
    lp.run()
    ckpt = lp.checkpoint()
    assert ckpt["dist"] == {"world_size": 1, "strategy": None}
    assert "ranks" not in ckpt
    assert (
        ftrain.persist.checkpointer.sharded_name("iter_4.pth") == "iter_4.dcp"
    )  # moved out of dist


def test_dist_doctests():
    failures, _ = doctest.testmod(dist, optionflags=doctest.ELLIPSIS)
    assert failures == 0


# -------------------------------------------------------------- 2 processes
@pytest.mark.dist
def test_init_reduce_metrics_and_sync_buffers(tmp_path):
    launch("basics", tmp_path)
    for rank in (0, 1):
        res = result(tmp_path, "basics", rank)
        # mean over ranks; "skipped" summed; a name only rank 0 has; tensors of 3 left out
        assert res["reduced"] == {"loss": 1.5, "acc": 0.25, "skipped": 1.0, "only0": 7.0}
        assert res["maxed"] == {"loss": 2.0}
        assert res["buffers_differed"] > 0.1  # broadcast_buffers=False: BN stats drift apart
        assert res["buffers_after_diff"] == 0.0  # ... until SyncBuffersHook at the epoch end
        assert res["buffers_vs_mean"] < 1e-6  # the mean of the ranks' statistics
        assert res["counter"] == 3

    # LoggerHook: the logged numbers are the means over the ranks (loss 1 + 99 * rank,
    # evaluation 10 * rank), logged at the same events on every rank; only rank 0 writes
    records = [json.loads(line) for line in (tmp_path / "logged" / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val/score" in r]
    assert [r["step"] for r in train] == [2, 3, 4, 6] and [r["step"] for r in evals] == [3, 6]
    assert all(r["loss"] == 50.5 and r["rank"] == 0.5 and r["lr"] == 0.0 for r in train)
    assert all(r["val/score"] == 5.0 for r in evals)
    assert result(tmp_path, "basics", 0)["logged"]  # the audit saw rank 0's writes
    assert result(tmp_path, "basics", 1)["logged"] == []


@pytest.mark.dist
def test_ddp_equals_single_process_on_the_combined_batch(tmp_path):
    launch("ddp_vs_single", tmp_path)
    for rank in (0, 1):
        res = result(tmp_path, "ddp_vs_single", rank)
        assert res["moved"] > 1e-3
        assert res["max_diff"] < 1e-6
        # with_clip saw the global gradient norm (DDP all-reduces first)
        assert res["grad_norms"] == pytest.approx(res["ref_grad_norms"], rel=1e-6)


@pytest.mark.dist
def test_accumulation_skips_the_all_reduce_between_boundaries(tmp_path):
    launch("nosync", tmp_path)
    res = result(tmp_path, "nosync")
    # 2 epochs of 7 micro-batches, every=3: 2 synchronising backwards per epoch (the
    # partial window of 1 is reduced once, by hand, before its flush) vs 7 without no_sync
    assert res["allreduces_with_no_sync"] == 4
    assert res["allreduces_without"] == 14
    assert res["diff_vs_without"] < 1e-6
    assert res["diff_vs_single"] < 1e-6


@pytest.mark.dist
def test_fsdp2_matches_ddp(tmp_path):
    launch("fsdp2_vs_ddp", tmp_path)
    for rank in (0, 1):
        res = result(tmp_path, "fsdp2_vs_ddp", rank)
        # accumulation (every=3, 7 micro-batches) reduce-scatters once per unit and window
        # (the partial window's by hand, before its flush), not once per micro-batch
        rs = res.pop("reduce_scatters")
        assert rs["units"] == 2
        assert rs["with_skip"] == 3 * rs["units"] and rs["without_skip"] == 7 * rs["units"]
        assert rs["diff"] < 1e-6
        for mode, r in res.items():
            assert r["moved"] > 1e-3, mode
            assert r["max_diff"] < 1e-6, mode
            # the clip norm over FSDP2's DTensor shards is the global one
            ddp = [n for n in r["ddp_norms"] if n is not None]
            fsdp2 = [n for n in r["fsdp2_norms"] if n is not None]
            assert len(ddp) == 3 and fsdp2 == pytest.approx(ddp, rel=1e-6), mode


@pytest.mark.dist
def test_activation_checkpoint_plans_use_the_users_names_under_ddp_and_fsdp2(tmp_path):
    launch("checkpoint_plans", tmp_path)
    for rank in (0, 1):
        res = result(tmp_path, "checkpoint_plans", rank)
        for strategy in ("ddp", "fsdp2"):
            for plan in ("names", "pattern", "dynamic"):
                r = res[f"{strategy}/{plan}"]
                where = (rank, strategy, plan)
                # trains as the same wrapper without checkpointing (dropout masks replayed)
                assert r["moved"] > 1e-3 and r["diff"] < 1e-6, where
                # the names one process resolves: plan state resumes anywhere
                assert r["modules"] == r["single_process_modules"], where
                assert all(b is not None and b > 0 for b in r["activation_bytes"]), where
            assert res[f"{strategy}/names"]["modules"] == ["blocks.0"]
            assert res[f"{strategy}/pattern"]["checkpointed"] == [3] * 4
            dyn = res[f"{strategy}/dynamic"]
            assert dyn["fitted"] and dyn["checkpointed"] == [3, 2, 2, 2]  # warm-up, then planned
            # the accountant on the wrapper (FSDP2: gathered weights are not activations)
            measured, plain = res[f"{strategy}/measured"]
            assert measured == plain
        # monitored bytes are the same under both wrappers
        for plan in ("names", "pattern", "dynamic"):
            assert (
                res[f"fsdp2/{plan}"]["activation_bytes"] == res[f"ddp/{plan}"]["activation_bytes"]
            )


@pytest.mark.dist
def test_amp_overflow_on_one_rank_is_skipped_by_every_rank(tmp_path):
    launch("amp_skip", tmp_path)
    r0, r1 = result(tmp_path, "amp_skip", 0), result(tmp_path, "amp_skip", 1)
    for strategy in ("ddp", "fsdp2"):
        for res in (r0, r1):
            assert res[strategy]["skipped"] == [False, True, False, False], strategy
            assert res[strategy]["unchanged"] == [False, True, False, False], strategy
            assert res[strategy]["scales"] == [256.0, 128.0, 128.0, 128.0], strategy
        assert r0[strategy]["params"] == r1[strategy]["params"]
    # rank 0's shard of the gradient was finite, yet its scaler found the overflow
    assert r0["shard"] == {"local_finite": True, "found_inf": 1.0}
    assert r1["shard"]["found_inf"] == 1.0


def _changes(res: dict) -> list[tuple[str, str]]:
    return [tuple(c) for c in res["changes"]]


@pytest.mark.dist
def test_ddp_kill_and_resume_is_exact_and_only_rank_0_writes(tmp_path):
    t1 = launch("resume", tmp_path, "ddp", "straight+crash")
    runs = tmp_path / "runs"
    assert result(tmp_path, "resume_ddp_straight+crash")["stopped"] == "stop at micro-step 8"
    # stopped mid accumulation window (8 = 2*3 + 2): each rank wrote its own gradients, RNG
    # and data position to a file of its own (issue 12: no tensor through gather_object)
    saved = torch.load(runs / "crash" / "interrupted.pth", weights_only=False)
    assert saved["dist"] == {"world_size": 2, "strategy": "ddp"}
    assert "ranks" not in saved and saved["rank_files"] == 2 and not saved["state"]["grads"]
    assert all(not k.startswith("module.") for k in saved["state"]["model"])
    parts = [
        torch.load(runs / "crash" / f"interrupted.pth.rank{r}", weights_only=False) for r in (0, 1)
    ]
    assert all(p["grads"] for p in parts) and all(p["data"] for p in parts)
    assert not torch.equal(parts[0]["rng"]["torch"], parts[1]["rng"]["torch"])
    t2 = launch("resume", tmp_path, "ddp", "resume")
    res = result(tmp_path, "resume_ddp_resume")
    assert res["resumed_from"].endswith("interrupted.pth") and res["resumed_steps"] == [6, 18]
    for rank in (0, 1):
        straight = load_params(tmp_path / f"straight_rank{rank}.pt")
        assert_bitwise(straight, load_params(tmp_path / f"resumed_rank{rank}.pt"))
        assert result(tmp_path, "resume_ddp_resume", rank)["object_collectives"] > 0

    # rank 0 wrote logs, checkpoints and the manifest; rank 1 only its own per-rank files
    for phase in ("straight+crash", "resume"):
        for event, path in _changes(result(tmp_path, f"resume_ddp_{phase}", 1)):
            assert event == "os.mkdir" or ".rank1" in Path(path).name, (event, path)
        assert _changes(result(tmp_path, f"resume_ddp_{phase}", 0))
    for run in ("straight", "crash"):
        names = sorted(p.name for p in (runs / run).iterdir())
        assert names == [
            "iter_5.pth", "iter_5.pth.rank0", "iter_5.pth.rank1",
            "iter_6.pth", "iter_6.pth.rank0", "iter_6.pth.rank1",
            "manifest.json", "metrics.jsonl", "tb",
        ]  # fmt: skip
    print(f"\nDDP straight+crash {t1:.1f} s, resume {t2:.1f} s")

    # a 2-process DDP checkpoint resumes into one process and an unwrapped model
    model = make_model(0, dropout=0.2)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    lp = ftrain.Loop(step, state, [], hooks=[], work_dir=runs / "straight", resume="auto")
    with pytest.warns(UserWarning, match="written by 2 process"):
        state = lp.run()
    assert state.step == 6
    assert_bitwise(
        load_params(tmp_path / "straight_rank0.pt"),
        {k: v.detach() for k, v in state.model.named_parameters()},
    )


@pytest.mark.dist
def test_fsdp2_sharded_checkpoint_resume_and_reshard(tmp_path):
    launch("resume", tmp_path, "fsdp2", "straight+crash")
    runs = tmp_path / "runs"
    interrupted = runs / "crash" / "interrupted.dcp"
    assert interrupted.is_dir() and (interrupted / ".metadata").is_file()
    assert sorted(p.name for p in interrupted.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    launch("resume", tmp_path, "fsdp2", "resume")
    res = result(tmp_path, "resume_fsdp2_resume")
    assert res["resumed_from"].endswith("interrupted.dcp") and res["resumed_steps"] == [6, 18]
    for rank in (0, 1):  # same world size: exact
        straight = load_params(tmp_path / f"straight_rank{rank}.pt")
        assert_bitwise(straight, load_params(tmp_path / f"resumed_rank{rank}.pt"))

    # rank 1 wrote only its own shards, inside the temporary directory rank 0 renamed
    for phase in ("straight+crash", "resume"):
        for event, path in _changes(result(tmp_path, f"resume_fsdp2_{phase}", 1)):
            parts = Path(path).parts
            assert len(parts) >= 2 and ".tmp-" in parts[1], (event, path)
            assert event == "os.mkdir" or parts[-1].startswith("__1_") or "rank1.pth" in parts[-1]
    names = sorted(p.name for p in (runs / "crash").iterdir())
    assert names == ["iter_5.dcp", "iter_6.dcp", "manifest.json", "metrics.jsonl", "tb"]

    # another world size: 1 process with FSDP2 (DCP reshards) ...
    launch("reshard", tmp_path, str(runs / "straight" / "iter_6.dcp"), nproc=1)
    res = result(tmp_path, "reshard")
    assert res["world_size"] == 1 and res["step"] == 6 and res["warned"]
    assert res["model_diff"] == 0.0 and res["optim_diff"] == 0.0 and res["optim_names"]

    # ... and a plain model in this process, without torch.distributed
    full = torch.load(tmp_path / "straight_full.pt", weights_only=False)
    model = make_model(0, dropout=0.2)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = ftrain.with_grad_accum(ftrain.make_step(mse_loss), every=3)
    lp = ftrain.Loop(step, state, [], hooks=[], work_dir=runs / "straight", resume="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = lp.run()
    assert lp.resumed_from.name == "iter_6.dcp" and state.step == 6
    for name, p in state.model.named_parameters():
        assert torch.equal(p.detach(), full["model"][name]), name
    fresh = make_model(5)  # weights only (fine-tuning) from the shards
    assert ftrain.checkpoint.load_weights(fresh, runs / "straight" / "iter_6.dcp") == ([], [])
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), full["model"][name]), name
    opt_state = state.optimizer.state_dict()["state"]
    for i, (name, _) in enumerate(state.model.named_parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_state[i][key], full["optimizer"]["state"][name][key])


@pytest.mark.dist
def test_a_rank_failing_alone_does_not_hang_the_interrupt_checkpoint(tmp_path):
    launch("lonely", tmp_path, fails=True, timeout=120)
    res = result(tmp_path, "lonely")
    assert res["error"] == "rank 0 alone"
    assert any("not every rank was interrupted" in w for w in res["warnings"])
    assert not (tmp_path / "run" / "interrupted.pth").exists()
    # no wall-clock bound (machine speed): a hang would pass launch's 120 s timeout, and the
    # warning above shows the ranks gave up on the 2 s agreement instead of waiting


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_run_protocol_on_two_ranks(tmp_path, strategy):
    # issue 12: a fresh run is refused on every rank; with the manifest deleted and rank 1's
    # part of the newest checkpoint truncated, every rank resumes the previous one, exactly
    launch("persist", tmp_path, strategy)
    for rank in (0, 1):
        res = result(tmp_path, f"persist_{strategy}", rank)
        assert "another run" in res["refused"] and "resume='auto'" in res["refused"]
        assert res["resumed_from"] == "iter_4" + res["suffix"], res
        assert res["step"] == 12 and res["diff"] == 0.0
    warned = result(tmp_path, f"persist_{strategy}", 0)["warnings"]
    assert any("manifest.json is missing: rebuilt" in w for w in warned), warned


# ------------------------------------------------------------ ranks agree (issue 13)
@pytest.mark.dist
def test_ranks_agree_on_every_decision_and_sharded_models_work_everywhere(tmp_path):
    launch("agree", tmp_path)
    r0, r1 = result(tmp_path, "agree", 0), result(tmp_path, "agree", 1)
    for res in (r0, r1):
        # a NaN loss or an infinite gradient (sqrt at 0, finite loss) on rank 1 only:
        # every rank skips the update (with and without with_clip's norm), replicas equal
        for strategy in ("ddp", "fsdp2"):
            for kind in ("nan", "inf_grad"):
                for clip in ("", "/clip"):
                    r = res[f"skip/{strategy}/{kind}{clip}"]
                    where = (strategy, kind, clip)
                    assert r["skipped"] == [False, True, False], where
                    assert r["count"] == 1 and r["finite"], where
                    assert r["vs_ref"] < 1e-6, where  # = one process skipping that batch
                    assert r["local"][0] == r["local"][1], where
                    # the flag rides on the gradient's own collective (DDP's all-reduce,
                    # clipping's norm); FSDP2 without clipping: one small all-reduce per update
                    folded = strategy == "ddp" or clip
                    assert r["flag_all_reduces"] == (0 if folded else 3), where
            # "raise" raises on every rank, naming the rank that saw it; err.state goes on
            r = res[f"raise/{strategy}"]
            assert r["message"] is not None and "rank(s) [1]" in r["message"], strategy
            assert r["vs_ref"] < 1e-6, strategy
        # evaluation metrics are reduced first: early stopping and "best" agree
        ev = res["eval"]
        assert ev["metrics"] == {"val_loss": 2.5}  # epoch 3: the mean of 1.0 and 4.0
        assert ev["epochs"] == 3 and ev["best"] == 1.5 and ev["early_best"] == 1.5
        # a summed loss over unequal micro-batches and ranks = the full batch's token mean
        tok = res["tokens"]
        assert tok["vs_ref"] < 1e-6 and tok["naive_vs_ref"] > 1e-3
        # a plain model under the group trains on its own: = a one-process loop on this
        # rank's data (no division by the world size, no collective, rank 1's NaN is its own)
        ind = res["independent"]
        assert ind["vs_ref"] < 1e-6 and ind["collectives"] == 0
    assert r0["independent"]["skipped"] == [False, False, False]
    assert r1["independent"]["skipped"] == [False, True, False]
    for res in (r0, r1):
        # EMA and clone under DDP and FSDP2 = one process; the FSDP2 average stays sharded
        for strategy in ("ddp", "fsdp2"):
            e = res[f"ema/{strategy}"]
            assert e["params_vs_single"] < 1e-5, strategy
            assert e["clone_vs_original"] == 0.0, strategy  # partial window carried over
            assert e["ema_vs_single"] < 1e-5 and e["swapped_vs_single"] < 1e-5, strategy
            assert e["after_vs_single"] < 1e-5 and e["swap_changed"] > 1e-3, strategy
            assert e["clone_strategy"] == strategy
        assert res["ema/fsdp2"]["sharded"]
        # ... and its checkpoint holds every rank's part: the resumed average is exact
        assert res["ema_resume"] == {"updates": [6, 6], "diff": 0.0}
        # meta-device FSDP2: only this rank's shards exist, initialised, and train
        meta = res["meta"]
        assert meta["local"] * 2 == meta["total"] and meta["device"] == "cpu"
        assert meta["finite"] and meta["nonzero"] and meta["loss"] > 0
        assert meta["moved_whole"] == []  # fully_shard moves unit by unit, not model.to()
    logged = r0["tokens"]["logged"]
    assert logged == pytest.approx(r0["tokens"]["ref_losses"], rel=1e-5)
    assert r1["tokens"]["logged"] == []


def _env_without_launcher() -> dict[str, str]:
    """This environment without any launcher's (torchrun, Slurm) rank variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))
        and k not in ("GROUP_RANK", "ROLE_RANK")
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_srun_launch_is_detected_from_slurm_variables_only(tmp_path):
    """Two tasks as srun starts them: no RANK/WORLD_SIZE/MASTER_*, only SLURM_*."""
    port = _free_port()
    while port < SLURM_PORT_BASE or port >= SLURM_PORT_BASE + 20000:
        port = _free_port()
    base = _env_without_launcher()
    procs = []
    for rank in (0, 1):
        env = {
            **base,
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NODELIST": "localhost",
            "SLURM_JOB_ID": str(port - SLURM_PORT_BASE + 20000 * 7),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "slurm", str(tmp_path)],
                cwd=TESTS,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for rank in (0, 1):
        res = result(tmp_path, "slurm", rank)
        assert (res["rank"], res["world_size"], res["local_rank"]) == (rank, 2, rank)
        assert res["sum"] == 3.0 and res["master"] == "localhost" and res["port"] == str(port)


# ------------------------------------------------------ per-rank checkpoint state
@pytest.fixture(scope="module")
def ranklocal(tmp_path_factory):
    """One 2-process run of the ``ranklocal`` scenario for the tests below."""
    out = tmp_path_factory.mktemp("ranklocal")
    launch("ranklocal", out, timeout=300)
    return out, [result(out, "ranklocal", rank) for rank in (0, 1)]


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resumed_logs_and_plain_iterable_batches_are_each_ranks_own(ranklocal, strategy):
    # each rank keeps its own logger window (metric sums, reduced at log time) and its own
    # epoch-start RNG (a plain iterable's order is replayed from it): both are saved per
    # rank, so stopping at update 3 and resuming from iter_2 (mid epoch) changes nothing
    out, ranklocal = ranklocal
    for rank, res in enumerate(ranklocal):
        r = res[f"resume/{strategy}"]
        assert r["diff"] == 0.0, rank
        assert r["resumed_steps"] == list(range(3, 11)), rank
        assert r["resumed_batches"] == r["straight_batches"][2:], rank
        # a hook's local_state_keys: each rank gets its own value back, the rest is shared
        assert r["note"] == {"mine": f"rank {rank}", "shared": "same"}, rank
    r0, r1 = (res[f"resume/{strategy}"] for res in ranklocal)
    assert r0["straight_batches"] != r1["straight_batches"]  # the ranks' data differ
    assert [step for step, _ in r0["straight_lines"]] == [4, 5, 8, 10]  # and epoch ends
    assert r0["resumed_lines"] == r0["straight_lines"]  # the step-4 line too

    # on disk: the shared part holds neither; each rank's own file holds its own
    run = out / f"ranklocal_{strategy}" / "straight"
    if strategy == "ddp":
        shared = torch.load(run / "iter_2.pth", weights_only=False)
        parts = [torch.load(run / f"iter_2.pth.rank{r}", weights_only=False) for r in (0, 1)]
    else:
        shared = torch.load(run / "iter_2.dcp" / "ftrain.pth", weights_only=False)
        parts = [
            torch.load(run / "iter_2.dcp" / f"rank{r}.pth", weights_only=False) for r in (0, 1)
        ]
    assert shared["loop"]["epoch_rng"] is None and shared["hooks"]["logger"]["window"] is None
    windows = [p["hooks"]["logger"]["window"] for p in parts]
    totals = [p["loop"]["totals"] for p in parts]  # the loop's sums, where the logger reads
    assert windows[0]["at"] == windows[1]["at"] == totals[0]["micro_batches"] == 2
    assert totals[0]["sums"]["loss"] != totals[1]["sums"]["loss"]  # each rank's own loss
    assert shared["loop"]["totals"] is None
    rngs = [p["loop"]["epoch_rng"]["torch"] for p in parts]
    assert not torch.equal(rngs[0], rngs[1])


@pytest.mark.dist
def test_a_failed_background_save_is_raised_on_every_rank_at_the_same_point(ranklocal):
    # rank 0's background write of iter_2 fails: rank 0 warns, and every rank raises the
    # CheckpointError together at the next save (update 4) or, when none follows, at the
    # end of the run, instead of rank 0 raising alone while rank 1 waits in an all-reduce
    _, ranklocal = ranklocal
    for key, at in (("ddp/6", 4), ("ddp/2", 2), ("fsdp2/6", 4)):
        for rank, res in enumerate(ranklocal):
            r = res[f"failed/{key}"]
            assert r["at"] == at, (key, rank, r)
            assert "injected write failure" in r["error"] and "rank 0" in r["error"], (key, r)
            assert bool(r["warned"]) == (rank == 0), (key, rank, r)


def _spawn(scenario: str, out: Path, *args: str) -> list[tuple[int, str]]:
    """2 ranks started directly (as srun starts tasks): each one's exit status and output."""
    port = _free_port()
    base = _env_without_launcher()
    procs = []
    for rank in (0, 1):
        env = {
            **base,
            "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(out), *args],
                cwd=TESTS,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180)[0] for p in procs]
    return [(p.returncode, o) for p, o in zip(procs, outs)]


@pytest.mark.dist
def test_a_signal_on_any_rank_stops_every_rank_at_the_same_update(tmp_path):
    """Preemption under DDP: SIGTERM to rank 1 only, SIGINT to rank 0 only, SIGTERM to the
    ranks at different updates. Every rank stops after the same update (the one after the
    first signal), one interrupted checkpoint is agreed and written, SIGTERM exits every
    process with PREEMPTED_EXIT_CODE, and resuming on 2 ranks ends bitwise as an
    uninterrupted run."""
    ran = _spawn("preempt", tmp_path, "signal")
    assert [code for code, _ in ran] == [ftrain.loop.PREEMPTED_EXIT_CODE] * 2, ran
    runs = {r: result(tmp_path, "preempt_signal", r) for r in (0, 1)}
    for name, raised, code in (
        ("one", "TerminatedError", ftrain.loop.PREEMPTED_EXIT_CODE),
        ("int", "InterruptedExit", 130),  # issue 21: a script's Ctrl-C exits 130, no traceback
    ):
        for r in (0, 1):
            res = runs[r][name]
            where = (name, r)
            assert (res["raised"], res["code"]) == (raised, code), where
            assert res["at"] == [res["expected"], 2 * res["expected"]], where
            assert not any("Not saving" in w for w in res["warnings"]), where
            assert res["diff"] == 0.0, where  # resumed on 2 ranks: bitwise the straight run
    first = runs[0]["both_first"]
    manifest = json.loads((tmp_path / "both" / "manifest.json").read_text())
    interrupted = [e["name"] for e in manifest["files"] if e.get("kind") == "interrupted"]
    assert interrupted == ["interrupted.pth"]
    saved = torch.load(tmp_path / "both" / "interrupted.pth", weights_only=False)
    # voting every few updates: a few updates after the first signal, the same on every
    # rank (AutoCheckpointHook saves only then), before the end of the run (12 updates)
    assert first < saved["state"]["step"] < 12 and saved["rank_files"] == 2
    for r in (0, 1):
        part = torch.load(tmp_path / "both" / f"interrupted.pth.rank{r}", weights_only=False)
        assert part["data"] is not None
    ran = _spawn("preempt", tmp_path, "resume")
    assert [code for code, _ in ran] == [0, 0], ran
    for r in (0, 1):
        assert result(tmp_path, "preempt_resume", r)["diff"] == 0.0
