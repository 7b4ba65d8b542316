"""The import contracts name prism's top-level modules one by one: that which keeps vLLM
behind prism.engine (a forbidden contract on `prism` would take in prism.engine too) and
the layers, so every one but prism.engine must be among the first's sources, and every one
in a layer, or a new module could import vLLM, or upwards, unseen. And no module outside
prism.engine reads a private attribute of vLLM's. Pure: reads pyproject.toml and prism's
sources; imports none of them."""

from __future__ import annotations

import ast
import pkgutil
import tomllib
from pathlib import Path

import prism

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_but_the_engine_is_kept_from_vllm() -> None:
    linter = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = (c for c in linter["contracts"] if c.get("forbidden_modules") == ["vllm"])
    modules = {f"prism.{module.name}" for module in pkgutil.iter_modules(prism.__path__)}
    assert set(contract["source_modules"]) == modules - {"prism.engine"}


def test_every_module_stands_in_a_layer() -> None:
    linter = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = (c for c in linter["contracts"] if c["type"] == "layers")
    layered = {m.strip() for layer in contract["layers"] for m in layer.split("|")}
    assert layered == {f"prism.{module.name}" for module in pkgutil.iter_modules(prism.__path__)}


# Private attributes of other libraries that Prism reads outside prism.engine, each where
# no public way exists; anything else private that Prism does not define itself would be
# vLLM's, whose internals are called from prism.engine only.
OTHER_LIBRARIES = {
    "_SubParsersAction": "argparse: the type of add_subparsers()",
    "_action_groups": "argparse: a parser's groups, to order --help",
    "_actions": "argparse: a parser's arguments, its subcommands among them",
    "_get_num_multimodal_tokens": "transformers: an HF processor's token counts",
    "_get_feat_extract_output_lengths": "transformers: an audio tower's output lengths",
    "_replace": "namedtuple's public copy-with-changes",
    "_bindings": "NIXL's native agent (prism.transfer.nixl_compat, its one workaround)",
}


def _modules() -> list[Path]:
    package = ROOT / "prism"
    return [p for p in package.rglob("*.py") if "proto" not in p.relative_to(package).parts]


def test_no_module_outside_the_engine_calls_a_private_vllm_attribute() -> None:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _modules()}
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    engine = ROOT / "prism" / "engine"
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path, tree in trees.items()
        if not path.is_relative_to(engine)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own | OTHER_LIBRARIES.keys()
    ]
    assert not found, "private attributes of a library, call them from prism.engine:\n" + "\n".join(
        found
    )
