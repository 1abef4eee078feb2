"""The documentation site builds with ``mkdocs build --strict`` (no warnings).

The build renders the API reference from the package's docstrings, so a
docstring that mkdocstrings cannot parse, a cross-reference to an object that
is not documented, or a broken link between pages fails this test.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEEDED = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings": "mkdocstrings[python]",
    "mkdocstrings_handlers.python": "mkdocstrings[python]",
}


def _missing() -> list[str]:
    missing = []
    for module, package in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found and package not in missing:
            missing.append(package)
    return missing


def _load_extension():
    pytest.importorskip("griffe", reason="griffe comes with mkdocstrings[python]")
    path = ROOT / "docs" / "_ext" / "griffe_ftrain.py"
    spec = importlib.util.spec_from_file_location("griffe_ftrain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict(tmp_path):
    missing = _missing()
    if missing:
        pytest.skip(f"documentation tools not installed: pip install {' '.join(missing)}")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a warning
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    # the API reference was rendered from docstrings, with cross-references resolved
    core = (site / "api" / "core" / "index.html").read_text(encoding="utf-8")
    assert 'id="ftrain.state.TrainState"' in core
    assert 'href="#ftrain.errors.StaleStateError"' in core
    for page in ("index.html", "getting-started/index.html", "migration/index.html"):
        assert (site / page).is_file(), page
    print(f"mkdocs build --strict: {seconds:.1f} s")


def test_docstring_rewrites():
    """The docs build's Griffe extension turns reST-isms into Markdown mkdocstrings renders."""
    ext = _load_extension()
    griffe = pytest.importorskip("griffe")
    pkg = griffe.load("ftrain", search_paths=[str(ROOT)])
    rewriter = ext.FtrainDocstrings()
    obj = pkg["transforms.base"]
    text = rewriter.rewrite(
        "See :class:`~ftrain.step.Step` and :func:`loop`, not :mod:`json`.\n\n"
        "Example:\n    >>> 1 + 1\n    2\n\nA diagram::\n\n    a -> b\n",
        obj,
    )
    assert "[`Step`][ftrain.step.Step]" in text
    assert "`json`" in text and "[`json`]" not in text
    assert "Examples:" in text and "Example:\n" not in text
    assert "A diagram:\n" in text
    bare = rewriter.rewrite("Intro.\n\n>>> x = 1\n>>> x\n1\n\nAfter.", obj)
    assert "```pycon\n>>> x = 1\n>>> x\n1\n```" in bare


def test_getting_started_examples_run(tmp_path, monkeypatch, capsys):
    """docs/getting-started.md's Python blocks run as written, in order (issue 21: section 6
    after section 5 raised CheckpointError; "train longer" ran 70 updates at lr 0)."""
    import re
    import warnings

    import torch

    page = ROOT / "docs" / "getting-started.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 7
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    namespace: dict = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="with_schedule: .* past its end")
            for i, code in enumerate(blocks):
                exec(compile(code, f"docs/getting-started.md python block {i + 1}", "exec"),  # noqa: S102
                     namespace)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert namespace["state"].step == 140 and namespace["lp"].resumed_from.name == "iter_140.pth"
    lrs = [r["lr"] for r in namespace["records"] if "lr" in r]
    assert lrs and all(lr > 0 for lr in lrs)
    said = [line for line in capsys.readouterr().out.splitlines() if "fresh" in line or
            line.startswith("resumed from")]  # fmt: skip
    assert said == [
        "starting fresh",
        "resumed from iter_70.pth (update 70, epoch 4)",  # saved before the epoch's end
        "resumed from iter_70.pth (update 70, epoch 5)",  # saved again once it ended
        "resumed from iter_140.pth (update 140, epoch 9)",
    ]
