"""``python -m ftrain.bench``: the quick runs, their tables and JSON, the CLI's errors.

The two quick runs (``amp --quick`` and ``memory --quick``) start together as
subprocesses (one torch thread each) and are shared by the tests that read them. They run
with no time cap (``--max-seconds`` far beyond the run), so every variant trains and times
the same number of steps however busy the machine is: the tests check structure, step
counts and comparisons between equal step counts, never figures that depend on speed.
The capped path is checked on its own with a cap every step exceeds.
"""

from __future__ import annotations

import doctest
import importlib
import io
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from ftrain.bench.cli import main

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
MODELS = ("transformer", "convnet", "mlp")
TIMEOUT = 300
NO_CAP = ("--max-seconds", "1e9")  # no variant is cut short, however slow the machine


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftrain.bench", *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run ``amp --quick`` and ``memory --quick`` (with a plot) side by side."""
    tmp = tmp_path_factory.mktemp("bench")
    jobs = {
        "amp": _cmd(
            "amp", "--quick", *NO_CAP, "--json", str(tmp / "amp.json"), "--plot", str(tmp / "a.png")
        ),
        "memory": _cmd(
            "memory",
            "--quick",
            *NO_CAP,
            "--json",
            str(tmp / "memory.json"),
            "--plot",
            str(tmp / "m.png"),
        ),
    }
    procs = {
        name: subprocess.Popen(
            cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, cmd in jobs.items()
    }
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        out[name] = {
            "rc": proc.returncode,
            "stdout": stdout,
            "stderr": stderr,
            "json": tmp / f"{name}.json",
        }
    out["memory"]["plot"] = tmp / "m.png"
    out["amp"]["plot"] = tmp / "a.png"
    return out


def _ok(run: dict) -> dict:
    assert run["rc"] == 0, f"exit {run['rc']}\n{run['stdout'][-3000:]}\n{run['stderr'][-3000:]}"
    return orjson.loads(run["json"].read_bytes())


def _check_environment(data: dict, command: str) -> None:
    env = data["environment"]
    for key in ("torch", "device", "dtype", "threads", "python", "platform", "ftrain", "args"):
        assert key in env, key
    assert env["torch"] == torch.__version__
    assert env["threads"] == 1
    assert env["device"] in ("cpu", "cuda", "cuda:0")
    assert env["args"]["command"] == command and env["args"]["quick"] is True
    # TF32 / cuDNN settings that change GPU speed and rounding are recorded
    num = env["numerics"]
    assert num["cuda_matmul_allow_tf32"] == torch.backends.cuda.matmul.allow_tf32
    assert num["cudnn_allow_tf32"] == torch.backends.cudnn.allow_tf32
    assert num["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert data["benchmark"] == command


def _table_rows(stdout: str, model: str, variant: str) -> list[str]:
    """Table lines of ``model`` / ``variant`` (columns are 2+ spaces apart)."""
    pattern = re.compile(rf"{re.escape(model)}\s+{re.escape(variant)}\s{{2,}}\S")
    return [line for line in stdout.splitlines() if pattern.match(line)]


# ----------------------------------------------------------------------- amp
def test_amp_quick_table_and_json(runs):
    run = runs["amp"]
    data = _ok(run)
    _check_environment(data, "amp")
    header = next(line for line in run["stdout"].splitlines() if line.startswith("model "))
    for col in ("precision", "step ms", "p25-p75", "samples/s", "act MiB", "peak MiB", "loss@0"):
        assert col in header, col
    rows = {(r["model"], r["precision"]): r for r in data["results"]}
    assert set(rows) == {(m, p) for m in MODELS for p in ("fp32", "bf16", "fp16")}
    for (model, precision), r in rows.items():
        assert _table_rows(run["stdout"], model, precision), (model, precision)
        assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"])
        assert r["step_ms_p25"] <= r["step_ms"] <= r["step_ms_p75"]
        # no cap: every variant ran every step, so the losses compare at equal step counts
        assert r["train_steps"] == 8 and r["timed_steps"] == 5 and not r["capped"]
        assert len(r["times_s"]) == 5
        assert math.isfinite(r["loss_start"]) and math.isfinite(r["loss_end"])
        assert r["loss_end"] < r["loss_start"], (model, precision, "did not train")
        # precision does not break training: close to float32's loss after the same 8 steps
        assert abs(r["loss_end"] - rows[model, "fp32"]["loss_end"]) < 0.1, (model, precision)
        assert r["activation_bytes"] > 0
        if data["environment"]["device"].startswith("cuda"):  # --device auto picked CUDA
            assert r["peak_bytes"] > 0
        else:
            assert r["peak_bytes"] is None  # CPU: no allocator peak
        assert (r["loss_scale"] is not None) == (precision == "fp16")
    # autocast keeps the transformer's big activations in half precision
    assert (
        rows["transformer", "bf16"]["activation_bytes"]
        < rows["transformer", "fp32"]["activation_bytes"]
    )
    assert data["config"]["steps"] == 8
    # issue 21: one wording for ratios ("1.02x", the header says what over what, the notes
    # which way is better), and --plot draws a PNG
    assert "time vs fp32" in header and "lower is better" in run["stdout"]
    for (model, precision), r in rows.items():
        line = _table_rows(run["stdout"], model, precision)[0]
        assert f" {r['time_ratio']:.2f}x " in line
    assert run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_amp_time_cap_cuts_steps_and_says_so():
    """A cap every step exceeds: one training step and one timed step per variant, whatever
    the machine's speed; the table marks the row and names the steps its loss is after."""
    from ftrain.bench.amp import AmpConfig, amp_table, run_amp
    from ftrain.bench.models import ModelSpec

    spec = ModelSpec("mlp", batch_size=4, width=8, layers=1)
    rows = run_amp(AmpConfig([spec], steps=4, repeats=3, max_seconds=1e-9))["results"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "fp16"]
    for r in rows:
        assert r["train_steps"] == 1 and r["timed_steps"] == 1 and r["capped"], r
    for line, r in zip(amp_table(rows, steps=4).splitlines()[2:], rows, strict=True):
        assert "* " in line and f"{r['loss_end']:.4f} @1" in line


# -------------------------------------------------------------------- memory
CHECKPOINT = ("none", "every block", "every other block", "selective", "dynamic 50%",
              "dynamic 25%")  # fmt: skip


def test_memory_quick_table_and_json(runs):
    run = runs["memory"]
    data = _ok(run)
    _check_environment(data, "memory")
    header = next(line for line in run["stdout"].splitlines() if line.startswith("model "))
    for col in ("variant", "ckpt", "act MiB", "budget MiB", "step ms", "us/sample", "peak MiB"):
        assert col in header, col
    rows: dict[tuple[str, str, str], dict] = {}
    for r in data["results"]:
        rows[r["model"], r["group"], r["variant"]] = r
        assert r["activation_bytes"] > 0, r["variant"]
        assert r["step_ms"] > 0 and r["us_per_sample"] > 0
        assert r["step_ms_p25"] <= r["step_ms"] <= r["step_ms_p75"]
        assert r["timed_units"] == 5 and not r["capped"], r  # no cap: --quick's 5 repeats
        cuda = data["environment"]["device"].startswith("cuda")
        assert (
            (r["peak_bytes"] is not None and r["peak_bytes"] > 0)
            if cuda
            else (r["peak_bytes"] is None)
        )
        assert _table_rows(run["stdout"], r["model"], r["variant"]), (r["model"], r["variant"])
    for model in MODELS:
        ck = {v: rows[model, "checkpoint", v] for v in CHECKPOINT}
        none = ck["none"]["activation_bytes"]
        assert ck["none"]["checkpointed_modules"] == 0
        assert ck["every block"]["activation_bytes"] < none
        assert ck["every block"]["checkpointed_modules"] == 4  # --quick: 4 blocks
        assert ck["every other block"]["checkpointed_modules"] == 2
        assert ck["every block"]["activation_bytes"] <= ck["every other block"]["activation_bytes"]
        for frac in (50, 25):
            dyn = ck[f"dynamic {frac}%"]
            assert dyn["budget_bytes"] == int(frac / 100 * none)
            assert dyn["activation_bytes"] <= dyn["budget_bytes"] or dyn["unreachable"], dyn
            assert dyn["unreachable"] == (
                dyn["activation_bytes"] > dyn["budget_bytes"] or dyn["planner_warned"]
            )
        b = ck["none"]["effective_batch"]
        full = rows[model, "accum", f"batch {b}"]
        acc2 = rows[model, "accum", f"batch {b // 2} x accum 2"]
        acc4 = rows[model, "accum", f"batch {b // 4} x accum 4"]
        assert full["activation_bytes"] == none
        assert acc4["activation_bytes"] < acc2["activation_bytes"] < full["activation_bytes"]
        assert acc2["effective_batch"] == acc4["effective_batch"] == b
    off = rows["convnet", "conv-bn", "bn frozen, conv-bn eval off"]
    on = rows["convnet", "conv-bn", "bn frozen, conv-bn eval on"]
    assert on["activation_bytes"] < off["activation_bytes"]
    assert not any(g == "conv-bn" for m, g, _ in rows if m != "convnet")  # no BatchNorm
    # the transformer meets its dynamic budgets
    assert not rows["transformer", "checkpoint", "dynamic 50%"]["unreachable"]
    assert run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_runs_print_the_environment_and_no_progress_noise(runs):
    for run in runs.values():
        first = run["stdout"].splitlines()[0]
        assert first.startswith("ftrain ") and "torch" in first and "thread" in first
        assert "%|" not in run["stderr"]  # TQDM_DISABLE=1 hides the bar


# ------------------------------------------------------------------ overhead
def test_overhead_runs_the_repository_script(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run(
        _cmd("overhead", "--quick", "--workloads", "tiny", "--repeats", "3", "--json", str(out),
             "--plot", str(tmp_path / "o.png")),
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads(out.read_bytes())
    variants = {r["variant"]: r for r in data["results"]}
    assert {"plain", "make_step"} <= set(variants)
    assert variants["make_step"]["reference"] == "plain"
    assert variants["make_step"]["median_us"] > 0
    assert "make_step" in proc.stdout and "us/step" in proc.stdout
    assert "200 steps per chunk" in proc.stdout  # --quick: short chunks
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_unknown_workload(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["overhead", "--workloads", "huge", "--repeats", "1", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown workload(s) huge" in err and "tiny" in err


# ----------------------------------------------------------------------- cli
def test_help_lists_commands_and_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in ("amp", "memory", "overhead"):
        assert word in text
    options = {
        "amp": ("--precisions", "--steps", "--model", "--batch-size", "--d-model", "--layers",
                "--seq-len", "--image-size", "--device", "--threads", "--warmup", "--repeats",
                "--quick", "--json", "--max-seconds"),
        "memory": ("--budgets", "--accum", "--plot", "--no-conv-bn", "--width", "--device"),
        "overhead": ("--workloads", "--import-repeats", "--repeats", "--json"),
    }  # fmt: skip
    for command, opts in options.items():
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for opt in opts:
            assert opt in text, (command, opt)
        if command != "overhead":
            assert "reproducible" in text  # why --threads defaults to 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["memory", "--budgets", "1.5"], "(0, 1]"),
        (["memory", "--budgets", "0"], "(0, 1]"),
        (["memory", "--budgets", "half"], "--budgets"),
        (["amp", "--model", "resnet"], "invalid choice: 'resnet'"),
        (["amp", "--batch-size", "0"], "--batch-size: must be >= 1"),
        (["amp", "--precisions", "fp8"], "invalid choice: 'fp8'"),
        (["memory", "--accum", "3", "--model", "mlp"], "not divisible"),
        (["amp", "--model", "transformer", "--d-model", "30", "--heads", "4"], "divisible"),
        (["memory", "--device", "tpu"], "--device 'tpu'"),
        (["amp", "--threads", "0"], "--threads: must be >= 1"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_options_fail_with_a_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_cuda_requested_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["amp", "--device", "cuda", "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "--device cpu" in err


def test_import_ftrain_does_not_import_bench():
    code = (
        "import sys, ftrain; print(sorted(m for m in sys.modules if m.startswith('ftrain.bench')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_benchmarks_memory_wrapper(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--quick", "--model", "mlp", "--budgets", "0.5",
         "--accum", "2", "--repeats", "1", "--json", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads(out.read_bytes())
    assert {r["variant"] for r in data["results"]} >= {"none", "every block", "dynamic 50%"}
    assert "every other block" in proc.stdout


def test_benchmarks_checkpoint_wrapper_table_and_json(tmp_path):
    # issue 12, item 3: the structure of the checkpoint benchmark (not its timings)
    out = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/checkpoint.py", "--size-mb", "2", "--repeats", "2",
         "--dir", str(tmp_path), "--json", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads(out.read_bytes())
    assert data["benchmark"] == "checkpoint" and data["config"] == {"size_mb": 2.0, "repeats": 2}
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {"torch.save", "ftrain background"}
    assert all(r["bytes"] == 2 * 2**20 for r in rows.values())
    for r in rows.values():
        assert {"median_s", "p25_s", "p75_s", "first_s"} <= set(r["blocked"])
    assert "completed" in rows["ftrain background"]
    # issue 21: the ratio is the median of the per-repeat paired ratios, and it has a verdict
    pairs = zip(rows["ftrain background"]["blocked_s"], rows["torch.save"]["blocked_s"])
    assert data["ratio"] == pytest.approx(statistics.median(b / s for b, s in pairs))
    assert "blocked time vs torch.save" in proc.stdout and "ftrain background" in proc.stdout
    (line,) = [t for t in data["targets"] if "blocked time vs torch.save" in t]
    assert re.search(r"\) (OK|MISSED|inconclusive)\b", line), line
    assert not [p for p in tmp_path.iterdir() if p.name != "c.json"]  # cleaned up


@pytest.mark.parametrize(
    "name",
    ["models", "timing", "env", "report", "memory", "amp", "overhead", "cli", "checkpoint",
     "verdict", "parser", "commands", "e2e", "peers"],
)  # fmt: skip
def test_doctests(name):
    module = importlib.import_module(f"ftrain.bench.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


# ------------------------------------------------------------------- verdicts
def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n draws of a continuous law: closed form."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


def test_median_interval_is_the_order_statistic_interval():
    from ftrain.bench.verdict import median_interval

    xs = [7.0, 1.0, 3.0, 9.0, 5.0]
    iv = median_interval(xs)  # n=5: only the full range reaches 90%
    assert (iv.median, iv.lo, iv.hi, iv.n) == (5.0, 1.0, 9.0, 5)
    assert iv.confidence == pytest.approx(_coverage(5, 1)) == pytest.approx(30 / 32)
    xs = [float(v) for v in range(100, 0, -1)]  # n=100: the 95% interval is x_(40)..x_(61)
    iv = median_interval(xs)
    k = max(j for j in range(1, 51) if _coverage(100, j) >= 0.95)
    assert (iv.lo, iv.hi) == (float(k), float(101 - k)) == (40.0, 61.0)
    assert iv.confidence == pytest.approx(_coverage(100, k))
    assert median_interval([]).n == 0 and math.isnan(median_interval([]).median)


@pytest.mark.parametrize(
    "better, values, verdict",
    [
        # lower is better, limit 10: entirely below / entirely above / straddling
        ("lower", [2.0, 3.0, 4.0, 5.0, 6.0, 3.5, 4.5], "OK"),
        ("lower", [12.0, 15.0, 11.0, 13.0, 14.0, 12.5, 30.0], "MISSED"),
        ("lower", [2.0, 3.0, 4.0, 5.0, 6.0, 3.5, 303.0], "inconclusive"),  # one outlier: wide
        ("lower", [-231.8, 4.0, 5.0, 6.0, 303.0], "inconclusive"),  # issue 21's flipping pair
        # higher is better, limit 10
        ("higher", [12.0, 15.0, 11.0, 13.0, 14.0], "OK"),
        ("higher", [2.0, 3.0, 4.0, 5.0, 6.0], "MISSED"),
        ("higher", [8.0, 9.0, 11.0, 12.0, 13.0], "inconclusive"),
        # too few pairs for a 90% interval, however tight
        ("lower", [1.0, 1.0, 1.0], "inconclusive"),
    ],
)
def test_verdict_only_when_the_whole_interval_is_on_one_side(better, values, verdict):
    from ftrain.bench.verdict import Target, judge, median_interval

    target = Target("x", 10.0, "us", better=better)
    v = judge(target, median_interval(values))
    assert v.verdict == verdict, v.line()
    line = v.line()
    assert line.endswith(verdict) or f" {verdict}: " in line
    assert "interval" in line and f"n={len(values)}" in line  # the spread is always shown
    if verdict == "inconclusive":
        assert v.why  # and why: straddles the limit, or too few samples


def test_verdict_on_paired_ratios_and_quick_runs():
    from ftrain.bench.verdict import Target, judge, median_interval, paired

    ref = [100.0, 180.0, 90.0, 300.0, 120.0, 95.0, 160.0]  # a loaded machine: wild swings
    ftrain = [r * 1.01 for r in ref]  # 1% slower in every round
    ratio = median_interval(paired(ftrain, ref, "ratio"))
    assert ratio.lo == pytest.approx(1.01) and ratio.hi == pytest.approx(1.01)
    assert judge(Target("t", 1.02, "x"), ratio).verdict == "OK"  # pairing cancels the swings
    unpaired = median_interval([a / b for a, b in zip(ftrain, ref[1:] + ref[:1])])
    assert judge(Target("t", 1.02, "x"), unpaired).verdict == "inconclusive"
    full = Target("t", 1.02, "x", full_size=True)
    assert judge(full, ratio, quick=True).verdict == "not judged"
    assert judge(full, ratio, quick=False).verdict == "OK"
    with pytest.raises(ValueError, match="equal counts"):
        paired([1.0], [1.0, 2.0], "ratio")


def test_one_ratio_wording():
    from ftrain.bench.verdict import fmt_ratio

    assert [fmt_ratio(r) for r in (1.0234, 0.5, 12.0)] == ["1.02x", "0.50x", "12.00x"]
    assert fmt_ratio(None) == fmt_ratio(float("nan")) == "-"


# --------------------------------------------------------------- progress bar
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch):
    from ftrain.bench.report import progress_bar

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    for stream, shown in ((io.StringIO(), False), (_Terminal(), True)):
        bar = progress_bar(3, "demo", stream=stream)
        bar.update(3)
        bar.close()
        assert bool(stream.getvalue()) == shown, (type(stream).__name__, stream.getvalue())
    off = _Terminal()
    bar = progress_bar(3, "demo", enabled=False, stream=off)  # --no-progress
    bar.update(3)
    bar.close()
    assert off.getvalue() == ""


def test_no_progress_bar_when_stderr_is_redirected():
    env = {k: v for k, v in ENV.items() if k != "TQDM_DISABLE"}  # nothing hides it but the pipe
    proc = subprocess.run(
        _cmd("amp", "--quick", "--model", "mlp", "--precisions", "fp32", "--steps", "1",
             "--repeats", "2", *NO_CAP),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step/s" not in proc.stderr and "%|" not in proc.stderr and "it/s" not in proc.stderr
    assert re.search(r"\(amp took \d+\.\d s", proc.stdout)  # every command prints its time


# --------------------------------------------------------------- quick runs
def test_quick_overhead_judges_only_what_it_measures(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run(
        _cmd("overhead", "--quick", "--workloads", "tiny", "--json", str(out)),
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    targets = orjson.loads(out.read_bytes())["targets"]
    loop = [t for t in targets if t.startswith("loop+hooks")]
    assert loop and all(t.endswith("not judged: a --quick run") for t in loop)
    (step,) = [t for t in targets if t.startswith("make_step on tiny")]
    assert re.search(r"n=5\) (OK|MISSED|inconclusive)", step), step  # 5 pairs: judged
    assert "does not judge the targets defined at full size" in proc.stdout
    assert "targets OK" not in proc.stdout


def test_quick_compile_targets_are_not_judged():
    from ftrain.bench.commands import quick_targets

    lines = [
        "ftrain compiled vs plain eager on transformer >= 1.3x: 1.35x  OK",
        "ftrain compiled vs plain compile(model) on transformer > 1x: 0.9x  MISSED",
    ]
    for line in quick_targets(lines):
        assert line.endswith("not judged (--quick)") and "OK" not in line and "MISSED" not in line


# ------------------------------------------------------------------------ e2e
def test_e2e_full_stack_and_hand_written_loop_train_alike(tmp_path):
    """Both sides run every feature on the same data and reach the same losses (every EMA
    evaluation and the final loss, in each fresh pair of runs); the figures' structure,
    never their values."""
    from ftrain.bench.e2e import E2EConfig, e2e_table, run_e2e

    spec = E2EConfig.small_spec(width=16, layers=1, seq_len=8, batch_size=4)
    cfg = E2EConfig(spec=spec, blocks=2, rounds=2, updates=4, accum=2, log_every=2,
                    eval_every=2, checkpoint_every=4, warmup_updates=3, epoch_batches=6,
                    directory=str(tmp_path))  # fmt: skip
    out = run_e2e(cfg)
    # per block: evaluations at updates 2, 4, ..., 10 (a warm-up chunk of 2, 2 rounds of 4)
    # and the final loss; two blocks
    assert len(out["evals"]["ftrain"]) == len(out["evals"]["hand-written"]) == 2 * (5 + 1)
    assert out["same_loss"] and out["loss_max_abs_diff"] <= 1e-4
    assert out["evals"]["ftrain"][5] < out["evals"]["ftrain"][0]  # it trained
    assert out["evals"]["ftrain"][:6] == out["evals"]["ftrain"][6:]  # fresh runs, same seed
    rows = {r["variant"]: r for r in out["results"]}
    assert set(rows) == {"ftrain", "hand-written"}
    assert all(len(r["times_s"]) == 4 and r["tokens_per_s"] > 0 for r in rows.values())
    assert out["ratio"]["n"] == 4 and out["tokens_per_round"] == 4 * 2 * 4 * 8
    (verdict,) = out["verdicts"]
    assert verdict["verdict"] == "inconclusive"  # 4 rounds are too few for a verdict
    assert "same loss: yes" in e2e_table(out)
    assert not list(tmp_path.iterdir())  # both runs' files were in a temporary directory


def test_e2e_sides_write_what_they_claim(tmp_path):
    """The hand-written loop logs, evaluates and checkpoints at the same updates as ftrain."""
    from ftrain.bench.e2e import E2EConfig, ftrain_loop, hand_written_loop, make_data

    spec = E2EConfig.small_spec(width=16, layers=1, seq_len=8, batch_size=4)
    cfg = E2EConfig(spec=spec, blocks=1, rounds=1, updates=4, accum=2, log_every=2,
                    eval_every=2, checkpoint_every=4, warmup_updates=2,
                    epoch_batches=6)  # fmt: skip
    loader, val = make_data(cfg)
    (tmp_path / "hand").mkdir()
    evals: list[float] = []
    gen = hand_written_loop(cfg, loader, val, tmp_path / "hand", evals)
    assert [next(gen) for _ in range(cfg.total_updates)] == list(range(1, 7))
    gen.close()
    lines = (tmp_path / "hand" / "metrics.jsonl").read_text().splitlines()
    assert [orjson.loads(x)["step"] for x in lines] == [2, 4, 6]
    assert sorted(p.name for p in (tmp_path / "hand").glob("iter_*.pth")) == ["iter_4.pth"]
    assert len(evals) == 3 + 1
    ft_evals: list[float] = []
    lp = ftrain_loop(cfg, loader, val, tmp_path / "ftrain", ft_evals)
    lp.run()
    assert lp.state.step == cfg.total_updates == 6
    assert ft_evals == evals[:-1]  # bitwise: the same computation in the same order
    rows = [
        orjson.loads(x) for x in (tmp_path / "ftrain" / "metrics.jsonl").read_text().splitlines()
    ]
    assert {2, 4, 6} <= {r["step"] for r in rows}


def test_e2e_command(tmp_path):
    out = tmp_path / "e.json"
    proc = subprocess.run(
        _cmd("e2e", "--quick", "--updates", "2", "--repeats", "2", "--json", str(out)),
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = orjson.loads(out.read_bytes())
    assert data["benchmark"] == "e2e" and data["config"]["blocks"] == 2  # --quick
    assert data["config"]["rounds"] == 1 and data["ratio"]["n"] == 2
    assert data["same_loss"] is True
    assert "tokens/s ratio ftrain / hand-written (higher is better)" in proc.stdout
    assert re.search(r"\(e2e took \d+\.\d s", proc.stdout)


# ---------------------------------------------------------------------- peers
def test_peers_structure_and_skipped_peer(monkeypatch, tmp_path):
    """Every installed framework trains through the probe's window (a finite us/step); a
    peer that is not installed is left out with a note. Figures are not checked."""
    import importlib.util

    from ftrain.bench import peers

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mmengine" else real(name, *a)
    )
    cfg = peers.PeersConfig(steps=20, warmup=5, rounds=1, size_mb=1.0, directory=str(tmp_path))
    out = peers.run_peers(cfg)
    names = [r["variant"] for r in out["loop"]]
    expected = ["plain", "ftrain"] + [
        n for n in ("lightning", "accelerate") if real(n) is not None
    ]  # fmt: skip
    assert sorted(names) == sorted(expected)
    assert all(math.isfinite(r["us"]) and r["us"] > 0 for r in out["loop"])
    assert "mmengine: not installed, skipped (pip install mmengine)" in out["notes"]
    saves = {r["variant"]: r for r in out["save"]}
    assert {"torch.save", "ftrain", "dcp"} <= set(saves)
    assert all(r["completed_s"] >= r["blocked_s"] > 0 for r in saves.values())
    assert saves["torch.save"]["blocked_vs_torch_save"]["median"] == 1.0
    text = peers.peers_table(out)
    assert "us/step" in text and "vs torch.save" in text
    assert not list(tmp_path.iterdir())
