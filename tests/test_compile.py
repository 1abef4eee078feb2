"""``ftrain.with_compile``: the whole update compiled, composed with every transform.

Compiling is slow on a small CPU machine, so the tests keep models tiny and most
use the ``aot_eager`` backend: dynamo traces exactly as for inductor (graph
breaks, guards, recompiles are dynamo's, and AOT autograd partitions the traced
backward as for inductor), only the final code generation is skipped. One test
runs inductor end to end against a plain eager PyTorch loop. Dynamo is reset
before each test so its counters are the test's own.
"""

from __future__ import annotations

import json
import re
import warnings

import attrs
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn import functional as F

import ftrain
from ftrain.bench.models import ModelSpec
from ftrain.step import Step
from ftrain.transforms.base import Tracing, Transform
from ftrain.transforms.compile import CompileFallbackWarning

FAST = "aot_eager"
MLP = ModelSpec("mlp", batch_size=8, width=16, layers=3)
TRANSFORMER = ModelSpec(
    "transformer", batch_size=4, width=16, layers=2, seq_len=8, heads=2, vocab=32
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def graphs() -> int:
    """Graphs compiled so far (first compiles and recompiles alike)."""
    return counters["stats"]["unique_graphs"]


def _state(spec: ModelSpec, model: torch.nn.Module | None = None, lr: float = 1e-2):
    model = spec.build() if model is None else model
    return ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=lr))


def _composed(spec: ModelSpec, *, every: int = 2, amp: bool = True) -> ftrain.step.Step:
    step = ftrain.make_step(spec.loss)
    if amp:
        step = ftrain.with_amp(step, "bf16")
    step = ftrain.with_grad_accum(step, every=every)
    return ftrain.with_clip(step, "norm", max_norm=0.5)


# ----------------------------------------------- 3: against a plain eager loop
def test_compiled_step_trains_as_a_plain_eager_loop_inductor():
    """Inductor: AdamW + clip + accumulation (with a smaller last batch) = a plain loop."""
    every, steps = 2, 8
    batches = [MLP.batch(seed=i) for i in range(steps - 1)] + [MLP.batch(5, seed=99)]

    ref = MLP.build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(ref(x), y)
        (loss / every).backward()
        ref_losses.append(loss.detach())
        if (i + 1) % every == 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)

    state = _state(MLP)
    step = ftrain.with_compile(_composed(MLP, every=every, amp=False))
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for p, q in zip(state.model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert graph_breaks() == 0
    # the loss function (its backward comes with it), the update: the smaller last batch
    # added none
    assert graphs() == 2


# ------------------------------- 2: no graph breaks, no recompiles in steady state
@pytest.mark.parametrize("spec", [MLP, TRANSFORMER], ids=["mlp", "transformer"])
def test_no_graph_break_and_no_recompile_in_steady_state(spec):
    """AdamW + clip + bf16 + accumulation; then a new lr, a smaller batch, a reload."""
    state = _state(spec)
    # fullgraph=True: a graph break would raise, not just count
    step = ftrain.with_compile(_composed(spec), backend=FAST, fullgraph=True)
    for i in range(4):  # two windows: everything compiled
        state, _ = step(state, spec.batch(seed=i))
    compiled = graphs()
    assert compiled == 2 and graph_breaks() == 0  # the loss function, the update
    group = state.optimizer.param_groups[0]
    group["lr"], group["betas"] = 3e-3, (0.8, 0.99)  # a schedule's change (with_schedule)
    for i in range(2):
        state, _ = step(state, spec.batch(3, seed=10 + i))  # the epoch's smaller last batch
    saved = ftrain.checkpoint.state_dict(state)
    for i in range(2):
        state, _ = step(state, spec.batch(seed=20 + i))
    state = ftrain.checkpoint.load_state_dict(state, saved)  # resume, same objects
    for i in range(4):
        state, _ = step(state, spec.batch(seed=30 + i))
    assert graphs() == compiled
    assert graph_breaks() == 0
    assert not counters["recompiles"]  # (only filled when a recompile happens)


def test_loop_with_checkpoints_resumes_without_recompiling(tmp_path):
    """ftrain.Loop(...).run() with checkpoints: last batch smaller, resume="auto"; no new graph."""
    data = torch.utils.data.TensorDataset(*MLP.batch(10, seed=1))  # batches of 4, 4, 2
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    step = ftrain.with_compile(_composed(MLP), backend=FAST)
    hooks = ftrain.default_hooks(log_every=1, checkpoint_every=1, progress=False)
    state = ftrain.Loop(step, _state(MLP), loader, hooks, epochs=2, work_dir=tmp_path).run()
    compiled = graphs()
    assert compiled == 2 and graph_breaks() == 0
    assert state.step == 4  # 2 epochs x (one window of 2 + a flushed window of 1)
    resumed = ftrain.Loop(
        step, state, loader, hooks, epochs=3, work_dir=tmp_path, resume="auto"
    ).run()
    assert resumed.step == 6 and resumed.epoch == 3
    assert graphs() == compiled and graph_breaks() == 0
    log = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert log and not any("_orig_mod" in key for entry in log for key in entry)


# ------------------------------------------------- 1: composes with every transform
def _train(step, spec, batches, *, model=None):
    state = _state(spec, model)
    out = []
    for b in batches:
        state, metrics = step(state, b)
        out.append(metrics)
    return state, out


COMPOSED = {
    "bf16+accum+clip norm": lambda s: _composed(MLP),
    "fp16 dynamic scaler": lambda s: ftrain.with_amp(s, "fp16"),
    "fp16 overflowing static scale": lambda s: ftrain.with_amp(s, "fp16", loss_scale=2.0**126),
    "clip average": lambda s: ftrain.with_clip(ftrain.with_grad_accum(s, 2), "average"),
    "clip moving_average": lambda s: ftrain.with_clip(s, "moving_average", tolerance=1.0),
    "clip value": lambda s: ftrain.with_clip(s, "value", clip_value=0.01),
    "nonfinite skip": lambda s: ftrain.with_nonfinite_check(ftrain.with_grad_accum(s, 2), "skip"),
    "activation checkpoint": lambda s: ftrain.with_activation_checkpoint(
        ftrain.with_grad_accum(s, 2), ["blocks.0", "blocks.1"]
    ),
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_compiled_equals_eager_for_every_transform(name):
    batches = [MLP.batch(seed=i) for i in range(6)]
    if name == "nonfinite skip":
        x, y = batches[2]
        batches[2] = (torch.full_like(x, float("nan")), y)  # this window is skipped
    eager_step = COMPOSED[name](ftrain.make_step(MLP.loss))
    compiled_step = ftrain.with_compile(eager_step, backend=FAST)
    e_state, e_metrics = _train(eager_step, MLP, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c_state, c_metrics = _train(compiled_step, MLP, batches)
    # bf16: the traced graph may round differently from eager autocast
    tol = {"rtol": 2e-3, "atol": 2e-3} if "bf16" in name else {"rtol": 1e-5, "atol": 1e-6}
    for em, cm in zip(e_metrics, c_metrics, strict=True):
        assert em.keys() == cm.keys()
        for k in em:
            torch.testing.assert_close(cm[k], em[k], **tol, equal_nan=True)
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **tol)
    c_tstate = {k: v for k, v in c_state.transforms.items() if k != "compile"}
    assert repr(c_tstate) == repr(dict(e_state.transforms))
    assert graph_breaks() == 0
    fallbacks = [str(w.message) for w in caught if w.category is CompileFallbackWarning]
    if name.startswith("fp16"):  # the documented fallback: the scaler's optimizer step is eager
        assert len(fallbacks) == 1
        assert (
            "Amp(dtype=torch.float16" in fallbacks[0]
            and "owns the optimizer update" in (fallbacks[0])
        )
        if "overflowing" in name:
            assert all(bool(m["skipped"]) for m in c_metrics)
    else:  # the non-finite check decides eagerly between two compiled programs: no fallback
        assert not fallbacks


def test_nonfinite_raise_leaves_a_valid_state():
    step = ftrain.with_compile(
        ftrain.with_nonfinite_check(ftrain.make_step(MLP.loss), "raise"), backend=FAST
    )
    state = _state(MLP)
    state, _ = step(state, MLP.batch(seed=0))
    before = [p.detach().clone() for p in state.model.parameters()]
    x, y = MLP.batch(seed=1)
    with pytest.raises(ftrain.NonFiniteLossError) as err:
        step(state, (x * float("inf"), y))
    for p, q in zip(err.value.state.model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    step(err.value.state, MLP.batch(seed=2))  # continues


def test_untraceable_optimizer_falls_back_with_a_warning():
    """An optimizer with step hooks: its update runs eagerly (hooks run), and it says so."""
    model = MLP.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    state = ftrain.TrainState.create(model, opt)
    step = ftrain.with_compile(ftrain.make_step(MLP.loss), backend=FAST)
    with pytest.warns(CompileFallbackWarning, match="update runs eagerly"):
        for i in range(2):
            state, _ = step(state, MLP.batch(seed=i))
    assert calls == [1, 1]


# --------------------------------------- 1: checkpoints compiled <-> eager
def test_checkpoints_move_between_compiled_and_eager_runs():
    batches = [MLP.batch(seed=i) for i in range(8)]
    eager = _composed(MLP, amp=False)
    compiled = ftrain.with_compile(eager, backend=FAST)
    ref, _ = _train(eager, MLP, batches)  # eager all the way

    # compiled for 3 micro-batches (mid-window), eager for the rest
    state, _ = _train(compiled, MLP, batches[:3], model=torch.compile(MLP.build(), backend=FAST))
    saved = ftrain.checkpoint.state_dict(state)
    assert not any("_orig_mod" in k for k in saved["model"]) and saved["grads"]
    other = _state(MLP)
    other = ftrain.checkpoint.load_state_dict(other, saved)
    for b in batches[3:5]:
        other, _ = eager(other, b)
    # ... and back into a compiled run
    back = _state(MLP)
    back = ftrain.checkpoint.load_state_dict(back, ftrain.checkpoint.state_dict(other))
    for b in batches[5:]:
        back, _ = compiled(back, b)
    for p, q in zip(back.model.parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # the new model reused the forward+backward program; its new optimizer got its own
    # update program: no recompile either way
    assert not counters["recompiles"] and graph_breaks() == 0


# -------------------------------- 4: a model compiled by the user, every feature
def test_user_compiled_model_has_no_orig_mod_anywhere(tmp_path):
    model = torch.compile(TRANSFORMER.build(), backend=FAST)
    assert any("_orig_mod" in n for n, _ in model.named_parameters())  # what torch does
    groups = ftrain.param_groups(model, lr=1e-2, weight_decay=0.01)
    assert not any("_orig_mod" in n for g in groups for n in g["names"])
    state = ftrain.TrainState.create(model, torch.optim.AdamW(groups))
    step = ftrain.with_activation_checkpoint(_composed(TRANSFORMER), ["blocks.0", "blocks.1"])
    step = ftrain.with_ema(step, decay=0.5)
    data = [TRANSFORMER.batch(seed=i) for i in range(4)]
    hooks = ftrain.default_hooks(log_every=1, checkpoint_every=2, progress=False)
    for kind, s in (("eager", step), ("compiled", ftrain.with_compile(step, backend=FAST))):
        work = tmp_path / kind
        state = ftrain.Loop(s, state, data, hooks, epochs=state.epoch + 1, work_dir=work).run()
        assert state.transforms["activation_checkpoint"].modules == ("blocks.0", "blocks.1")
        ckpt = torch.load(next(work.glob("iter_*.pth")), weights_only=False)
        names = [*ckpt["state"]["model"], *ckpt["state"]["grads"]]
        assert names and not any("_orig_mod" in k for k in names)
        ema_names = list(state.transforms["ema"].params)
        assert ema_names == [n for n, _ in model._orig_mod.named_parameters()]
        assert list(ckpt["state"]["transforms"]["ema"]["module"]) == list(
            model._orig_mod.state_dict()
        )
        tags = [
            k
            for line in (work / "metrics.jsonl").read_text().splitlines()
            for k in json.loads(line)
        ]
        assert "loss" in tags and not any("_orig_mod" in t for t in tags)
    assert graph_breaks() == 0


def test_unwrap_strips_compile_and_ddp_wrappers():
    inner = torch.nn.Linear(2, 1)
    assert ftrain.dist.unwrap(torch.compile(inner, backend=FAST)) is inner
    assert ftrain.dist.unwrap(torch.nn.DataParallel(torch.compile(inner))) is inner


def test_with_compile_arguments():
    step = ftrain.with_compile(ftrain.make_step(MLP.loss), mode="max-autotune", dynamic_batch=False)
    assert step["compile"].mode == "max-autotune" and not step["compile"].dynamic_batch
    with pytest.raises(TypeError, match="mode"):
        ftrain.with_compile(ftrain.make_step(MLP.loss), mode=3)
    with pytest.raises(ValueError, match="already has a 'compile'"):
        ftrain.with_compile(ftrain.with_compile(ftrain.make_step(MLP.loss)))


# ------------------------------------------------------------ 5: the benchmark
def _check_cold(data: dict, stdout: str, rows: dict) -> None:
    """The cold compiles of the baseline and of ftrain compiled, printed with their ratio."""
    assert [c["model"] for c in data["cold"]] == ["transformer", "mlp"]
    lines = stdout.splitlines()
    cold_lines = lines[lines.index("cold compile:") :]
    for c in data["cold"]:
        assert len(c["baseline_cpu_s"]) == len(c["ftrain_cpu_s"]) == 1  # --quick: one pair
        assert c["ratio"] == pytest.approx(c["ftrain_cpu_s"][0] / c["baseline_cpu_s"][0])
        assert c["static_cpu_s"] is None  # --quick skips the static-batch compile
        assert c["baseline_s"][0] == rows[c["model"], "compile(model)+update"]["first_call_s"]
        line = next(ln for ln in cold_lines if ln.startswith(f"{c['model']} "))
        assert line.split() == [f"{c['model']}",
                                f"{c['baseline_cpu_s'][0]:.1f}", f"({c['baseline_s'][0]:.0f})",
                                f"{c['ftrain_cpu_s'][0]:.1f}", f"({c['ftrain_s'][0]:.0f})",
                                f"{c['ratio']:.2f}x", "-", "-"]  # fmt: skip


def test_bench_compile_quick_table_and_json(tmp_path):
    """Structure only (tiny models, aot_eager): the table, the JSON, the targets; no timings."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "compile.json"
    cmd = [sys.executable, str(root / "benchmarks" / "compile.py"), "--quick", "--backend",
           "aot_eager", "--batch-size", "4", "--width", "16", "--layers", "1", "--seq-len", "8",
           "--repeats", "3", "--no-progress", "--json", str(out),
           "--model", "transformer", "mlp"]  # fmt: skip
    # issue 21: --quick alone runs the mlp only (under a minute); both models named here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "compile" and data["config"]["backend"] == "aot_eager"
    assert data["environment"]["threads"] == 1
    rows = {(r["model"], r["variant"]): r for r in data["results"]}
    variants = ("plain eager", "plain compile(model)", "compile(model)+update", "ftrain eager",
                "ftrain compiled")  # fmt: skip
    assert set(rows) == {(m, v) for m in ("transformer", "mlp") for v in variants}
    for (model, variant), r in rows.items():
        assert r["ms_p25"] <= r["ms"] <= r["ms_p75"] and r["ms"] > 0
        assert r["first_call_s"] > 0 and r["compile_s"] >= 0
        pattern = re.compile(rf"{model}\s+{re.escape(variant)}\s{{2,}}\S")
        line = next(ln for ln in run.stdout.splitlines() if pattern.match(ln))
        assert f"{r['speedup_vs_plain']:.2f}x" in line
    assert rows["transformer", "plain eager"]["speedup_vs_plain"] == 1.0
    header = next(ln for ln in run.stdout.splitlines() if ln.startswith("model "))
    for col in ("variant", "step ms", "p25-p75", "vs plain", "vs compile(model)", "1st s"):
        assert col in header
    _check_cold(data, run.stdout, rows)
    assert 0 < data["heavy_share"] <= 1
    # issue 21: a --quick run reports the full-size targets' figures without a verdict
    assert len(data["targets"]) == 3
    assert all(t.endswith("not judged: a --quick run") for t in data["targets"])
    assert not any(" OK" in t or "MISSED" in t or "inconclusive" in t for t in data["targets"])


@pytest.mark.parametrize("module", ["ftrain.transforms.compile", "ftrain.bench.compile"])
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_a_summed_loss_under_compile_equals_eager():
    """A SummedLoss (tokens of padded sequences) is normalised by the window's count, as eagerly."""

    def summed(model, batch):
        x, y = batch
        mask = (y.float() > 0.5).float()  # a varying number of counted items per micro-batch
        per_item = F.cross_entropy(model(x), y.long().squeeze(-1) % 10, reduction="none")
        return ftrain.SummedLoss((per_item * mask.squeeze(-1)).sum(), mask.sum())

    batches = [(x, (y % 2).unsqueeze(-1)) for x, y in (MLP.batch(seed=i) for i in range(4))]
    eager = ftrain.with_grad_accum(ftrain.make_step(summed), every=2)
    e_state, e_metrics = _train(eager, MLP, batches)
    c_state, c_metrics = _train(ftrain.with_compile(eager, backend=FAST), MLP, batches)
    for em, cm in zip(e_metrics, c_metrics, strict=True):
        assert em.keys() == cm.keys() == {"loss", "loss_sum", "loss_count"}
        for k in em:
            torch.testing.assert_close(cm[k], em[k], rtol=1e-5, atol=1e-6)
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert graph_breaks() == 0


# ------------------------------------------- the executor: transforms declare their tracing
def _docs_example() -> dict:
    """Run the example transform of docs/concepts/transforms.md ("Writing a transform")."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs/concepts/transforms.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    code = next(b for b in blocks if "class CountLargeNorms" in b)
    namespace = {"ftrain": ftrain, "loss_fn": MLP.loss}
    exec(compile(code, "transforms.md", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_docs_example_transform_is_traced_into_the_compiled_update():
    """Its before_update (after clipping) runs inside the one update program, as eagerly."""
    example = _docs_example()
    assert example["step"]["count_large"].tracing.traced == {"before_update"}
    batches = [MLP.batch(seed=i) for i in range(6)]
    base = example["step"].without("count_large")  # the docs' step, with a limit that splits
    _, norms = _train(base, MLP, batches)
    limit = sorted(float(m["grad_norm"]) for m in norms)[3]
    step = base.with_transform(example["CountLargeNorms"](limit=limit))
    e_state, e_metrics = _train(step, MLP, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        c_state, c_metrics = _train(ftrain.with_compile(step, backend=FAST), MLP, batches)
    counted = int(e_state.transforms["count_large"])
    assert 0 < counted < 6  # the limit splits the updates: the count is not trivial
    assert int(c_state.transforms["count_large"]) == counted
    for em, cm in zip(e_metrics, c_metrics, strict=True):
        torch.testing.assert_close(cm["grad_norm"], em["grad_norm"], rtol=1e-5, atol=1e-6)
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert graphs() == 2 and graph_breaks() == 0  # the loss; clip + count + AdamW as one


def test_an_undeclared_transform_runs_eagerly_between_two_compiled_programs():
    """A transform that declares nothing still composes: the update splits around it."""
    example = _docs_example()
    declared = example["CountLargeNorms"]

    @attrs.frozen
    class Undeclared(Transform):
        limit: float
        name = "count_large"
        stage = 35
        init = declared.init
        before_update = declared.before_update

    assert Undeclared.tracing == Tracing()
    batches = [MLP.batch(seed=i) for i in range(6)]
    base = example["step"].without("count_large")
    _, norms = _train(base, MLP, batches)
    step = base.with_transform(Undeclared(sorted(float(m["grad_norm"]) for m in norms)[3]))
    e_state, _ = _train(step, MLP, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        c_state, _ = _train(ftrain.with_compile(step, backend=FAST), MLP, batches)
    assert 0 < int(c_state.transforms["count_large"]) == int(e_state.transforms["count_large"]) < 6
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert graphs() == 3 and graph_breaks() == 0  # the loss; clip; AdamW


def test_a_transform_can_ask_for_an_eager_forward():
    """Monitored checkpointing measures eager activations: forward eager (said once), update
    compiled, the activation bytes those of an eager step."""
    step = ftrain.with_activation_checkpoint(
        ftrain.make_step(MLP.loss), ["blocks.0", "blocks.1"], monitor=True
    )
    batches = [MLP.batch(seed=i) for i in range(3)]
    e_state, e_metrics = _train(step, MLP, batches)
    with pytest.warns(CompileFallbackWarning, match="measures eager activations") as caught:
        c_state, c_metrics = _train(ftrain.with_compile(step, backend=FAST), MLP, batches)
    assert len([w for w in caught if w.category is CompileFallbackWarning]) == 1
    assert [int(m["activation_bytes"]) for m in c_metrics] == [
        int(m["activation_bytes"]) for m in e_metrics
    ]
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert graphs() == 1 and graph_breaks() == 0  # the update only


def test_compile_knows_no_other_transform():
    """compile.py imports only the protocol and names no other transform."""
    import ast
    import inspect

    from ftrain.transforms import compile as module

    tree = ast.parse(inspect.getsource(module))
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module.startswith("ftrain.transforms")
    }
    assert imported == {"ftrain.transforms.base"}
    names = {"accum", "amp", "clip", "nonfinite", "activation_checkpoint", "schedule", "ema"}
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert not names & strings


def test_sgd_momentum_schedule_compiles_without_graph_break():
    """SGD branches on its momentum: a scheduled momentum stays a float (no break, no recompile)."""
    S = ftrain.schedules
    step = ftrain.with_schedule(
        ftrain.make_step(MLP.loss), lr=S.cosine(0.1, total=6), momentum=S.cosine(0.9, total=6)
    )
    compiled = ftrain.with_compile(step, backend=FAST)
    state, ref = (
        ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
        for m in (MLP.build(), MLP.build())
    )
    for i in range(6):
        state, _ = compiled(state, MLP.batch(seed=i))
        ref, _ = step(ref, MLP.batch(seed=i))
    for p, q in zip(state.model.parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert graph_breaks() == 0 and not counters["recompiles"]
    # the loss; the update, and its first call (SGD creates the momentum buffers): 6
    # different learning rates and momenta recompiled nothing
    assert graphs() == 3


# ------------------------------------------------------------------- bad input
def test_with_compile_refuses_bad_input_at_build():
    def loss_fn(model, batch):
        return model(batch).sum()

    with pytest.raises(TypeError, match="with_compile needs a Step.*make_step"):
        ftrain.with_compile(loss_fn)
    step = ftrain.make_step(loss_fn)
    with pytest.raises(ValueError, match="unknown mode 'bogus'.*'reduce-overhead'"):
        ftrain.with_compile(step, mode="bogus")
    with pytest.raises(ValueError, match="unknown backend 'nope'.*'inductor'"):
        ftrain.with_compile(step, backend="nope")
    with pytest.raises(ValueError, match="mode='reduce-overhead' is an inductor setting"):
        ftrain.with_compile(step, mode="reduce-overhead", backend="aot_eager")
    with pytest.raises(ValueError, match="not both"):
        ftrain.with_compile(step, mode="reduce-overhead", options={"max_autotune": True})
    with pytest.raises(TypeError, match="dynamic_batch"):
        ftrain.with_compile(step, dynamic_batch="yes")
    with pytest.raises(ValueError, match="traceable phases"):
        Tracing(traced={"forward_context"})


# ------------------------------------------------------------ 5: CUDA graphs (the logic)
@pytest.mark.parametrize(
    ("kwargs", "graphs_on"),
    [
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune"}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({"mode": "default"}, False),
        ({}, False),
        ({"options": {"triton.cudagraphs": True}}, True),
        ({"backend": "cudagraphs"}, True),
    ],
)
def test_cuda_graph_modes(kwargs, graphs_on):
    compiler = ftrain.with_compile(ftrain.make_step(MLP.loss), **kwargs)["compile"]
    assert compiler.cudagraphs is graphs_on
    assert compiler.dynamic is not graphs_on  # fixed shapes under CUDA graphs, by default
    explicit = ftrain.with_compile(ftrain.make_step(MLP.loss), dynamic_batch=True, **kwargs)
    assert explicit["compile"].dynamic


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP.build()
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)


def test_reduce_overhead_marks_steps_keeps_gradients_and_copies_outputs(monkeypatch):
    """On the CPU inductor records no graph, but everything ftrain does for one runs: a step
    begin per call (a flush too), gradient buffers kept (zeroed, never freed), the loss copied
    out of the forward's output; training equals eager."""
    from ftrain.transforms import compile as module

    marks, copied = [], []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    real_copied = module._copied
    monkeypatch.setattr(module, "_copied", lambda t: copied.append(real_copied(t)) or copied[-1])
    batches = [MLP.batch(seed=i) for i in range(5)]  # two windows of 2, then a flushed one
    step = ftrain.with_clip(ftrain.with_grad_accum(ftrain.make_step(MLP.loss), 2), max_norm=0.5)

    def train(s):
        torch.manual_seed(0)
        model = _WithUnused()
        state = ftrain.TrainState.create(
            model, torch.optim.AdamW(model.parameters(), 1e-2, weight_decay=0.0)
        )
        out = []
        for b in batches:
            state, m = s(state, b)
            out.append(m)
        state, m = s.flush(state)
        return state, [*out, m]

    e_state, e_metrics = train(step)
    c_state, c_metrics = train(ftrain.with_compile(step, mode="reduce-overhead"))
    assert len(marks) == len(batches) + 1
    # the metric lives in the copy's memory, not in the forward's output
    assert [m["loss"].data_ptr() for m in c_metrics[:-1]] == [c.data_ptr() for c in copied]
    grads = [p.grad for p in c_state.model.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # kept, zeroed after the update
    assert all(p.grad is None for p in e_state.model.parameters())
    for em, cm in zip(e_metrics, c_metrics, strict=True):
        assert em.keys() == cm.keys()
        for k in em:
            torch.testing.assert_close(cm[k], em[k], rtol=1e-4, atol=1e-5)
    for p, q in zip(c_state.model.parameters(), e_state.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_outputs_written_by_an_update_program_are_copied_once():
    from ftrain.step import StepContext
    from ftrain.transforms import compile as module

    kept, old_norm = torch.ones(()), torch.zeros(())
    model = torch.nn.Linear(1, 1)
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=1.0))
    opt = state.optimizer
    ctx = StepContext(None, state, {"clip": kept}, state.model, opt, (opt,))
    ctx.metrics = {"loss": kept}
    before = (dict(ctx.metrics), dict(ctx.tstate), old_norm)
    norm, stats = torch.tensor(2.0), (torch.tensor(3.0), torch.tensor(4.0))
    ctx.metrics["grad_norm"], ctx.grad_norm, ctx.tstate["stats"] = norm, norm, stats
    module._copy_new_outputs(ctx, *before)
    assert ctx.metrics["loss"] is kept and ctx.tstate["clip"] is kept  # not written: kept
    assert ctx.grad_norm is ctx.metrics["grad_norm"] and ctx.grad_norm is not norm
    assert torch.equal(ctx.grad_norm, norm)
    assert all(a is not b and torch.equal(a, b) for a, b in zip(ctx.tstate["stats"], stats))


# ------------------------------------------- steps bound to named optimizers (main's binding)
def _gan_state() -> ftrain.TrainState:
    torch.manual_seed(0)
    gan = torch.nn.ModuleDict(
        {"gen": torch.nn.Linear(4, 4), "disc": torch.nn.Linear(4, 1), "head": torch.nn.Linear(4, 4)}
    )
    opts = {
        "gen": torch.optim.AdamW(gan.gen.parameters(), lr=1e-2),
        "disc": torch.optim.SGD(gan.disc.parameters(), lr=0.1, momentum=0.9),
        "head": torch.optim.Adam(gan.head.parameters(), lr=1e-2),
    }
    return ftrain.TrainState.create(gan, opts)


def _gan_steps(compiled: bool) -> Step:
    def d_loss(m, z):
        return m.disc(m.gen(z).detach()).pow(2).mean()

    def g_loss(m, z):  # bound to two optimizers: one OptimizerGroup
        return (m.disc(m.head(m.gen(z))) - 1).pow(2).mean()

    d = ftrain.with_clip(ftrain.make_step(d_loss, optimizer="disc"), max_norm=0.05)
    g = ftrain.with_clip(ftrain.make_step(g_loss, optimizer=("gen", "head")), max_norm=0.05)
    if compiled:
        d, g = (ftrain.with_compile(s, backend=FAST) for s in (d, g))
    return d.then(g)


def test_steps_bound_to_named_optimizers_compile_and_equal_eager():
    """A sequence of a step bound to one optimizer and one bound to two (their group): every
    optimizer's rule traced into the compiled update (no fallback, no graph break), each
    updating only its own parameters, equal to the eager sequence."""
    batches = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    runs = {}
    for compiled in (False, True):
        state, seen = _gan_state(), []
        step = _gan_steps(compiled)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)
            for b in batches:
                state, m = step(state, b)
                seen.append(m)
        runs[compiled] = (state, seen)
    (e_state, e_seen), (c_state, c_seen) = runs[False], runs[True]
    for em, cm in zip(e_seen, c_seen, strict=True):
        assert em.keys() == cm.keys() and {"disc/loss", "gen+head/grad_norm"} <= em.keys()
        for k in em:
            torch.testing.assert_close(cm[k], em[k], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(
        c_state.model.named_parameters(), e_state.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert graph_breaks() == 0
    for name, opt in c_state.optimizers.items():  # every optimizer stepped 5 times
        steps = [s["step"] for s in opt.state.values() if "step" in s]
        assert all(int(s) == len(batches) for s in steps), name
