"""Every notebook in ``notebooks/`` runs top to bottom on a fresh kernel, without errors.

Notebooks are found by glob, so a new one is covered as soon as it is added.
Each runs in its own temporary working directory on a ``python3`` ipykernel
(the interpreter running the tests), with a time limit per cell. They are
committed without outputs; a second test keeps it that way.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: Notebooks whose runs show the logger's progress bar (a tqdm widget: needs ipywidgets,
#: in the ``notebook`` and ``test`` extras).
SHOWS_PROGRESS = {"quickstart", "migration"}
CELL_TIMEOUT_S = 180  # per cell; a whole notebook takes well under a minute on 2 CPU cores


def test_notebooks_exist():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "custom_loop", "memory", "migration"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_has_no_outputs(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} carry outputs; notebooks are committed without outputs "
        f"(clear them: Jupyter's 'Clear All Outputs', or "
        f"jupyter nbconvert --clear-output --inplace {path})"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is needed to execute notebooks")
    pytest.importorskip("ipykernel", reason="ipykernel is needed to execute notebooks")
    pytest.importorskip("matplotlib", reason="the notebooks plot with matplotlib")
    # the kernel inherits the environment: one thread, no GUI backend; progress bars on
    # (issue 16: the notebooks show the logger's progress bar, a widget in Jupyter)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{path.name} failed:\n{exc}", pytrace=False)
    seconds = time.perf_counter() - start
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("output_type") == "error"
    ]
    assert not errors, errors
    if path.stem in SHOWS_PROGRESS:
        widgets = [
            out
            for cell in nb.cells
            if cell.cell_type == "code"
            for out in cell.outputs
            if "application/vnd.jupyter.widget-view+json" in out.get("data", {})
        ]
        assert widgets, f"{path.name}: no progress-bar widget was displayed (is ipywidgets installed?)"
    print(f"{path.name}: {seconds:.1f} s")
