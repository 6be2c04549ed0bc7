"""A sample corpus that needs no download: the Python standard library's own source text.

One job: write a deterministic jsonl corpus (`{"text": ..., "source": ...}` a line) whose
documents have realistic, heavy-tailed lengths: module docstrings and every top-level
function and class of the standard library (a one-line helper is ~100 bytes, a big class is
~100 KB; ~1,400 bytes on average), from files visited in a seeded order, shuffled with the
seed and cut at `max_bytes`. With `methods_apart` each method of a top-level class is a
document of its own and the rest of the class (header, docstring, attributes) another:
~480 bytes on average, still heavy-tailed, so a 256-token row holds an EoD about 2.5 times
as often (the quickstart's choice; the benchmarks keep the default). The same Python
version gives the same file byte for byte; another version's stdlib gives another (equally
shaped) corpus.

What it does not do: no tokenization (that is `preprocess.py`), no network.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

__all__ = ["iter_stdlib_documents", "write_sample_corpus"]

# Folders left out: tests and demos (repetitive, huge), vendored wheels, third-party packages.
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
               "turtledemo", "__pycache__", "_bundled", "ensurepip"}


def _stdlib_sources() -> List[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not _SKIP_PARTS.intersection(p.relative_to(root).parts))


def iter_stdlib_documents(seed: int = 0, methods_apart: bool = False
                          ) -> Iterator[Tuple[str, str]]:
    """Yield (source, text): each module docstring and each top-level def/class source
    (with `methods_apart`, a class's methods and its remaining lines apart), visiting the
    files in an order shuffled by `seed`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = _stdlib_sources()
    random.Random(seed).shuffle(paths)
    for path in paths:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue  # a few files are deliberately broken or not UTF-8
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        docstring = ast.get_docstring(tree)
        if docstring:
            yield module, docstring
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and methods_apart:
                yield from _class_apart(f"{module}:{node.name}", node, lines)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first, last = _line_span(node)
                yield f"{module}:{node.name}", "".join(lines[first - 1:last]).rstrip()


def _line_span(node) -> Tuple[int, int]:
    """1-based first (decorators included) and last line of a definition. Definitions start
    a line, so whole lines are exact (and much faster than ast.get_source_segment, which
    re-splits the file every call)."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def _class_apart(name: str, node: ast.ClassDef, lines: List[str]) -> Iterator[Tuple[str, str]]:
    """Each method of the class (dedented), then the class without its methods (if more than
    a bare header is left: a docstring, attributes, nested classes)."""
    first, last = _line_span(node)
    rest = set(range(first, last + 1))
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            begin, end = _line_span(child)
            rest -= set(range(begin, end + 1))
            text = "".join(_unindent(line, child.col_offset) for line in lines[begin - 1:end])
            yield f"{name}.{child.name}", text.rstrip()
    kept = "".join(lines[i - 1] for i in sorted(rest)).rstrip()
    if len(kept.splitlines()) > 1:
        yield name, kept


def _unindent(line: str, columns: int) -> str:
    """`line` without up to `columns` leading blanks: a method's own indentation, also where
    one of its lines starts further left (a comment or a string's line at column 0, which
    makes textwrap.dedent remove nothing)."""
    blanks = len(line) - len(line.lstrip(" \t"))
    return line[min(blanks, columns):]


def write_sample_corpus(path: str, max_bytes: int = 8_000_000, seed: int = 1234,
                        methods_apart: bool = False) -> Dict[str, int]:
    """Write the corpus as jsonl; returns {"documents", "bytes"} of what was written."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    # Parse files in a shuffled order only until twice the budget is collected (the whole
    # stdlib holds ~8 MB of such text), then shuffle documents so one file's are not adjacent.
    docs = []
    collected = 0
    for doc in iter_stdlib_documents(seed, methods_apart):
        docs.append(doc)
        collected += len(doc[1])
        if collected >= 2 * max_bytes:
            break
    random.Random(seed).shuffle(docs)
    written = n_bytes = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for source, text in docs:
            size = len(text.encode("utf-8"))
            if n_bytes + size > max_bytes and written:
                break
            out.write(json.dumps({"text": text, "source": source}) + "\n")
            written += 1
            n_bytes += size
    return {"documents": written, "bytes": n_bytes}
