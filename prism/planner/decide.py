"""The planner's rules: from what one interval showed, which role gets a replica more or
one less. Pure, so that every rule is tested without a mesh.

- A goal missed: the time to first token's 90th percentile above its goal gives the
  role on its path whose calls took longest to their first reply one more replica (the
  encoders for a burst of images, the prefills or workers for long prompts); the time
  between tokens above its goal gives the role that decodes one more.
- Both goals met with room (below `headroom` of each), or no request at all: the least
  busy role above its minimum (busy: the calls open on it, on average, per replica) gives
  one up, unless the replicas left would take about as many calls a second each as when a
  replica it gave up before was missed (a goal missed, the role to blame, within
  `WATCH_COOLDOWNS` cool-downs of giving it up: a queue takes a while to build). Calls a
  second, not calls open: those count the queue too, and a queue draining would make any
  load look unsafe. A role's calls a second are its most over that window, as Kubernetes'
  autoscaler steadies its scale-down over a window, and a role gives up one replica a
  window at most. Without that memory a role would give its replica back at every quiet
  interval and miss again. One role a step, so that the next interval shows what the
  change did.
- At the replica budget, a role that needs one more takes it from the least busy role.
- A role changes again only after the cool-down, and only once its last change is done
  (the replicas asked for are running).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prism.modes import MeshRole, Mode


@dataclass(frozen=True)
class Goals:
    ttft_s: float
    itl_s: float
    # Replicas go only while both percentiles stay below this share of their goals.
    headroom: float = 0.5


@dataclass(frozen=True)
class Bounds:
    low: int
    high: int


@dataclass(frozen=True)
class Observation:
    """What the fronts saw over one interval of `seconds`."""

    seconds: float
    # Requests that got their first token.
    first_tokens: int = 0
    # 90th percentiles; None where nothing was measured.
    ttft_s: float | None = None
    itl_s: float | None = None
    # Per role: its calls, their mean time to a first reply, and the seconds calls that
    # ended were open.
    calls: Mapping[str, int] | None = None
    first_reply_s: Mapping[str, float] | None = None
    open_s: Mapping[str, float] | None = None

    def busy(self, role: str) -> float:
        """Calls open on `role`, on average (Little's law)."""
        return (self.open_s or {}).get(role, 0.0) / self.seconds


@dataclass(frozen=True)
class Roles:
    """The roles the time to first token passes through, and the one that decodes."""

    first_token: tuple[str, ...]
    decode: str

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.first_token, self.decode)))


def roles_of(mode: Mode) -> Roles:
    prompt = MeshRole.PREFILL if mode.disaggregated else MeshRole.WORKER
    encoder = (MeshRole.ENCODER,) if mode.has_encoder else ()
    decode = MeshRole.DECODE if mode.disaggregated else MeshRole.WORKER
    return Roles((*encoder, prompt), decode)


@dataclass(frozen=True)
class Change:
    role: str
    replicas: int
    # ttft or itl (a goal missed), budget (given up to a role that missed one),
    # headroom (goals met with room), idle (no requests).
    reason: str


# Below this share of the calls a second a replica given up was missed at, a role may try
# again: the load moves, and what was missed at is known only roughly.
UNSAFE_SHARE = 0.8
# A role's calls a second are their most over this many cool-downs; a miss within them
# after it gave a replica up is that replica's loss.
WATCH_COOLDOWNS = 4


@dataclass
class State:
    """The replicas asked for per role and when each role last changed; per role, how busy
    it was at each recent decision (when, calls a second), the calls a second per replica
    a replica given up left it when that was missed (unsafe), and the last replica it gave
    up: the calls a second per replica that left it, and when."""

    desired: dict[str, int]
    changed_at: dict[str, float]
    recent: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    unsafe: dict[str, float] = field(default_factory=dict)
    gave: dict[str, tuple[float, float]] = field(default_factory=dict)


def decide(
    seen: Observation,
    goals: Goals,
    roles: Roles,
    bounds: Mapping[str, Bounds],
    budget: int,
    running: Mapping[str, int],
    state: State,
    now: float,
    cooldown_s: float,
) -> list[Change]:
    """The changes to make now (none, one, or a role's replica given to another); what
    the interval showed of each role goes into `state`."""

    def settled(role: str) -> bool:
        since = now - state.changed_at.get(role, -math.inf)
        return since >= cooldown_s and running.get(role, 0) == state.desired[role]

    window = WATCH_COOLDOWNS * cooldown_s
    for role in roles.all:
        history = state.recent.setdefault(role, [])
        history.append((now, (seen.calls or {}).get(role, 0) / seen.seconds))
        history[:] = [(at, rate) for at, rate in history if now - at <= window]

    def rate_left(role: str) -> float:
        """Calls a second per replica, at their most, with one replica fewer."""
        return max(rate for _, rate in state.recent[role]) / max(1, state.desired[role] - 1)

    def per_replica(role: str) -> float:
        return seen.busy(role) / max(1, state.desired[role])

    def can_give(role: str) -> bool:
        # One replica a window: what the last one given up did shows only slowly.
        if now - state.gave.get(role, (0.0, -math.inf))[1] <= window:
            return False
        left = rate_left(role)
        return left == 0 or left < UNSAFE_SHARE * state.unsafe.get(role, math.inf)

    def donors(exclude: str = "", safe_only: bool = True) -> list[str]:
        return [
            role for role in roles.all
            if role != exclude and state.desired[role] > bounds[role].low and settled(role)
            and (can_give(role) or not safe_only)
        ]  # fmt: skip

    missed = _missed(seen, goals, roles)
    if missed is not None:
        role, reason = missed
        left, given_at = state.gave.pop(role, (math.inf, -math.inf))
        if now - given_at <= window:
            state.unsafe[role] = min(state.unsafe.get(role, math.inf), left)
        if state.desired[role] >= bounds[role].high or not settled(role):
            return []
        grow = Change(role, state.desired[role] + 1, reason)
        if sum(state.desired.values()) < budget:
            return [grow]
        # At the budget, someone gives: the one that can best, even if not safely.
        givers = donors(exclude=role, safe_only=False)
        if not givers:
            return []
        donor = min(givers, key=lambda r: (not can_give(r), per_replica(r)))
        return [Change(donor, state.desired[donor] - 1, "budget"), grow]
    idle = seen.first_tokens == 0 and not any((seen.calls or {}).values())
    roomy = all(
        value is None or value <= goals.headroom * goal
        for value, goal in ((seen.ttft_s, goals.ttft_s), (seen.itl_s, goals.itl_s))
    )
    givers = donors()
    if not (idle or roomy) or not givers:
        return []
    donor = min(givers, key=per_replica)
    state.gave[donor] = (rate_left(donor), now)
    return [Change(donor, state.desired[donor] - 1, "idle" if idle else "headroom")]


def _missed(seen: Observation, goals: Goals, roles: Roles) -> tuple[str, str] | None:
    """The role to grow for a goal the interval missed, and which goal."""
    if seen.ttft_s is not None and seen.ttft_s > goals.ttft_s:
        took = seen.first_reply_s or {}
        return max(roles.first_token, key=lambda role: took.get(role, 0.0)), "ttft"
    if seen.itl_s is not None and seen.itl_s > goals.itl_s:
        return roles.decode, "itl"
    return None
