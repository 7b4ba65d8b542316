"""The unit lane's two rules, a pytest plugin (tests/conftest.py's `pytest_plugins`): the
lane stays pure logic and in-process servers, quick to import and to run.

A unit test that starts a process fails. And the lane, run alone (`make test-unit`, or
any selection of its tests), loads neither torch nor vLLM: the session fails, naming the
test module or test that first loaded one. Code that needs them is tested in
tests/contract. Under `make test` the other lanes load them, so nothing is judged there.

A plugin, loaded before the other plugins and every lane's modules, so that it sees what
loaded a HEAVY module first, wherever that was.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HEAVY = ("torch", "vllm")
UNIT = Path(__file__).parent.parent / "unit"


@dataclass
class _Heavy:
    """Whether this session is the unit lane alone, and what first loaded a HEAVY module."""

    judged: bool = False
    # (names, where): the HEAVY modules loaded, and the test module or test that loaded them.
    loaded: tuple[str, str] | None = None

    def look(self, where: str) -> None:
        if self.loaded is None:
            names = " and ".join(name for name in HEAVY if name in sys.modules)
            if names:
                self.loaded = (names, where)


_heavy = _Heavy()
# Loaded before any unit test module: the blame lies with a plugin or tests/conftest.py.
_heavy.look("a plugin or tests/conftest.py, before the unit tests")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeps the unit lane fast and self-contained: a test there that starts a process
    fails, and belongs in tests/contract or tests/e2e."""
    if not request.path.is_relative_to(UNIT):
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test started a process: move it to tests/e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A module's report comes right after its import: a heavy import at its top shows here.
    _heavy.look(report.nodeid)


def pytest_runtest_logfinish(nodeid: str) -> None:
    _heavy.look(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Before -k, -m and --deselect drop items: what was collected (imported) decides.
    _heavy.judged = bool(items) and all(item.path.is_relative_to(UNIT) for item in items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _heavy.judged and _heavy.loaded is not None:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _heavy.judged and _heavy.loaded is not None:
        names, where = _heavy.loaded
        terminalreporter.write_sep("=", f"the unit lane loaded {names}", red=True)
        terminalreporter.write_line(
            f"first by {where}: import {names} lazily in prism where only some paths need "
            "them, or move the test to tests/contract"
        )
