"""docs/configuration.md is the flag reference that scripts/flag_reference.py renders from
the CLI's own parsers: it must match them as they are now. Pure: builds the parser,
renders, compares; starts nothing."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from prism.cli import build_parser, main
from prism.config.commands import MeshConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "flag_reference.py"


def _load() -> ModuleType:
    # scripts/ is no package: load the script from its file.
    spec = importlib.util.spec_from_file_location("flag_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fr = _load()


def test_configuration_md_is_current():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == fr.render(), (
        "docs/configuration.md is out of date: run `make docs` "
        "(python scripts/flag_reference.py) and commit the result"
    )


def test_every_flag_of_every_command_is_listed():
    from prism.cli import build_parser

    text = fr.render()
    pending = [build_parser()]
    while pending:
        parser = pending.pop()
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, flag
            if isinstance(action, argparse._SubParsersAction):
                pending += action.choices.values()


def test_defaults_read_from_the_environment_do_not_leak(monkeypatch):
    monkeypatch.setitem(os.environ, "PRISM_API_KEY", "not-in-the-docs")
    monkeypatch.setitem(os.environ, "PRISM_HEALTH", "leaked:1")
    text = fr.render()
    assert "not-in-the-docs" not in text
    assert "leaked:1" not in text
    assert os.environ["PRISM_API_KEY"] == "not-in-the-docs"  # the environment is given back


def test_check_mode_reports_a_stale_file(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n")
    assert fr.main(["--check", "--out", str(stale)]) == 1
    assert fr.main(["--out", str(stale)]) == 0
    assert fr.main(["--check", "--out", str(stale)]) == 0


def test_every_flag_of_every_command_says_what_it_does():
    def silent(parser: argparse.ArgumentParser, command: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += silent(sub, f"{command} {name}")
            elif action.option_strings and not action.help:
                found.append(f"{command} {action.option_strings[-1]}")
        return found

    assert silent(build_parser(), "prism") == []


def test_help_shows_each_default_but_never_a_secret(monkeypatch, capsys):
    monkeypatch.setenv("PRISM_API_KEY", "api-s3cret")
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "consul-s3cret")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "(default: epd)" in shown and "(default: 1800.0)" in shown
    assert "s3cret" not in shown
    # Read from the environment all the same.
    config = MeshConfig.from_args(build_parser().parse_args(["serve", "--model", "m"]))
    assert (config.gateway.api_key, config.registry.consul_token) == ("api-s3cret", "consul-s3cret")
