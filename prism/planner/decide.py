"""The planner's rules: from what one interval showed, how many replicas each role needs.
Pure, so that every rule is tested without a mesh.

- A goal missed: the time to first token's 90th percentile above its goal blames the
  role on its path whose calls took longest to their first reply (the encoders for a
  burst of images, the prefills or workers for long prompts); the time between tokens
  above its goal blames the role that decodes. A goal about to be missed: a role on the
  first token's path whose queue (calls waiting for a first reply), at the pace it
  answers, holds a call arriving now longer than the goal, is blamed before the requests
  that miss have had their first tokens. So are decodes apart whose queue does: their
  calls wait out of KV, each a request stalled after its first token, and a time to first
  token missed then is theirs too (prefills hold their prompts' KV until a decode reads
  it). The role blamed, if it had a queue all the
  interval, is saturated: the calls a second its replicas answered, each, are what a
  replica can take (its capacity, learned so; a role answering more later raises it).
  It grows at once to the replicas its calls need: those arriving a second at their most
  over the window (a rate read over enough calls, not one short interval's few), and its
  queue (calls waiting for a first reply) drained within a cool-down (or an interval, if
  longer), at `TARGET_LOAD` of its capacity each; one more at least. So a burst of images
  takes the encoders it needs in one step, not one replica a cool-down, as Dynamo's SLA
  planner sizes prefill and decode from the load and a profile of each engine (here the
  profile is learned from the misses).
- At the replica budget, the replicas the role needs come from the others: what each
  holds beyond what its calls open now need, at the calls open a replica held when it was
  last to blame (calls open, not calls a second: a role's calls cost what the load's mix
  makes them, and when the load moves, as from text to images, the workers' calls get
  cheaper at once). If none has any to spare, the least busy (busy: the calls open on
  it, on average, per replica) gives one.
- Both goals met with room (below `headroom` of each), or no request at all: the least
  busy role above its minimum gives up what it holds beyond its need. A role whose
  capacity is not known yet gives one replica up at most per window, as Kubernetes'
  autoscaler steadies its scale-down: if that was too many, the miss that follows
  teaches its capacity. So does a role whose calls open say it needs fewer replicas than
  its capacity does, once the goals have had room for four windows: a capacity read low
  would otherwise keep its replicas for good. One role a step, so that the next interval
  shows what the change did.
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
    # Per role: its calls that got their first reply, their mean time to it, and the
    # seconds calls that ended were open.
    calls: Mapping[str, int] | None = None
    first_reply_s: Mapping[str, float] | None = None
    open_s: Mapping[str, float] | None = None
    # Per role: calls that arrived in the interval, and those waiting for a first reply
    # at its end (the role's queue, and what it is starting on).
    arrived: Mapping[str, float] | None = None
    waiting: Mapping[str, float] | None = None
    # Those waiting at its start.
    waited: Mapping[str, float] | None = None

    def busy(self, role: str) -> float:
        """Calls open on `role`, on average (Little's law)."""
        return (self.open_s or {}).get(role, 0.0) / self.seconds

    def arrivals(self, role: str) -> float:
        """Calls that arrived at `role` (those answered, where arrivals are not known)."""
        arrived = (self.arrived or {}).get(role)
        return arrived if arrived is not None else (self.calls or {}).get(role, 0)


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
    # ttft or itl (a goal missed), queue (a queue that will miss the time to first
    # token's goal), budget (given up to a role that missed one),
    # headroom (goals met with room), idle (no requests).
    reason: str


# The share of a replica's capacity a role is sized for: the load moves within an
# interval, and a capacity is known only roughly.
TARGET_LOAD = 0.8
# A role's arriving calls are their most over this many cool-downs, and a role whose
# capacity is not known gives up one replica a window at most.
WATCH_COOLDOWNS = 4
# A role whose calls open say it needs fewer replicas than its capacity does gives one up
# once the goals have had room for this many windows: long enough that a steady load which
# needs them all is not probed every window.
ROOMY_WINDOWS = 4
# A rate is read over the latest intervals that hold this many calls (within the window):
# over one short interval, a light load's call or two reads as twice its rate or more.
RATE_CALLS = 10


@dataclass
class State:
    """The replicas asked for per role and when each role last changed; per role, the
    calls that arrived in each recent interval (its end, calls, seconds), the calls a
    second one replica answers (its capacity, once a miss showed it; when it was last
    learned) and the calls open a replica held then, and when it last gave a replica up;
    since when the goals have been met with room."""

    desired: dict[str, int]
    changed_at: dict[str, float]
    recent: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    capacity: dict[str, float] = field(default_factory=dict)
    learned: dict[str, float] = field(default_factory=dict)
    held: dict[str, float] = field(default_factory=dict)
    gave: dict[str, float] = field(default_factory=dict)
    roomy_since: float | None = None


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
    """The changes to make now (none, a role's, or replicas given to another); what the
    interval showed of each role goes into `state`."""

    def settled(role: str) -> bool:
        since = now - state.changed_at.get(role, -math.inf)
        return since >= cooldown_s and running.get(role, 0) == state.desired[role]

    window = WATCH_COOLDOWNS * cooldown_s
    missed = _missed(seen, goals, roles, state.capacity, running)
    _learn(seen, state, roles, running, missed[0] if missed else None, now, window)
    idle, roomy, long_roomy = _room(seen, goals, missed is not None, state, now, window)

    def need(role: str) -> int | None:
        """The replicas `role`'s calls need; None while its capacity is not known."""
        capacity = _capacity_now(seen, role, state.capacity.get(role), running)
        if not capacity:
            return None
        peak = _peak(state.recent[role])
        queue = (seen.waiting or {}).get(role, 0.0) / max(cooldown_s, seen.seconds)
        return math.ceil((peak + queue) / (capacity * TARGET_LOAD))

    def spare(role: str, now_only: bool = False) -> int:
        """What `role` can give up safely; `now_only`: by its calls open now (at the budget)."""
        if state.desired[role] <= bounds[role].low or not settled(role):
            return 0
        held = state.held.get(role)
        by_open = math.ceil(seen.busy(role) / (held * TARGET_LOAD)) if held else None
        once_a_window = now - state.gave.get(role, -math.inf) > window
        needed = by_open if now_only and by_open is not None else need(role)
        if needed is None:
            return int(once_a_window)
        if long_roomy and once_a_window and by_open is not None and by_open < needed:
            # Room for long, and its calls open say fewer than its capacity
            # does: a capacity read low would keep replicas for good, so one goes; a miss
            # after teaches the capacity again.
            needed = max(by_open, state.desired[role] - 1)
        return max(0, state.desired[role] - max(bounds[role].low, needed))

    def per_replica(role: str) -> float:
        return seen.busy(role) / max(1, state.desired[role])

    if missed is not None:
        role, reason = missed
        if state.desired[role] >= bounds[role].high or not settled(role):
            return []
        wanted = min(bounds[role].high, max(state.desired[role] + 1, need(role) or 0))
        extra = wanted - state.desired[role] - max(0, budget - sum(state.desired.values()))
        changes = []
        givers = sorted((r for r in roles.all if r != role), key=per_replica)
        for giver in givers:
            given = min(extra, spare(giver, now_only=True))
            if given > 0:
                changes.append(Change(giver, state.desired[giver] - given, "budget"))
                extra -= given
        if extra > 0 and not changes:
            # None has any to spare: the least busy gives one, even if it will miss it.
            unsafe = [r for r in givers if state.desired[r] > bounds[r].low and settled(r)]
            if not unsafe:
                return []
            changes.append(Change(unsafe[0], state.desired[unsafe[0]] - 1, "budget"))
            extra -= 1
        return [*changes, Change(role, wanted - max(0, extra), reason)]
    givers = [role for role in roles.all if spare(role)]
    if not roomy or not givers:
        return []
    donor = min(givers, key=per_replica)
    change = Change(donor, state.desired[donor] - spare(donor), "idle" if idle else "headroom")
    state.gave[donor] = now
    return [change]


def _room(
    seen: Observation, goals: Goals, missed: bool, state: State, now: float, window: float
) -> tuple[bool, bool, bool]:
    """Whether the interval had no requests (none arriving, none open: a decode's long
    answers run on without arrivals), whether it met both goals with room (or had none),
    and whether they have been so for `ROOMY_WINDOWS` (since when: in `state`)."""
    idle = seen.first_tokens == 0 and not any((seen.calls or {}).values())
    idle = idle and not any((seen.open_s or {}).values())
    roomy = idle or all(
        value is None or value <= goals.headroom * goal
        for value, goal in ((seen.ttft_s, goals.ttft_s), (seen.itl_s, goals.itl_s))
    )
    if missed or not roomy:
        state.roomy_since = None
    elif state.roomy_since is None:
        state.roomy_since = now - seen.seconds
    long = state.roomy_since is not None and now - state.roomy_since >= ROOMY_WINDOWS * window
    return idle, roomy, long


def _learn(
    seen: Observation,
    state: State,
    roles: Roles,
    running: Mapping[str, int],
    blamed: str | None,
    now: float,
    window: float,
) -> None:
    """What the interval shows of each role: its calls a second, and for the role to
    blame, if it had a queue and the same replicas all the interval (saturated), what a
    replica takes; any role answering more raises that."""
    for role in roles.all:
        history = state.recent.setdefault(role, [])
        history.append((now, seen.arrivals(role), seen.seconds))
        history[:] = [entry for entry in history if now - entry[0] <= window]
        replicas = max(1, running.get(role, 0))
        answered = (seen.calls or {}).get(role, 0) / seen.seconds / replicas
        # Saturated all the interval: a queue at its start too, not one that formed in it,
        # and the same replicas all along (one just started takes its first calls).
        queued = (seen.waited or {}).get(role, 0.0) > replicas
        steady = now - state.changed_at.get(role, -math.inf) > seen.seconds and (
            running.get(role, 0) == state.desired[role]
        )
        if role == blamed and answered > 0 and queued and steady:
            # Within a window, the most any saturated interval showed (a short interval
            # answers few calls, so one alone reads low); after it, what this one shows,
            # less too: the load's mix may have changed what a call costs.
            recent = now - state.learned.get(role, -math.inf) <= window
            state.capacity[role] = max(answered, state.capacity[role] if recent else 0.0)
            state.learned[role] = now
            state.held[role] = seen.busy(role) / replicas
        elif role in state.capacity:
            state.capacity[role] = max(state.capacity[role], answered)


def _peak(history: list[tuple[float, float, float]]) -> float:
    """The most calls a second over the window: at the end of each interval, the rate of
    the latest intervals holding `RATE_CALLS` calls; where the window holds fewer, its
    rate."""
    rates = []
    for end in range(len(history)):
        calls = seconds = 0.0
        for _, count, span in reversed(history[: end + 1]):
            calls, seconds = calls + count, seconds + span
            if calls >= RATE_CALLS:
                rates.append(calls / seconds)
                break
    return max(rates, default=calls / seconds)


def _capacity_now(
    seen: Observation, role: str, known: float | None, running: Mapping[str, int]
) -> float | None:
    """What a replica of `role` answers a second now: where the interval kept a queue at
    both ends, what it answered (a capacity learned on another mix of calls may be higher
    than this mix allows), at most the capacity known; else that."""
    replicas = max(1, running.get(role, 0))
    saturated = min((seen.waited or {}).get(role, 0.0), (seen.waiting or {}).get(role, 0.0))
    answered = (seen.calls or {}).get(role, 0) / seen.seconds / replicas
    if saturated > replicas and answered > 0:
        return min(answered, known) if known else answered
    return known


def _missed(
    seen: Observation,
    goals: Goals,
    roles: Roles,
    capacity: Mapping[str, float],
    running: Mapping[str, int],
) -> tuple[str, str] | None:
    """The role to grow for a goal the interval missed, or one its queue will miss, and
    why."""

    def ahead(role: str) -> float:
        """Seconds a call arriving now waits behind the role's queue, at the pace the role
        answers (its capacity, where known): a queue shows a miss before the requests
        that miss have their first tokens. Only more calls waiting than replicas count,
        so that a call or two at a light load is no queue."""
        replicas = max(1, running.get(role, 0))
        waiting = (seen.waiting or {}).get(role, 0.0)
        if waiting <= replicas:
            return 0.0
        known = _capacity_now(seen, role, capacity.get(role), running)
        pace = known * replicas if known else (seen.calls or {}).get(role, 0) / seen.seconds
        return waiting / pace if pace > 0 else math.inf

    # Decodes apart, out of KV: each call waiting is a request stalled after its first
    # token (one long gap, which the time between tokens' percentile does not show), and
    # prefills hold their prompts' KV until a decode reads it, so first tokens slow down
    # too. It is the decodes that need growing, not the role the first tokens blame.
    stalled = roles.decode not in roles.first_token and ahead(roles.decode) > goals.ttft_s
    if seen.ttft_s is not None and seen.ttft_s > goals.ttft_s:
        if stalled:
            return roles.decode, "queue"
        took = seen.first_reply_s or {}
        return max(roles.first_token, key=lambda role: took.get(role, 0.0)), "ttft"
    if seen.itl_s is not None and seen.itl_s > goals.itl_s:
        return roles.decode, "itl"
    late = max(roles.all, key=ahead)
    return (late, "queue") if ahead(late) > goals.ttft_s else None
