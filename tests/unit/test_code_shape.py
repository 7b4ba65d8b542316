"""Prism's hand-written modules keep functions and classes short enough to read whole, and
no two of their classes share a name (a reader, a log or a trace would confuse them)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PRISM = Path(__file__).parent.parent.parent / "prism"
# Lines, from the `def` or `class` line to the last line of its body.
MAX_FUNCTION = 80
MAX_CLASS = 300


def hand_written() -> list[Path]:
    # The protobuf stubs (prism/proto/) are generated.
    return sorted(p for p in PRISM.rglob("*.py") if "proto" not in p.relative_to(PRISM).parts)


def too_long(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind, limit = "function", MAX_FUNCTION
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            where = path.relative_to(PRISM.parent)
            found.append(f"{where}:{node.lineno}: {kind} {node.name}, {length} lines > {limit}")
    return found


def test_no_function_or_class_is_too_long() -> None:
    modules = hand_written()
    assert modules, f"no modules under {PRISM}"
    found = [line for path in modules for line in too_long(path)]
    assert not found, "too long, split it:\n" + "\n".join(found)


def test_no_two_classes_share_a_name() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in hand_written():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(PRISM.parent)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, f"classes sharing a name, rename one: {shared}"
