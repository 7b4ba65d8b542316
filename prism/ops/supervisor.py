"""`prism serve`'s supervision: a stage that exits is started again at its address.

As a process supervisor (systemd, Kubernetes' kubelet) does: after a backoff that doubles
with each recent exit, and only so many times within a window; a stage that keeps dying
ends the mesh with the reason. While a stage is down, the stages that call it see it
gone (their readiness drops, requests go to other replicas or migrate); once it is back
at the same address they reconnect by themselves.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Protocol

from prism.ops.stage_process import StageProcess
from prism.runtime.processes import exit_reason, kill_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    # More than `limit` exits of one stage within `window_s` seconds: the mesh gives up.
    limit: int = 5
    window_s: float = 300.0
    # The wait before a restart: `backoff_s`, doubled for each other exit in the window.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, recent_exits: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, recent_exits - 1))


class GaveUp(RuntimeError):
    """A stage exited more often than its restart policy allows."""


class Spawner(Protocol):
    def spawn(self, stage: StageProcess, log: IO | None = None) -> None: ...


@dataclass
class _Record:
    exits: collections.deque[float] = field(default_factory=collections.deque)
    # When the stage is to be started again; None while it runs.
    restart_at: float | None = None
    # Started again and not yet healthy.
    recovering: bool = False


class Supervisor:
    """Watches `stages` (started by `mesh`) and restarts those that exit; `poll` often."""

    def __init__(
        self,
        mesh: Spawner,
        stages: list[StageProcess],
        policy: RestartPolicy | None = None,
        output: IO | None = None,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[str], None] = log.warning,
    ) -> None:
        self.mesh = mesh
        self.stages = stages
        self.policy = policy or RestartPolicy()
        self.output = output
        self.clock = clock
        self.report = report
        self._records = {stage.name: _Record() for stage in stages}
        self.restarts = 0

    def watch(self, stage: StageProcess) -> None:
        """Watches `stage` too (a replica the planner started), from a clean record."""
        self._records[stage.name] = _Record()
        if stage not in self.stages:
            self.stages.append(stage)

    def release(self, stage: StageProcess) -> None:
        """Watches `stage` no more: it is to exit (a replica the planner stops)."""
        self.stages.remove(stage)
        del self._records[stage.name]

    def down(self) -> list[str]:
        """The stages not running, or started again and not yet healthy."""
        return [
            name for name, record in self._records.items()
            if record.restart_at is not None or record.recovering
        ]  # fmt: skip

    def poll(self) -> None:
        """Restarts what is due; raises GaveUp when a stage exits once too often."""
        now = self.clock()
        for stage in self.stages:
            record = self._records[stage.name]
            if record.restart_at is not None:
                if now >= record.restart_at:
                    record.restart_at = None
                    record.recovering = True
                    self.restarts += 1
                    self.mesh.spawn(stage, self.output)
                continue
            code = stage.process.poll() if stage.process is not None else None
            if code is None:
                if record.recovering and stage.healthy():
                    record.recovering = False
                    self.report(f"{stage.name} is serving again")
                continue
            self._exited(stage, record, code, now)

    def _exited(self, stage: StageProcess, record: _Record, code: int, now: float) -> None:
        # A stage's children (vLLM's engine core) outlive it otherwise, holding memory.
        kill_group(stage.process)
        record.recovering = False
        record.exits.append(now)
        while record.exits and record.exits[0] < now - self.policy.window_s:
            record.exits.popleft()
        exits = len(record.exits)
        if exits > self.policy.limit:
            raise GaveUp(
                f"{stage.name} exited ({exit_reason(code)}) {exits} times in "
                f"{self.policy.window_s:.0f} s; giving up"
            )
        delay = self.policy.delay(exits)
        record.restart_at = now + delay
        self.report(
            f"{stage.name} exited ({exit_reason(code)}); restarting it in {delay:.0f} s "
            f"({exits} of {self.policy.limit} restarts in {self.policy.window_s:.0f} s)"
        )
