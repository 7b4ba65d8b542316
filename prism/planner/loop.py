"""The planner's loop: every interval, read the fronts, decide, ask the backend; each
decision logged and counted (`prism_planner_decisions_total{role,reason}`), the replicas
desired and running exported (`prism_planner_replicas{role,state}`)."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from prism import telemetry
from prism.config.planner import (
    DEFAULT_MAX,
    DEFAULT_MIN,
    PlannerConfig,
    PlannerStageConfig,
    role_counts,
)
from prism.modes import Mode, mode
from prism.planner import Backend, observe, open_backend
from prism.planner import decide as rules

log = logging.getLogger("prism.planner")


def bounds(config: PlannerConfig, roles: Iterable[str], started: Mapping[str, int]) -> dict:
    """Each role's bounds: the flags', or the defaults (a maximum no less than the
    replicas it starts with)."""
    roles = list(roles)
    low = role_counts(config.min_replicas, "--min-replicas")
    high = role_counts(config.max_replicas, "--max-replicas")
    for role in {*low, *high} - set(roles):
        raise ValueError(f"this mode has no role {role!r} to plan; its roles: {', '.join(roles)}")
    out = {}
    for role in roles:
        lo = low.get(role, DEFAULT_MIN)
        hi = high.get(role, max(DEFAULT_MAX, started.get(role, 0), lo))
        if lo > hi:
            raise ValueError(f"{role}: --min-replicas {lo} is above --max-replicas {hi}")
        out[role] = rules.Bounds(lo, hi)
    return out


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        mode: Mode,
        backend: Backend,
        fronts: Callable[[], list[str]],
        clock: Callable[[], float] = time.monotonic,
        scrape: Callable[[list[str]], observe.Sample] = observe.scrape,
    ) -> None:
        self.config = config
        self.backend = backend
        self.fronts = fronts
        self.clock = clock
        self.scrape = scrape
        self.roles = rules.roles_of(mode)
        running = {role: backend.replicas(role) for role in self.roles.all}
        self.bounds = bounds(config, self.roles.all, running)
        self.goals = rules.Goals(config.ttft_slo_ms / 1000, config.itl_slo_ms / 1000)
        self.budget = config.replica_budget or sum(b.high for b in self.bounds.values())
        self.state = rules.State({}, {})
        for role, count in running.items():
            # Into its bounds from the start.
            wanted = min(max(count, self.bounds[role].low), self.bounds[role].high)
            self.state.desired[role] = wanted
            if wanted != count:
                self._apply(rules.Change(role, wanted, "bounds"))
        self._last: tuple[float, observe.Sample] | None = None
        self._next = -math.inf

    def poll(self) -> None:
        """Decides if an interval has passed since the last decision."""
        now = self.clock()
        if now >= self._next:
            self._next = now + self.config.planner_interval_s
            self.step(now)

    def step(self, now: float) -> list[rules.Change]:
        """One read of the fronts and the changes it leads to (made already)."""
        try:
            sample = self.scrape(self.fronts())
        except OSError as exc:
            log.warning("planner: cannot read the fronts' metrics: %s", exc)
            return []
        last, self._last = self._last, (now, sample)
        try:
            running = {role: self.backend.replicas(role) for role in self.roles.all}
        except (OSError, RuntimeError) as exc:
            log.warning("planner: cannot read the replicas: %s", exc)
            return []
        self._export(running)
        for role, count in running.items():
            if count < self.state.desired[role]:
                # Asked again: a replica still draining may have held the place a new
                # one needed.
                self._scale(role, self.state.desired[role])
        if last is None:
            return []
        seen = observe.observation(last[1], sample, now - last[0])
        changes = rules.decide(seen, self.goals, self.roles, self.bounds, self.budget, running,
                               self.state, now, self.config.planner_cooldown_s)  # fmt: skip
        for change in changes:
            log.info(
                "planner: %s %d → %d (%s; ttft p90 %s, itl p90 %s, first replies %s, busy %s)",
                change.role, self.state.desired[change.role], change.replicas, change.reason,
                _ms(seen.ttft_s), _ms(seen.itl_s),
                {role: _ms(s) for role, s in (seen.first_reply_s or {}).items()},
                {str(role): round(seen.busy(role), 1) for role in self.roles.all},
            )  # fmt: skip
            self.state.changed_at[change.role] = now
            self._apply(change)
        self._export(running)
        return changes

    def _apply(self, change: rules.Change) -> None:
        self.state.desired[change.role] = change.replicas
        telemetry.PLANNER_DECISIONS.labels(change.role, change.reason).inc()
        self._scale(change.role, change.replicas)

    def _scale(self, role: str, count: int) -> None:
        try:
            self.backend.scale(role, count)
        except (OSError, RuntimeError) as exc:
            log.warning("planner: cannot scale %s: %s", role, exc)

    def _export(self, running: Mapping[str, int]) -> None:
        for role in self.roles.all:
            telemetry.PLANNER_REPLICAS.labels(role, "desired").set(self.state.desired[role])
            telemetry.PLANNER_REPLICAS.labels(role, "running").set(running[role])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def run(config: PlannerStageConfig) -> int:
    """`prism planner`: plans a mesh that another tool deployed, until SIGTERM or SIGINT."""
    if not config.front_metrics:
        raise ValueError("prism planner needs --front-metrics: where the fronts' metrics are")
    backend = open_backend(config.backend)
    fronts = list(config.front_metrics)
    planner = Planner(config.planner, mode(config.mode), backend, lambda: fronts)
    # On every interface, as exporters listen: Prometheus scrapes it from its own pod.
    telemetry.serve_metrics(config.metrics.metrics_port, "")
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    log.info("planner: planning %s (%s) from %s", config.backend, config.mode, ", ".join(fronts))
    while not stopped.wait(0.5):
        planner.poll()
    return 0
