"""The import contract that keeps vLLM behind prism.engine names its sources one by one
(a forbidden contract on `prism` would take in prism.engine too): every top-level module
of prism but prism.engine must be among them, or a new one could import vLLM unseen.
Pure: reads pyproject.toml and lists prism's modules; imports none of them."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import prism

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_but_the_engine_is_kept_from_vllm() -> None:
    linter = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = (c for c in linter["contracts"] if c["forbidden_modules"] == ["vllm"])
    modules = {f"prism.{module.name}" for module in pkgutil.iter_modules(prism.__path__)}
    assert set(contract["source_modules"]) == modules - {"prism.engine"}
