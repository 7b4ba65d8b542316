"""The docs name only what exists: every file path, Python module (and the class or
function named after it), protobuf service or message, and make target they cite. A
rename that leaves a doc behind fails here. Pure: reads files, imports nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
# What runs write (a benchmark's --out), not what the repository holds.
WRITTEN = "bench/results/"
PATH = re.compile(r"(?<![\w/.-])((?:prism|bench|scripts|tests|protos|deploy|examples)/[\w./-]*\w)")
FILE = re.compile(r"(?<![\w/.-])([a-z_]\w*\.py)\b")
DOTTED = re.compile(r"`(prism(?:\.\w+)+)")
TARGET = re.compile(r"`make ([\w-]+)")


def file_names() -> set[str]:
    """The name of every Python file of the repository (not of its environments)."""
    skipped = {".git", ".venv", "node_modules", "__pycache__"}
    tops = [top for top in ROOT.iterdir() if top.is_dir() and top.name not in skipped]
    return {path.name for top in tops for path in top.rglob("*.py")} | {
        path.name for path in ROOT.glob("*.py")
    }


def module_of(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The source of the longest module `parts` starts with, and the names after it."""
    for i in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:i])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                return source, parts[i:]
    return None, parts


def proto_names(package: str) -> set[str]:
    """The services, messages and enums of a protobuf package (prism.v1, prism.stage.v1)."""
    found: set[str] = set()
    for proto in (ROOT / "protos").joinpath(*package.split(".")).glob("*.proto"):
        found |= set(re.findall(r"^\s*(?:service|message|enum)\s+(\w+)", proto.read_text(), re.M))
    return found


def dotted_exists(name: str) -> bool:
    parts = name.split(".")
    package = next((".".join(parts[:i]) for i in (3, 2) if parts[i - 1 : i] == ["v1"]), "")
    if package:
        rest = parts[len(package.split(".")) :]
        return not rest or rest[0] in proto_names(package)
    source, rest = module_of(parts)
    if source is None:
        return False
    if not rest:
        return True
    defined = rf"^\s*(?:class|def|async def)\s+{rest[0]}\b|^{rest[0]}\s*[:=]"
    return re.search(defined, source.read_text(), re.M) is not None


def missing_from(text: str, files: set[str], targets: set[str]) -> list[str]:
    """What `text` names that is not here."""
    paths = [p for p in PATH.findall(text) if not p.startswith(WRITTEN)]
    return [
        *(path for path in paths if not (ROOT / path).exists()),
        *(name for name in FILE.findall(text) if name not in files),
        *(name for name in DOTTED.findall(text) if not dotted_exists(name)),
        *(f"make {name}" for name in TARGET.findall(text) if name not in targets),
    ]


def test_every_path_module_and_target_a_doc_names_exists():
    files = file_names()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    missing = [
        f"{doc.name}: {name}"
        for doc in DOCS
        for name in missing_from(doc.read_text(), files, targets)
    ]
    assert not missing, "named in the docs, but not here:\n" + "\n".join(sorted(set(missing)))
