"""The planner's rules: from what one interval showed, which role gets a replica more or
one less. Pure, so that every rule is tested without a mesh.

- A goal missed: the time to first token's 90th percentile above its goal gives the
  role on its path whose calls took longest to their first reply one more replica (the
  encoders for a burst of images, the prefills or workers for long prompts); the time
  between tokens above its goal gives the role that decodes one more.
- Both goals met with room (below `headroom` of each), or no request at all: the least
  busy role above its minimum gives one up (busy: the calls open on it, on average, per
  replica), if what is left would be no busier per replica than the role has been while
  the goals were met. A role that has never missed a goal may try anyway. Without that
  memory a role grown for a miss would give its replica back at the first quiet interval
  and miss again. One role a step, so that the next interval shows what the change did.
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


@dataclass
class State:
    """The replicas asked for per role, when each role last changed, how busy per replica
    each has been while the goals were met, and the roles grown for a miss."""

    desired: dict[str, int]
    changed_at: dict[str, float]
    safe: dict[str, float] = field(default_factory=dict)
    missed: set[str] = field(default_factory=set)


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

    def per_replica(role: str, replicas: int = 0) -> float:
        return seen.busy(role) / max(1, replicas or state.desired[role])

    def can_give(role: str) -> bool:
        left = per_replica(role, state.desired[role] - 1)
        return seen.busy(role) == 0 or role not in state.missed or left <= state.safe.get(role, 0.0)

    def donors(exclude: str = "", safe_only: bool = True) -> list[str]:
        return [
            role for role in roles.all
            if role != exclude and state.desired[role] > bounds[role].low and settled(role)
            and (can_give(role) or not safe_only)
        ]  # fmt: skip

    missed = _missed(seen, goals, roles)
    if missed is not None:
        role, reason = missed
        state.missed.add(role)
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
    for role in roles.all:
        if settled(role):
            state.safe[role] = max(state.safe.get(role, 0.0), per_replica(role))
    idle = seen.first_tokens == 0 and not any((seen.calls or {}).values())
    roomy = all(
        value is None or value <= goals.headroom * goal
        for value, goal in ((seen.ttft_s, goals.ttft_s), (seen.itl_s, goals.itl_s))
    )
    givers = donors()
    if not (idle or roomy) or not givers:
        return []
    donor = min(givers, key=per_replica)
    return [Change(donor, state.desired[donor] - 1, "idle" if idle else "headroom")]


def _missed(seen: Observation, goals: Goals, roles: Roles) -> tuple[str, str] | None:
    """The role to grow for a goal the interval missed, and which goal."""
    if seen.ttft_s is not None and seen.ttft_s > goals.ttft_s:
        took = seen.first_reply_s or {}
        return max(roles.first_token, key=lambda role: took.get(role, 0.0)), "ttft"
    if seen.itl_s is not None and seen.itl_s > goals.itl_s:
        return roles.decode, "itl"
    return None
