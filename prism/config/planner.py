"""The planner's config: its goals, the bounds of each role, its pace (`prism serve
--planner slo`, and `prism planner` beside a mesh it does not start)."""

from __future__ import annotations

from dataclasses import dataclass

from prism.config.common import MetricsConfig
from prism.config.flags import Flags, flag, nested
from prism.modes import MODES

# A role's bounds where --min-replicas and --max-replicas do not name it.
DEFAULT_MIN = 1
DEFAULT_MAX = 4


def role_counts(pairs: list[str], option: str) -> dict[str, int]:
    """`ROLE=N` pairs as a dict; a clear error for any other shape."""
    counts = {}
    for pair in pairs:
        role, sep, count = pair.partition("=")
        if not sep or not role or not count.isdigit():
            raise ValueError(f"{option} takes ROLE=N (N ≥ 0), got {pair!r}")
        counts[role] = int(count)
    return counts


@dataclass
class PlannerConfig(Flags):
    group = "planner (replicas of each role against latency goals)"

    planner: str = flag(
        "none",
        "none: the replica counts given; slo: the planner sets each role's replicas apart "
        "between --min-replicas and --max-replicas against --ttft-slo-ms and --itl-slo-ms",
        choices=("none", "slo"),
    )
    ttft_slo_ms: float = flag(2000.0, "goal for the time to first token (its 90th percentile)")
    itl_slo_ms: float = flag(200.0, "goal for the time between tokens (its 90th percentile)")
    min_replicas: list[str] = flag(
        help=f"fewest replicas of ROLE (default {DEFAULT_MIN})", factory=list, metavar="ROLE=N"
    )
    max_replicas: list[str] = flag(
        help=f"most replicas of ROLE (default {DEFAULT_MAX}, or more if it starts with more)",
        factory=list,
        metavar="ROLE=N",
    )
    replica_budget: int = flag(
        0,
        "most replicas of every role together (0: the sum of the maxima); at the budget, a "
        "role that needs one more takes it from the least busy role",
    )
    planner_interval_s: float = flag(5.0, "seconds between two decisions")
    planner_cooldown_s: float = flag(
        20.0, "seconds a role keeps its replica count after a change, while the change settles"
    )
    warm_spares: int = flag(
        1,
        "prism serve: replicas of each role kept started but NOT_SERVING, for the role to "
        "grow into in the time of a probe instead of a start (0: none)",
    )


@dataclass(kw_only=True)
class PlannerStageConfig(Flags):
    """Everything `prism planner` takes: it plans a mesh another tool deployed."""

    planner: PlannerConfig = nested(PlannerConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
    mode: str = flag("e/p/d", "the deployed mesh's mode: which roles it scales", choices=MODES)
    backend: str = flag(
        help="where the replicas are: kubernetes:///PREFIX (in a pod; PREFIX is `prism "
        "deploy kubernetes --name`) or kubernetes+http://HOST:PORT/PREFIX (kubectl proxy)",
    )
    front_metrics: list[str] = flag(
        help="the fronts' (or processors') /metrics URL, once per front; a host that resolves "
        "to several addresses (a headless Service) is read at each",
        factory=list,
        metavar="URL",
    )
