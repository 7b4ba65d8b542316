"""Prism's hand-written modules keep functions and classes short enough to read whole."""

from __future__ import annotations

import ast
from pathlib import Path

PRISM = Path(__file__).parent.parent.parent / "prism"
# Lines, from the `def` or `class` line to the last line of its body.
MAX_FUNCTION = 80
MAX_CLASS = 300


def hand_written() -> list[Path]:
    # The protobuf stubs (*_pb2.py, *_pb2_grpc.py) are generated.
    return sorted(p for p in PRISM.rglob("*.py") if "_pb2" not in p.name)


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
