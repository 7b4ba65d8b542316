"""The local backend: a role's replicas are stage processes `prism serve` planned.

With the planner on, the launcher plans each role's most replicas (their ports, cores,
GPUs and the static registry's entries) and starts the count it begins with; the
processor finds those not running down at its probes and routes around them. Scaling up
starts planned stages that are not running; scaling down takes the last ones out of
supervision and stops them as any SIGTERM does (they drain: NOT_SERVING, no new calls,
those in flight finish), in the background, so that supervision goes on meanwhile.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import IO, TYPE_CHECKING

from prism import telemetry
from prism.config.stages import MeshConfig
from prism.modes import MeshRole, mode
from prism.ops.plan import plan
from prism.ops.stage_process import StageProcess
from prism.ops.supervisor import Spawner, Supervisor
from prism.planner.decide import roles_of
from prism.planner.loop import Planner, bounds
from prism.runtime import processes
from prism.runtime.ports import free_port

if TYPE_CHECKING:
    from prism.ops.launcher import Mesh

# Each role's replica count in `prism serve`'s flags.
_COUNTS = {
    MeshRole.ENCODER: "encoders",
    MeshRole.WORKER: "workers",
    MeshRole.PREFILL: "prefill_workers",
    MeshRole.DECODE: "decode_workers",
}
# Beyond a stage's own drain (--shutdown-grace-s), before it is killed.
_STOP_GRACE_S = 60.0


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


def start(config: MeshConfig, mesh: Mesh, supervisor: Supervisor) -> tuple[Planner, str]:
    """The planner of a started mesh, and the URL of its metrics (on a free port)."""
    host = config.serve.host
    port = free_port(host)
    telemetry.serve_metrics(port, host)
    backend = LocalBackend(mesh, mesh.stages, supervisor)
    # The fronts' (or the split front's processor's): each sees its requests end to end.
    fronts = [s.metrics_url for s in mesh.stages if role_of(s) in ("front", "processor")]
    planner = Planner(config.planner, mode(config.serve.mode), backend, lambda: fronts)
    return planner, f"http://{host}:{port}/metrics"


def role_of(stage: StageProcess) -> str:
    """`worker` of `worker-1`; a stage of its own (`front`) is its own role."""
    return stage.name.rpartition("-")[0] or stage.name


class LocalBackend:
    def __init__(
        self, mesh: Spawner, stages: list[StageProcess], supervisor: Supervisor,
        output: IO | None = None,
    ) -> None:  # fmt: skip
        self.mesh = mesh
        self.stages = stages
        self.supervisor = supervisor
        self.output = output

    def _watched(self, role: str) -> list[StageProcess]:
        return [s for s in self.supervisor.stages if role_of(s) == role]

    def replicas(self, role: str) -> int:
        return len(self._watched(role))

    def scale(self, role: str, count: int) -> None:
        watched = self._watched(role)
        if count > len(watched):
            # Not a stage still draining: its port is not free yet.
            free = [
                s for s in self.stages
                if role_of(s) == role and s not in watched
                and (s.process is None or s.process.poll() is not None)
            ]  # fmt: skip
            for stage in free[: count - len(watched)]:
                self.mesh.spawn(stage, self.output)
                self.supervisor.watch(stage)
        for stage in watched[count:]:
            self.supervisor.release(stage)
            if stage.process is not None:
                threading.Thread(
                    target=processes.stop, args=(stage.process, _STOP_GRACE_S), daemon=True
                ).start()
