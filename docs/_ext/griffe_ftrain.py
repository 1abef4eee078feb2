"""A Griffe extension that adapts ftrain's docstrings to mkdocstrings (docs build only).

ftrain's docstrings are Google style with a few reStructuredText habits that
Markdown does not understand. This extension rewrites them while the API
reference is built; the package itself is not touched:

* ``Example:`` section titles become ``Examples:`` so that Griffe parses the
  doctest lines as code (``Example`` alone is an admonition to Griffe, and
  ``>>>`` would render as nested block quotes);
* a doctest written outside an ``Examples:`` section (module docstrings) is
  fenced as ``pycon`` code;
* Sphinx roles (:class:`~ftrain.TrainState`, :func:`loop`...) become
  cross-references to the API reference when the target is rendered there,
  and inline code otherwise (a reference to an object the reference does not
  render would be a warning, which ``mkdocs build --strict`` turns into an
  error);
* a reStructuredText literal-block marker (a line ending in ``::``) loses its
  second colon; the indented block after it stays a Markdown code block.

Which modules the reference renders is read from the ``::: module`` lines of
the pages under ``docs/``, so a new API page needs no change here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

DOCS_DIR = Path(__file__).resolve().parent.parent

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj):`(~?)([^`<>]+?)`")
_EXAMPLE_TITLE = re.compile(r"^(\s*)Example:\s*$")
_SECTION_TITLE = re.compile(r"^(\s*)([A-Z][A-Za-z ]*):\s*$")


def documented_modules(docs_dir: Path = DOCS_DIR) -> set[str]:
    """The module paths rendered by ``::: path`` blocks in the docs pages."""
    found: set[str] = set()
    for page in docs_dir.rglob("*.md"):
        for line in page.read_text(encoding="utf-8").splitlines():
            m = re.match(r"^:::\s+([\w.]+)\s*$", line)
            if m:
                found.add(m.group(1))
    return found


def _public(path: str) -> bool:
    return not any(part.startswith("_") for part in path.split("."))


class FtrainDocstrings(griffe.Extension):
    """Rewrite reST-isms in ftrain docstrings into Markdown mkdocstrings renders."""

    def __init__(self) -> None:
        super().__init__()
        self.modules = documented_modules()

    # ------------------------------------------------------------------ hooks
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "ftrain" or getattr(pkg, "_ftrain_docs_rewritten", False):
            return
        pkg._ftrain_docs_rewritten = True  # once, whichever hook name Griffe calls
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.rewrite(obj.docstring.value, obj)

    on_package_loaded = on_package  # the name of this hook before Griffe 1.14

    # ---------------------------------------------------------------- rewrite
    def rewrite(self, text: str, obj: griffe.Object) -> str:
        text = _ROLE.sub(lambda m: self._role(m, obj), text)
        lines = text.splitlines()
        lines = [_EXAMPLE_TITLE.sub(r"\1Examples:", line) for line in lines]
        lines = _fence_bare_doctests(lines)
        lines = [_literal_marker(line) for line in lines]
        return "\n".join(lines)

    def _role(self, m: re.Match[str], obj: griffe.Object) -> str:
        kind, tilde, target = m.groups()
        target = target.strip()
        shown = target.rsplit(".", 1)[-1] if tilde else target
        if kind in ("func", "meth") and not shown.endswith(")"):
            shown += "()"
        path = self._resolve(target, obj)
        if path is None:
            return f"`{shown}`"
        return f"[`{shown}`][{path}]"

    def _resolve(self, target: str, obj: griffe.Object) -> str | None:
        """The rendered identifier ``target`` refers to, or ``None``."""
        target = target.lstrip(".")
        candidates = []
        if target.startswith("ftrain.") or target == "ftrain":
            candidates.append(target)
        else:  # relative to the object, its class, its module
            scope: griffe.Object | None = obj
            while scope is not None:
                candidates.append(f"{scope.path}.{target}")
                scope = scope.parent
        root = obj.package
        for candidate in candidates:
            try:
                found = root.get_member(candidate.split(".", 1)[1]) if "." in candidate else root
            except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            try:
                final = found.final_target if found.is_alias else found
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return None
            return final.path if self._rendered(final) else None
        return None

    def _rendered(self, obj: Any) -> bool:
        """Whether the API reference renders ``obj`` (so a link to it resolves)."""
        path = obj.path
        if not _public(path):
            return False
        if obj.is_module:
            return path in self.modules
        if not obj.docstring:
            return False
        module = obj.module.path
        if module not in self.modules:
            return False
        exported = getattr(obj.module, "exports", None)
        if exported is None:
            return True
        # before Griffe expands them, exports may be expression objects, not strings
        names = {getattr(e, "name", None) or str(e) for e in exported}
        return path[len(module) + 1 :].split(".", 1)[0] in names


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)


def _literal_marker(line: str) -> str:
    stripped = line.rstrip()
    if stripped.endswith("::") and not stripped.endswith(":::"):
        body = stripped[:-2].rstrip()
        return f"{body}:" if body else ""
    return line


def _fence_bare_doctests(lines: list[str]) -> list[str]:
    """Fence ``>>>`` blocks that are not inside an ``Examples:`` section."""
    out: list[str] = []
    in_examples: int | None = None  # indentation of the current Examples: title
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        title = _SECTION_TITLE.match(line)
        if line.strip() and in_examples is not None and indent <= in_examples:
            in_examples = None
        if title:
            in_examples = indent if title.group(2) == "Examples" else None
        if in_examples is None and line.lstrip().startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][indent:] if len(lines[i]) >= indent else lines[i].lstrip())
                i += 1
            pad = " " * indent
            out.append(f"{pad}```pycon")
            out.extend(f"{pad}{b}" if b else b for b in block)
            out.append(f"{pad}```")
            continue
        out.append(line)
        i += 1
    return out
