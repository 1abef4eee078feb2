"""Issue 21, item 1: every run says what happened, in one line.

A user's script (tests/says_child.py, catching nothing) runs in a subprocess: it says
"starting fresh" or "resumed from ... (update N, epoch E)"; Ctrl-C or SIGTERM ends it with one
line on stderr saying where it stopped and what was saved (or the truth when nothing was),
no traceback, exit status 130 or 75. In IPython and in a Jupyter kernel, Ctrl-C stops the
cell with that one line instead of a traceback, and the loop runs on.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ftrain
from ftrain.loop.signals import Interrupted, InterruptedExit, at_a_prompt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def script(work, hooks: str, *signal_at: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(HERE / "says_child.py"), str(work), hooks, *signal_at],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "signame, code, said",
    [
        ("SIGINT", 130, "interrupted at update 5, saved interrupted.pth; run the same call "
                        "again to continue"),
        ("SIGTERM", 75, "interrupted at update 5 (SIGTERM), saved interrupted.pth; run the "
                        "same call again to continue"),
    ],
)  # fmt: skip
def test_a_script_stopped_by_a_signal_says_so_in_one_line_and_resumes(
    tmp_path, signame, code, said
):
    stopped = script(tmp_path, "default", signame, "5")
    assert stopped.returncode == code, stopped.stderr
    assert last_line(stopped.stderr) == said
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    assert stopped.stdout.splitlines()[0] == f"starting fresh (no checkpoint in {tmp_path})"
    assert (tmp_path / "interrupted.pth").is_file()
    resumed = script(tmp_path, "default")
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    assert lines[0] == "resumed from interrupted.pth (update 5, epoch 0)"
    assert lines[-1] == "DONE 8"


def test_the_truth_when_nothing_was_saved(tmp_path):
    bare = script("-", "default", "SIGINT", "5")
    assert bare.returncode == 130
    assert last_line(bare.stderr) == (
        "interrupted at update 5; nothing was saved (the run has no work_dir or no checkpoint "
        "hook), so running it again starts from the beginning"
    )
    assert bare.stdout.splitlines()[0] == "starting fresh"
    periodic = script(tmp_path, "periodic", "SIGTERM", "5")
    assert periodic.returncode == 75
    assert last_line(periodic.stderr) == (
        "interrupted at update 5 (SIGTERM), nothing saved at it; run again with "
        "resume='auto' to continue from iter_4.pth (update 4)"
    )
    assert "Traceback" not in bare.stderr + periodic.stderr


def test_a_resume_is_never_silent_without_a_console(tmp_path):
    stopped = script(tmp_path, "quiet", "SIGINT", "3")
    assert stopped.returncode == 130 and stopped.stdout == ""  # a fresh start says nothing
    resumed = script(tmp_path, "quiet")
    assert resumed.returncode == 0
    assert resumed.stderr.strip() == "resumed from interrupted.pth (update 3, epoch 0)"


def test_the_interrupt_is_a_keyboard_interrupt_that_exits_a_script_with_130():
    """In a script, Ctrl-C is both a KeyboardInterrupt (an ``except`` still catches it) and a
    SystemExit(130); at a prompt only a KeyboardInterrupt (the loop must not end the session)."""
    assert not at_a_prompt()  # pytest runs as a script
    e = InterruptedExit("x")
    assert isinstance(e, KeyboardInterrupt) and isinstance(e, SystemExit) and e.code == 130
    assert not isinstance(Interrupted(), SystemExit)

    def stop(events):
        for ev in events:
            yield ev
            if type(ev).__name__ == "StepEnd" and ev.state.step == 2:
                signal.raise_signal(signal.SIGINT)

    m = torch.nn.Linear(2, 1)
    state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
    lp = ftrain.Loop(ftrain.make_step(lambda m, b: m(b).sum()), state, [torch.ones(1, 2)] * 4,
                     [ftrain.hook(stop, cadence=ftrain.Every(steps=1))])  # fmt: skip
    with pytest.raises(KeyboardInterrupt) as caught:
        lp.run()
    assert type(caught.value) is InterruptedExit and lp.state.step == 2
    assert str(caught.value).startswith("interrupted at update 2; nothing was saved")
    assert lp.run().step == 4  # caught: the loop runs on


# ------------------------------------------------------------------- at a prompt
SETUP = """
import signal, torch, ftrain
torch.manual_seed(0)
m = torch.nn.Linear(2, 1)
state = ftrain.TrainState.create(m, torch.optim.SGD(m.parameters(), lr=0.1))
fired = []
def loss_fn(m, b):
    if len(fired) == 2:  # the third update: Ctrl-C (the stop button) mid-step
        signal.raise_signal(signal.SIGINT)
    fired.append(1)
    return m(b).pow(2).mean()
hooks = ftrain.default_hooks(log_every=2, progress=False, summary=False)
lp = ftrain.Loop(ftrain.make_step(loss_fn), state, [torch.ones(2, 2)] * 6, hooks,
                 max_steps=6, work_dir=WORK, resume="auto")
"""
LINE = (
    "KeyboardInterrupt: interrupted at update 3, saved interrupted.pth; run the same call "
    "again to continue"
)


def test_ipython_stops_the_cell_with_one_line_and_the_loop_runs_on(tmp_path):
    pytest.importorskip("IPython")
    code = textwrap.dedent(f"""
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_cell({SETUP.replace("WORK", repr(str(tmp_path)))!r})
        print("<<<")
        result = shell.run_cell("lp.run()")
        print(">>>", type(result.error_in_exec).__name__)
        shell.run_cell("print('step', lp.run().step)")
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cell = proc.stdout.split("<<<\n", 1)[1].split(">>>")[0]
    assert cell.splitlines()[-1] == LINE, cell  # the whole error: one line
    assert "Traceback" not in cell and "Traceback" not in proc.stderr
    assert ">>> Interrupted" in proc.stdout  # the cell stopped (a Run All stops there)
    assert proc.stdout.strip().splitlines()[-1] == "step 6"  # ... and the loop runs on


def test_a_jupyter_cell_stops_with_one_line_and_the_loop_runs_on(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    stop = nbformat.v4.new_code_cell("lp.run()")
    stop.metadata["tags"] = ["raises-exception"]  # the cell is interrupted: run on after it
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP.replace("WORK", repr(str(tmp_path)))),
        stop,
        nbformat.v4.new_code_cell("print('step', lp.run().step)"),
    ]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    (error,) = [o for o in nb.cells[1].outputs if o["output_type"] == "error"]
    assert error["traceback"] == [LINE]  # no 25-line traceback: the one line
    texts = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "continuing at update 3 (epoch 0)" in texts and texts.strip().endswith("step 6")


@pytest.mark.skipif(importlib.util.find_spec("IPython") is None, reason="needs IPython")
def test_ipython_render_hook_is_what_a_cell_shows():
    assert Interrupted("interrupted at update 3")._render_traceback_() == [
        "KeyboardInterrupt: interrupted at update 3"
    ]
