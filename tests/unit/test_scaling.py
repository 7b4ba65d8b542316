"""The planner's local backend and its warm spares, with no process: a made-up mesh whose
processes record the signals they get, and a stage server's health held back while it
stands by."""

from __future__ import annotations

import asyncio
import signal

from prism.ops.scaling import LocalBackend
from prism.ops.stage_process import StageProcess
from prism.ops.supervisor import Supervisor
from prism.rpc.server import Server


class FakeProcess:
    pid = 0

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


class FakeMesh:
    def __init__(self) -> None:
        self.spawned: list[tuple[str, bool]] = []

    def spawn(self, stage: StageProcess, log: object = None) -> None:
        self.spawned.append((stage.name, "--standby" in stage.argv))
        stage.process = FakeProcess()


def test_a_role_grows_into_its_warm_spare_first_and_a_new_spare_takes_its_place(monkeypatch):
    stopped = []
    monkeypatch.setattr("prism.ops.scaling.processes.stop", lambda p, grace: stopped.append(p))
    stages = [StageProcess(f"worker-{i}", "", ["worker"], lambda: True) for i in range(4)]
    mesh = FakeMesh()
    mesh.spawn(stages[0])
    supervisor = Supervisor(mesh, [stages[0]])
    backend = LocalBackend(mesh, stages, supervisor, spares=1)
    backend.refill("worker")
    assert mesh.spawned[1:] == [("worker-1", True)]
    assert backend.replicas("worker") == 1  # a spare is not a replica
    spare = stages[1].process
    backend.scale("worker", 3)
    # The spare serves (SIGUSR1; a restart serves at once), one more starts cold, and a
    # new spare takes the spare's place.
    assert spare.signals == [signal.SIGUSR1]
    assert stages[1].argv == ["worker"]
    assert mesh.spawned[2:] == [("worker-2", False), ("worker-3", True)]
    assert backend.replicas("worker") == 3
    # Down to one: the last two drain away; the spare stays.
    backend.scale("worker", 1)
    assert stopped == [stages[1].process, stages[2].process]
    assert backend.replicas("worker") == 1
    # A spare that died is replaced at the next change, by a stage that is not running.
    stages[3].process.returncode = -9
    for stage in stages[1:3]:
        stage.process.returncode = 0  # drained
    backend.scale("worker", 1)
    assert mesh.spawned[4:] == [("worker-1", True)]


class FakeHealth:
    def __init__(self) -> None:
        self.status: dict[str, int] = {}

    async def set(self, name: str, status: int) -> None:
        self.status[name] = status


def test_a_warm_spare_reports_serving_only_once_promoted():
    async def scenario() -> list[dict]:
        health = FakeHealth()
        server = Server(server=None, health=health, port=0, standby=True)  # type: ignore[arg-type]
        seen = []
        await server.set_serving(["prism.v1.Engine"])  # ready, held back
        seen.append(dict(health.status))
        await server.promote()
        seen.append(dict(health.status))
        return seen

    held, promoted = asyncio.run(scenario())
    assert held == {}
    assert set(promoted.values()) == {1}  # SERVING, for the server and its service
    assert set(promoted) == {"", "prism.v1.Engine"}
