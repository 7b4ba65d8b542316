"""A stage forked from the launcher's template (prism.ops.template) is what a spawned one
is: its environment, directory, cores, process group, command line and output, its exit
status as `subprocess.Popen` reports it, and it ends with the template."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import psutil
import pytest
from support.waiting import wait_for

from prism.ops.template import MODULES, Forked, Template
from prism.runtime.ports import free_port


@pytest.fixture(scope="module")
def template() -> Iterator[Template]:
    made = Template(MODULES["gateway"])
    yield made
    made.close()


def gateway(*flags: str) -> tuple[list[str], int]:
    port = free_port()
    argv = [sys.executable, "-m", "prism.cli", "--log-level", "info", "gateway",
            "--port", str(port), *flags]  # fmt: skip
    return argv, port


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def stopped(stage: Forked) -> Iterator[Forked]:
    try:
        yield stage
    finally:
        stage.kill()
        stage.wait(30)
        stage.stdout.close()


def test_a_forked_stage_has_its_environment_directory_cores_and_group(
    template, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    core = {sorted(os.sched_getaffinity(0))[-1]}
    argv, port = gateway()
    env = {**os.environ, "PRISM_API_KEY": "forked-key"}
    with stopped(template.spawn(argv, env, core)) as stage:
        assert wait_for(lambda: listening(port), timeout=60)
        process = psutil.Process(stage.pid)
        assert process.ppid() == template.process.pid
        assert " ".join(process.cmdline()).strip() == " ".join(argv)
        assert process.name() == os.path.basename(sys.executable)
        assert process.cwd() == str(tmp_path)
        assert set(process.cpu_affinity()) == core
        assert os.getpgid(stage.pid) == stage.pid
        # The environment it was given, not the template's: the gateway asks for the key.
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        with pytest.raises(subprocess.TimeoutExpired):
            stage.wait(0.1)
        assert stage.poll() is None
        stage.terminate()
        # As a spawned gateway ends on SIGTERM (prism.cli).
        assert stage.wait(60) == 128 + signal.SIGTERM
        assert f":{port}" in stage.stdout.read()


def test_exit_statuses_are_popens(template):
    # A child that ends at once is still the launcher's to watch (the template reaps it
    # only once the launcher holds its pidfd).
    for _ in range(10):
        with stopped(template.spawn(gateway("--no-such-flag")[0], dict(os.environ), set())) as bad:
            assert bad.wait(60) == 2
            assert "unrecognized arguments: --no-such-flag" in bad.stdout.read()
    argv, port = gateway()
    with stopped(template.spawn(argv, dict(os.environ), set())) as killed:
        assert wait_for(lambda: listening(port), timeout=60)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
        killed.send_signal(signal.SIGTERM)  # gone: nothing to signal, and no error
        assert killed.poll() == -signal.SIGKILL


def test_stages_end_with_their_template():
    own = Template(MODULES["gateway"])
    try:
        argv, port = gateway()
        with stopped(own.spawn(argv, dict(os.environ), set())) as stage:
            assert wait_for(lambda: listening(port), timeout=60)
            own.process.kill()
            assert stage.wait(60) is not None
            assert not psutil.pid_exists(stage.pid) or psutil.Process(stage.pid).status() == (
                psutil.STATUS_ZOMBIE
            )
    finally:
        own.close()
