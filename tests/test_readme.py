"""The README's Python examples run as written (in order, in one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)  # the examples write runs/... here
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    state = namespace["state"]
    assert state.step >= 1 and not state.is_consumed
    assert (tmp_path / "runs" / "readme" / "manifest.json").is_file()
    assert list((tmp_path / "runs" / "readme").glob("best_val_loss_iter_*.pth"))
