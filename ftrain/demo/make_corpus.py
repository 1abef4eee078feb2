"""Regenerate ``corpus.txt``, the demo's training text, from the standard library.

The demo never downloads anything: it trains on ``ftrain/demo/corpus.txt``,
which ships with the package. That file was written by this script from the
docstrings and signatures of pure-Python standard-library modules (Python
Software Foundation License), in a pydoc-like layout. It is committed, so the
demo's text does not depend on the Python version it runs under; run this
only to rebuild it::

    python -m ftrain.demo.make_corpus            # writes ftrain/demo/corpus.txt
    python -m ftrain.demo.make_corpus --size 150000 --out /tmp/corpus.txt
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import string
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MODULES", "module_text", "build_corpus", "main"]

#: Well-documented, pure-Python modules, in the order they are written.
MODULES: tuple[str, ...] = (
    "textwrap",
    "string",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "random",
    "contextlib",
    "dataclasses",
    "enum",
    "abc",
    "copy",
    "pprint",
    "difflib",
    "fnmatch",
    "glob",
    "shutil",
    "tempfile",
    "pathlib",
    "argparse",
    "json",
    "csv",
    "configparser",
    "calendar",
    "queue",
    "threading",
    "weakref",
    "base64",
    "gzip",
    "zipfile",
    "tarfile",
    "logging",
    "inspect",
    "typing",
    "subprocess",
    "unittest",
    "email.message",
    "http.client",
    "urllib.parse",
    "ipaddress",
    "datetime",
)

_ALLOWED = set(string.printable) - {"\t", "\r", "\x0b", "\x0c"}
_MAX_PER_MODULE = 12_000
_ADDRESS = re.compile(r"<([^<>]*?) at 0x[0-9a-f]+>")


def _clean(text: str) -> str:
    text = text.replace("\t", "    ")
    return "".join(c for c in text if c in _ALLOWED)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.splitlines())


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    return _ADDRESS.sub(r"<\1>", sig)  # memory addresses differ from run to run


def _entries(module: object, name: str) -> Iterator[str]:
    doc = inspect.getdoc(module)
    if doc:
        yield f"module {name}\n\n{doc}\n"
    public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    for attr in sorted(public):
        obj = getattr(module, attr, None)
        if obj is None or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj):
            doc = inspect.getdoc(obj)
            if doc:
                yield f"class {attr}{_signature(obj)}\n{_indent(doc)}\n"
            for meth_name, meth in sorted(vars(obj).items()):
                if meth_name.startswith("_") or not inspect.isfunction(meth):
                    continue
                doc = inspect.getdoc(meth)
                if doc:
                    yield f"    def {meth_name}{_signature(meth)}\n{_indent(doc, ' ' * 8)}\n"
        elif inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc:
                yield f"def {attr}{_signature(obj)}\n{_indent(doc)}\n"


def module_text(name: str, limit: int = _MAX_PER_MODULE) -> str:
    """The pydoc-like text of module ``name``, at most ``limit`` characters."""
    module = importlib.import_module(name)
    out: list[str] = []
    size = 0
    for entry in _entries(module, name):
        entry = _clean(entry)
        if size + len(entry) > limit:
            break
        out.append(entry)
        size += len(entry) + 1
    return "\n".join(out)


def build_corpus(size: int = 200_000) -> str:
    """About ``size`` characters of standard-library documentation text."""
    parts: list[str] = []
    total = 0
    for name in MODULES:
        try:
            text = module_text(name)
        except ImportError:
            continue
        if not text:
            continue
        parts.append(text)
        total += len(text) + 2
        if total >= size:
            break
    return "\n\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command line: write the corpus file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=200_000, help="target size in characters")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("corpus.txt"), help="output file"
    )
    args = parser.parse_args(argv)
    text = build_corpus(args.size)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {len(text):,} characters, {len(set(text))} distinct, to {args.out}")


if __name__ == "__main__":
    main()
