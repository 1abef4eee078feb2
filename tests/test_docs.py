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
