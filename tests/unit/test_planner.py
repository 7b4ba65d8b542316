"""The planner's rules, its reading of the fronts' metrics and its loop, with no mesh: a
backend and metrics made up in the test."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from prism.cli import build_parser
from prism.config.commands import MeshConfig
from prism.config.planner import PlannerConfig
from prism.modes import mode
from prism.ops import scaling
from prism.planner import decide as rules
from prism.planner import observe
from prism.planner.loop import Planner, bounds

GOALS = rules.Goals(ttft_s=1.0, itl_s=0.1)
EPD_D = rules.roles_of(mode("e/p/d"))
WIDE = {role: rules.Bounds(1, 4) for role in EPD_D.all}


def seen(ttft=None, itl=None, first_tokens=10, busy=None, calls=None, arrived=None,
         waiting=None, waited=None, **first_reply) -> rules.Observation:  # fmt: skip
    """An interval of 10 s; `busy`: calls open on each role, on average; `calls`: those
    answered (10 per role with a first reply, unless given); `waited`: the queue at its
    start (unless given, 10 at every role with a first reply: saturated)."""
    return rules.Observation(
        seconds=10.0, first_tokens=first_tokens, ttft_s=ttft, itl_s=itl,
        calls=calls or {role: 10 for role in first_reply}, first_reply_s=first_reply,
        open_s={role: calls * 10.0 for role, calls in (busy or {}).items()},
        arrived=arrived, waiting=waiting,
        waited={role: 10.0 for role in first_reply} if waited is None else waited,
    )  # fmt: skip


def decide(observation, desired=None, budget=100, changed_at=None, running=None, now=100.0,
           state=None):  # fmt: skip
    desired = desired or {role: 2 for role in EPD_D.all}
    state = state or rules.State(dict(desired), dict(changed_at or {}))
    return rules.decide(observation, GOALS, EPD_D, WIDE, budget, running or state.desired,
                        state, now, cooldown_s=20.0)  # fmt: skip


def test_the_roles_each_mode_plans():
    assert rules.roles_of(mode("epd")) == rules.Roles(("worker",), "worker")
    assert rules.roles_of(mode("e/pd")) == rules.Roles(("encoder", "worker"), "worker")
    assert rules.roles_of(mode("e/p/d")) == rules.Roles(("encoder", "prefill"), "decode")
    assert rules.roles_of(mode("ep/d")) == rules.Roles(("prefill",), "decode")
    assert rules.roles_of(mode("e/pd")).all == ("encoder", "worker")


def test_a_slow_first_token_grows_the_slowest_role_on_its_path():
    # Calls arrive as fast as they are answered: one replica more.
    images = seen(ttft=3.0, itl=0.01, calls={"encoder": 20}, encoder=2.5, prefill=0.3)
    assert decide(images) == [rules.Change("encoder", 3, "ttft")]
    prompts = seen(ttft=3.0, itl=0.01, calls={"prefill": 20}, encoder=0.1, prefill=2.0)
    assert decide(prompts) == [rules.Change("prefill", 3, "ttft")]


def test_slow_tokens_grow_the_decodes():
    assert decide(seen(ttft=0.2, itl=0.5, prefill=0.1)) == [rules.Change("decode", 3, "itl")]


def test_a_miss_grows_the_role_at_once_to_what_its_calls_and_queue_need():
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {})
    # One encoder answered 5 calls a second (its capacity), 10 arrived, 20 wait: at 80 %
    # of 5 a second each, (10 + 20 / 20 s) a second need 3.
    burst = seen(ttft=3.0, calls={"encoder": 50}, arrived={"encoder": 100.0},
                 waiting={"encoder": 20.0}, encoder=2.5, prefill=0.2)  # fmt: skip
    assert decide(burst, state=state) == [rules.Change("encoder", 3, "ttft")]
    assert state.capacity == {"encoder": 5.0}
    # A queue that formed within the interval says nothing of what a replica takes: one
    # replica more.
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {})
    formed = seen(ttft=3.0, calls={"encoder": 5}, arrived={"encoder": 100.0},
                  waiting={"encoder": 20.0}, waited={}, encoder=2.5, prefill=0.2)  # fmt: skip
    assert decide(formed, state=state) == [rules.Change("encoder", 2, "ttft")]
    assert state.capacity == {}
    # Within the role's most.
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {})
    heavier = seen(ttft=3.0, calls={"encoder": 50}, arrived={"encoder": 400.0},
                   encoder=2.5, prefill=0.2)  # fmt: skip
    assert decide(heavier, state=state) == [rules.Change("encoder", 4, "ttft")]


def test_a_queue_that_will_miss_the_goal_grows_its_role_before_the_miss_shows():
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {})
    # Goals met so far, but 12 calls wait at an encoder answering 6 a second: a call
    # arriving now waits 2 s, above the 1 s goal. 7.2 arriving a second, and the queue
    # drained within the cool-down, need 2 at 80 % of 6 a second.
    building = seen(ttft=0.4, calls={"encoder": 60, "prefill": 60},
                    arrived={"encoder": 72.0}, waiting={"encoder": 12.0, "prefill": 1.0},
                    encoder=0.3, prefill=0.1)  # fmt: skip
    assert decide(building, state=state) == [rules.Change("encoder", 2, "queue")]
    # A call or two waiting at a light load is no queue; nor is one answered in time.
    light = seen(ttft=0.4, calls={"encoder": 1}, waiting={"encoder": 1.0}, encoder=0.3)
    assert decide(light, desired={"encoder": 1, "prefill": 1, "decode": 1}) == []
    brief = seen(ttft=0.4, calls={"encoder": 60}, waiting={"encoder": 4.0}, encoder=0.3)
    assert decide(brief, desired={"encoder": 1, "prefill": 1, "decode": 1}) == []


def test_decodes_out_of_kv_grow_on_their_queue_though_first_tokens_blame_prefills():
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {})
    # 40 calls wait at a decode that answered none: requests stalled after their first
    # token, while prefills, holding prompts' KV for the decode, are slow to first replies.
    stalled = seen(ttft=3.0, itl=0.02, calls={"prefill": 10}, waiting={"decode": 40.0},
                   prefill=2.5)  # fmt: skip
    assert decide(stalled, state=state) == [rules.Change("decode", 2, "queue")]
    # No goal missed yet: the decodes' queue alone grows them.
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {})
    building = seen(ttft=0.5, itl=0.02, calls={"prefill": 10}, waiting={"decode": 40.0},
                    prefill=0.2)  # fmt: skip
    assert decide(building, state=state) == [rules.Change("decode", 2, "queue")]
    # Where the workers decode their own prompts, their queue is on the first token's
    # path, as before.
    roles = rules.roles_of(mode("e/pd"))
    state = rules.State({"encoder": 1, "worker": 1}, {})
    bounds = {role: rules.Bounds(1, 4) for role in roles.all}
    slow = seen(ttft=3.0, calls={"worker": 10}, waiting={"worker": 40.0}, encoder=2.0, worker=0.5)
    changes = rules.decide(slow, GOALS, roles, bounds, 100, state.desired, state, 100.0, 20.0)
    assert changes == [rules.Change("encoder", 2, "ttft")]


def test_a_capacity_learned_on_cheaper_calls_yields_to_the_pace_a_lasting_queue_shows():
    # The prefill answered 10 calls a second on short prompts; now, with a queue at both
    # ends of the interval, it answers 4: the 8 waiting wait 2 s at that pace, not 0.8 s,
    # and 10 arriving a second need 4 replicas of 4 a second at 80 %.
    def state():
        return rules.State({"encoder": 1, "prefill": 1, "decode": 1}, {},
                           capacity={"prefill": 10.0})  # fmt: skip

    longer = dict(ttft=0.4, calls={"prefill": 40}, arrived={"prefill": 100.0},
                  waiting={"prefill": 8.0}, prefill=0.3)  # fmt: skip
    assert decide(seen(**longer), state=state()) == [rules.Change("prefill", 4, "queue")]
    # A queue that formed within the interval: the capacity known stands.
    assert decide(seen(**longer, waited={}), state=state()) == []


def test_a_role_at_its_most_or_still_settling_does_not_grow():
    slow = seen(ttft=3.0, encoder=2.5, prefill=0.3)
    assert decide(slow, desired={"encoder": 4, "prefill": 1, "decode": 1}) == []
    assert decide(slow, changed_at={"encoder": 90.0}) == []  # within the cool-down
    # Asked for 2, one still starting.
    assert decide(slow, running={"encoder": 1, "prefill": 2, "decode": 2}) == []


def test_at_the_budget_the_others_give_what_they_hold_beyond_their_need():
    state = rules.State({"encoder": 1, "prefill": 4, "decode": 1}, {}, capacity={"prefill": 5.0})
    # The prefills' 8 calls a second need 2 of their 4; the encoders' burst needs 3.
    burst = seen(ttft=3.0, calls={"encoder": 50, "prefill": 80}, arrived={"encoder": 100.0},
                 busy={"prefill": 1, "decode": 0.5}, encoder=2.5, prefill=0.2)  # fmt: skip
    assert decide(burst, state=state, budget=6) == [
        rules.Change("prefill", 2, "budget"), rules.Change("encoder", 3, "ttft")
    ]  # fmt: skip
    # None has any to spare: the least busy gives one, and the role grows by that one.
    state = rules.State({"encoder": 1, "prefill": 2, "decode": 3}, {})
    slow = seen(ttft=3.0, itl=0.01, busy={"encoder": 8, "prefill": 2, "decode": 1},
                encoder=2.5, prefill=0.3, decode=0.01)  # fmt: skip
    state.gave = {"prefill": 90.0, "decode": 90.0}  # each gave one up within the window
    assert decide(slow, state=state, budget=6) == [
        rules.Change("decode", 2, "budget"), rules.Change("encoder", 2, "ttft")
    ]  # fmt: skip
    # No role above its least: nothing to give.
    assert decide(slow, desired={"encoder": 2, "prefill": 1, "decode": 1}, budget=4) == []


def test_goals_met_with_room_take_a_replica_from_the_least_busy_role():
    roomy = seen(ttft=0.3, itl=0.02, busy={"encoder": 1, "prefill": 2, "decode": 0.5},
                 encoder=0.05, prefill=0.2, decode=0.01)  # fmt: skip
    assert decide(roomy) == [rules.Change("decode", 1, "headroom")]
    # Met, but without room: nothing goes.
    assert decide(seen(ttft=0.8, itl=0.02, encoder=0.05, prefill=0.2)) == []


def test_a_role_keeps_what_its_learned_capacity_says_its_calls_need():
    state = rules.State({"encoder": 1, "prefill": 4, "decode": 1}, {}, capacity={"prefill": 1.0})
    # 1.5 calls a second, 1 a replica at most: 2 prefills, the rest go at once.
    met = seen(ttft=0.3, calls={"prefill": 15}, busy={"prefill": 2}, prefill=0.2)
    assert decide(met, state=state) == [rules.Change("prefill", 2, "headroom")]
    state.desired["prefill"] = 2
    assert decide(met, state=state, now=200.0) == []
    # A role answering more than it was thought to take shows it can: 2 a second each.
    busier = seen(ttft=0.3, calls={"prefill": 40}, prefill=0.2)
    assert decide(busier, state=state, now=300.0) == []
    assert state.capacity["prefill"] == 2.0
    # A miss it is blamed for says what a replica takes now, less too.
    late = seen(ttft=3.0, calls={"prefill": 10}, arrived={"prefill": 30.0}, prefill=2.0)
    assert decide(late, state=state, now=400.0) == [rules.Change("prefill", 4, "ttft")]
    assert state.capacity["prefill"] == 0.5


def test_a_light_load_is_read_over_enough_calls_not_one_short_interval():
    # One replica takes 2 calls a second; a call or two a second arrives, 1.3 on
    # average. Read one second at a time, 2 a second would need 2 replicas at 80 %.
    state = rules.State({"encoder": 1, "prefill": 2, "decode": 1}, {}, capacity={"prefill": 2.0})
    changes = []
    for second, count in enumerate([2, 1, 1, 2, 1, 1, 2, 1, 1, 1]):
        interval = rules.Observation(seconds=1.0, first_tokens=count, ttft_s=0.2, itl_s=0.01,
                                     calls={"prefill": count})  # fmt: skip
        changes += decide(interval, state=state, now=100.0 + second)
        for change in changes:
            state.desired[change.role] = change.replicas
    assert changes == [rules.Change("prefill", 1, "headroom")]


def test_a_capacity_read_low_gives_way_after_long_room():
    # A capacity of 1 a second says 2.5 calls a second need 4 replicas, but the calls
    # open (1) are a quarter of what a replica held when it missed (4).
    state = rules.State({"encoder": 1, "prefill": 3, "decode": 1}, {},
                        capacity={"prefill": 1.0}, held={"prefill": 4.0})  # fmt: skip
    met = seen(ttft=0.3, calls={"prefill": 25}, busy={"prefill": 1}, prefill=0.2)
    assert decide(met, state=state, now=100.0) == []
    assert decide(met, state=state, now=400.0) == []
    # Room for four windows (of 4 cool-downs each, since 90 s): one goes, one a window.
    assert decide(met, state=state, now=410.0) == [rules.Change("prefill", 2, "headroom")]
    state.desired["prefill"], state.changed_at["prefill"] = 2, 410.0
    assert decide(met, state=state, now=490.0) == []
    # A miss starts the wait again.
    state.gave.clear()
    assert decide(seen(ttft=3.0, encoder=2.5, prefill=0.3), state=state, now=500.0)
    assert decide(met, state=state, now=820.0) == []


def test_a_role_of_unknown_capacity_gives_one_replica_a_window():
    state = rules.State({"encoder": 1, "prefill": 3, "decode": 1}, {})
    met = seen(ttft=0.3, busy={"prefill": 2}, prefill=0.2)
    assert decide(met, state=state) == [rules.Change("prefill", 2, "headroom")]
    state.desired["prefill"] = 2
    assert decide(met, state=state, now=150.0) == []  # within the window (4 cool-downs)
    assert decide(met, state=state, now=200.0) == [rules.Change("prefill", 1, "headroom")]


def test_without_requests_roles_shrink_to_their_least():
    quiet = seen(first_tokens=0)
    assert decide(quiet, desired={"encoder": 1, "prefill": 1, "decode": 3}) == [
        rules.Change("decode", 2, "idle")
    ]  # fmt: skip
    assert decide(quiet, desired={"encoder": 1, "prefill": 1, "decode": 1}) == []
    # A role whose capacity is known needs none: to its least at once.
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 3}, {}, capacity={"decode": 2.0})
    assert decide(quiet, state=state) == [rules.Change("decode", 1, "idle")]


def test_a_decode_running_long_answers_without_arrivals_is_not_idle():
    # It may give a replica its open calls do not need; the reason is headroom, not idle.
    running_on = seen(first_tokens=0, busy={"decode": 1})
    state = rules.State({"encoder": 1, "prefill": 1, "decode": 3}, {}, capacity={"decode": 2.0})
    assert decide(running_on, state=state) == [rules.Change("decode", 1, "headroom")]


def test_bounds_default_and_refuse_what_cannot_be():
    config = PlannerConfig(min_replicas=["encoder=0"], max_replicas=["worker=2"])
    assert bounds(config, ["encoder", "worker"], {"encoder": 6}) == {
        "encoder": rules.Bounds(0, 6), "worker": rules.Bounds(1, 2)
    }  # fmt: skip
    with pytest.raises(ValueError, match="no role 'decode'"):
        bounds(PlannerConfig(max_replicas=["decode=2"]), ["worker"], {})
    with pytest.raises(ValueError, match="above"):
        bounds(PlannerConfig(min_replicas=["worker=3"], max_replicas=["worker=2"]), ["worker"], {})
    with pytest.raises(ValueError, match="ROLE=N"):
        bounds(PlannerConfig(min_replicas=["worker"]), ["worker"], {})


def metrics_text(ttft=(), itl=(), first_reply=(), open_s=(), waiting=()) -> str:
    """A front's /metrics with these observations."""
    registry = CollectorRegistry()
    buckets = (0.1, 0.5, 1.0, 2.0, 5.0)
    names = (observe.TTFT, observe.ITL)
    for name, values in zip(names, (ttft, itl), strict=True):
        histogram = Histogram(name, "", ["endpoint"], buckets=buckets, registry=registry)
        for value in values:
            histogram.labels("Chat").observe(value)
    stage = Histogram(observe.FIRST_REPLY, "", ["role"], buckets=buckets, registry=registry)
    for role, value in first_reply:
        stage.labels(role).observe(value)
    calls = Counter(observe.CALL_SECONDS, "", ["role"], registry=registry)
    for role, value in open_s:
        calls.labels(role).inc(value)
    queue = Gauge(observe.WAITING, "", ["role"], registry=registry)
    for role, value in waiting:
        queue.labels(role).set(value)
    return generate_latest(registry).decode()


def test_quantiles_interpolate_within_their_bucket():
    assert observe.quantile(0.9, []) is None
    assert observe.quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    # 10 below 1 s, 10 in (1, 2]: the 90th percentile is 80 % into the second bucket.
    assert observe.quantile(0.9, [(1.0, 10), (2.0, 20), (float("inf"), 20)]) == pytest.approx(1.8)
    # Beyond the last finite bucket: its bound.
    assert observe.quantile(0.9, [(1.0, 1), (float("inf"), 10)]) == 1.0


def test_an_interval_is_what_changed_between_two_reads_summed_over_fronts():
    before = observe.parse(metrics_text(ttft=[0.05] * 10, waiting=[("encoder", 4)]))
    front_a = metrics_text(
        ttft=[0.05] * 10 + [1.5] * 10,
        itl=[0.01] * 5,
        first_reply=[("encoder", 1.0), ("encoder", 2.0), ("prefill", 0.2)],
        open_s=[("encoder", 3.0), ("prefill", 4.0)],
        waiting=[("encoder", 5), ("prefill", 0)],
    )
    # Another front, new since the first read.
    front_b = metrics_text(ttft=[0.05] * 5, waiting=[("encoder", 2)])
    after = observe.parse(front_b, observe.parse(front_a))
    seen = observe.observation(before, after, seconds=5.0)
    assert seen.first_tokens == 15
    # 15 new: 5 fast, 10 between 1 and 2 s.
    assert 1.0 < seen.ttft_s <= 2.0
    assert seen.itl_s == pytest.approx(0.09)
    assert seen.calls == {"encoder": 2, "prefill": 1}
    assert seen.first_reply_s == pytest.approx({"encoder": 1.5, "prefill": 0.2})
    assert seen.busy("encoder") == pytest.approx(3.0 / 5.0)
    # The encoders' queue: 4, then 7. So 2 answered and 3 more waiting: 5 arrived.
    assert seen.waiting == {"encoder": 7, "prefill": 0}
    assert seen.arrived == {"encoder": 5, "prefill": 1}
    assert seen.arrivals("encoder") == 5
    # A front that restarted counts from zero: what it has now is all new.
    restarted = observe.observation(after, before, seconds=5.0)
    assert restarted.first_tokens == 10


class Backend:
    def __init__(self, **replicas):
        self.counts = dict(replicas)
        self.asked = []

    def replicas(self, role):
        return self.counts[role]

    def scale(self, role, count):
        self.asked.append((role, count))
        self.counts[role] = count


def test_the_loop_decides_from_two_reads_and_exports_what_it_did():
    reads = iter([
        metrics_text(),
        metrics_text(ttft=[4.0] * 10, first_reply=[("worker", 3.0)] * 10),
        metrics_text(ttft=[4.0] * 10, first_reply=[("worker", 3.0)] * 10),
    ])  # fmt: skip
    backend = Backend(worker=1)
    config = PlannerConfig(planner="slo", ttft_slo_ms=1000, max_replicas=["worker=3"],
                           planner_interval_s=5, planner_cooldown_s=0)  # fmt: skip
    now = [0.0]
    planner = Planner(config, mode("epd"), backend, lambda: ["http://front"],
                      clock=lambda: now[0],
                      scrape=lambda urls: observe.parse(next(reads)))  # fmt: skip
    planner.poll()  # the first read: nothing to compare yet
    now[0] = 1.0
    planner.poll()  # not yet an interval
    now[0] = 5.0
    planner.poll()
    assert backend.asked == [("worker", 2)]
    now[0] = 10.0
    planner.poll()  # nothing new in the last interval: no requests, so one goes again
    assert backend.asked == [("worker", 2), ("worker", 1)]
    assert planner.state.desired == {"worker": 1}


def test_the_loop_asks_again_for_replicas_the_backend_could_not_start_yet():
    class Draining(Backend):
        def scale(self, role, count):
            self.asked.append((role, count))  # a replica still draining: none starts

    backend = Draining(worker=1)
    config = PlannerConfig(planner="slo", ttft_slo_ms=1000, planner_cooldown_s=0)
    reads = iter([metrics_text(), metrics_text(ttft=[4.0] * 10), metrics_text(ttft=[4.0] * 10)])
    planner = Planner(config, mode("epd"), backend, lambda: [],
                      scrape=lambda urls: observe.parse(next(reads)))  # fmt: skip
    planner.step(0.0)
    planner.step(5.0)
    assert backend.asked == [("worker", 2)]
    planner.step(10.0)  # still one running: asked again, and nothing more decided
    assert backend.asked == [("worker", 2), ("worker", 2)]


def test_the_loop_puts_a_role_into_its_bounds_at_start():
    backend = Backend(encoder=0, worker=6)
    Planner(PlannerConfig(planner="slo", max_replicas=["worker=4"]), mode("e/pd"), backend,
            lambda: [], scrape=lambda urls: {})  # fmt: skip
    assert backend.asked == [("encoder", 1), ("worker", 4)]


def test_prism_serve_plans_each_role_at_its_most_and_starts_what_was_asked():
    config = MeshConfig.from_args(build_parser().parse_args([
        "serve", "--model", "m", "--mode", "e/pd", "--encoders", "3", "--engine", "sim",
        "--planner", "slo", "--max-replicas", "encoder=2", "--max-replicas", "worker=3",
    ]))  # fmt: skip
    stages, starting = scaling.plan_mesh(config)
    names = [stage.name for stage in stages]
    assert names[:5] == ["encoder-0", "encoder-1", "worker-0", "worker-1", "worker-2"]
    # Three encoders asked for, two at most; a worker.
    assert [s.name for s in starting][:3] == ["encoder-0", "encoder-1", "worker-0"]
    assert {scaling.role_of(s) for s in starting[3:]} <= {"front", "processor", "gateway"}
    # The fronts know every planned replica (the static registry), started or not.
    front = stages[-1]
    assert sum(arg.startswith("worker=") for arg in front.argv) == 3
