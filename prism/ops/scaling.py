"""The planner's local backend: a role's replicas are stage processes `prism serve` planned.

With the planner on, the launcher plans each role's most replicas (their ports, cores,
GPUs and the static registry's entries) and starts the count it begins with; the
processor finds those not running down at its probes and routes around them. Each role
also keeps `--warm-spares` planned stages started as warm spares (--standby: ready,
NOT_SERVING until SIGUSR1). Scaling up promotes spares first, then starts planned stages
that are not running, and starts new spares in their place; scaling down takes the last ones out of
supervision and stops them as any SIGTERM does (they drain: NOT_SERVING, no new calls,
those in flight finish), in the background, so that supervision goes on meanwhile.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import IO, Protocol

from prism import telemetry
from prism.config.commands import MeshConfig
from prism.modes import MeshRole, mode
from prism.ops.plan import plan
from prism.ops.stage_process import StageProcess
from prism.ops.supervisor import Spawner, Supervisor
from prism.planner.decide import roles_of
from prism.planner.loop import Planner, bounds
from prism.runtime import processes
from prism.runtime.ports import free_port

# Each role's replica count in `prism serve`'s flags.
_COUNTS = {
    MeshRole.ENCODER: "encoders",
    MeshRole.WORKER: "workers",
    MeshRole.PREFILL: "prefill_workers",
    MeshRole.DECODE: "decode_workers",
}
# Beyond a stage's own drain (--shutdown-grace-s), before it is killed.
_STOP_GRACE_S = 60.0
# A warm spare's flag: started and ready, NOT_SERVING until SIGUSR1.
_STANDBY = "--standby"


class StageHost(Spawner, Protocol):
    """What the local backend needs of the mesh that runs the stages: its planned stages,
    and starting one. The launcher's Mesh is one; a protocol, so that the launcher imports
    this module and not the other way round."""

    stages: list[StageProcess]


def planned(config: MeshConfig) -> tuple[MeshConfig, dict[str, int]]:
    """The mesh to plan (each role at its most replicas) and the replicas each role
    starts with: those asked for, within the role's bounds."""
    roles = roles_of(mode(config.serve.mode)).all
    asked = {role: getattr(config.serve, _COUNTS[role]) for role in roles}
    limits = bounds(config.planner, roles, asked)
    start = {role: min(max(asked[role], limits[role].low), limits[role].high) for role in roles}
    most = {_COUNTS[role]: limits[role].high for role in roles}
    return dataclasses.replace(config, serve=dataclasses.replace(config.serve, **most)), start


def plan_mesh(config: MeshConfig) -> tuple[list[StageProcess], list[StageProcess]]:
    """Every stage the planner may run, and those the mesh starts with."""
    most, start = planned(config)
    stages = plan(most)
    starting = [
        stage for stage in stages
        if role_of(stage) not in start
        or int(stage.name.rpartition("-")[2]) < start[role_of(stage)]
    ]  # fmt: skip
    return stages, starting


def start(config: MeshConfig, mesh: StageHost, supervisor: Supervisor) -> tuple[Planner, str]:
    """The planner of a started mesh, and the URL of its metrics (on a free port)."""
    host = config.serve.host
    port = free_port(host)
    telemetry.serve_metrics(port, host)
    backend = LocalBackend(mesh, mesh.stages, supervisor, spares=config.planner.warm_spares)
    # The fronts' (or the split front's processor's): each sees its requests end to end.
    fronts = [s.metrics_url for s in mesh.stages if role_of(s) in ("front", "processor")]
    planner = Planner(config.planner, mode(config.serve.mode), backend, lambda: fronts)
    for role in planner.roles.all:
        backend.refill(role)
    return planner, f"http://{host}:{port}/metrics"


def role_of(stage: StageProcess) -> str:
    """`worker` of `worker-1`; a stage of its own (`front`) is its own role."""
    return stage.name.rpartition("-")[0] or stage.name


class LocalBackend:
    def __init__(
        self, mesh: Spawner, stages: list[StageProcess], supervisor: Supervisor,
        output: IO | None = None, spares: int = 0,
    ) -> None:  # fmt: skip
        self.mesh = mesh
        self.stages = stages
        self.supervisor = supervisor
        self.output = output
        self.spares = spares
        self._standby: list[StageProcess] = []

    def _watched(self, role: str) -> list[StageProcess]:
        return [s for s in self.supervisor.stages if role_of(s) == role]

    def _spares(self, role: str) -> list[StageProcess]:
        """The role's warm spares still running."""
        self._standby = [s for s in self._standby if _running(s)]
        return [s for s in self._standby if role_of(s) == role]

    def _free(self, role: str) -> list[StageProcess]:
        """The role's planned stages neither watched (a crashed one is restarted) nor
        running: not one still draining, whose port is not free yet."""
        watched = self._watched(role)
        return [
            s for s in self.stages if role_of(s) == role and s not in watched and not _running(s)
        ]  # fmt: skip

    def replicas(self, role: str) -> int:
        return len(self._watched(role))

    def scale(self, role: str, count: int) -> None:
        watched = self._watched(role)
        wanted = count - len(watched)
        for stage in self._spares(role)[: max(0, wanted)]:
            self._standby.remove(stage)
            assert stage.process is not None
            stage.process.send_signal(signal.SIGUSR1)
            # Started again after a crash, it serves at once.
            stage.argv.remove(_STANDBY)
            self.supervisor.watch(stage)
            wanted -= 1
        for stage in self._free(role)[: max(0, wanted)]:
            self.mesh.spawn(stage, self.output)
            self.supervisor.watch(stage)
        for stage in watched[count:]:
            self.supervisor.release(stage)
            if stage.process is not None:
                threading.Thread(
                    target=processes.stop, args=(stage.process, _STOP_GRACE_S), daemon=True
                ).start()
        self.refill(role)

    def refill(self, role: str) -> None:
        """Starts warm spares of `role` until it has `spares`, as its planned stages allow."""
        for stage in self._free(role)[: max(0, self.spares - len(self._spares(role)))]:
            stage.argv.append(_STANDBY)
            self.mesh.spawn(stage, self.output)
            self._standby.append(stage)


def _running(stage: StageProcess) -> bool:
    return stage.process is not None and stage.process.poll() is None
