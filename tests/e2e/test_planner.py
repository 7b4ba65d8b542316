"""`prism serve --planner slo` sets its replicas by itself: under a load that misses the
goal for the time to first token it starts a second worker, and once the load is one
that a worker takes with room it stops one again by draining it, while requests keep
coming: none is lost.
The second worker waits as a warm spare, started and not serving, and is promoted.
Simulated engines, whose single sequence per step makes a queue that a second worker
halves."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import metrics
from support.served import Load, Served
from support.waiting import wait_for


def health(served: Served, stage: str) -> str:
    """What the stage's gRPC health says of it (the server as a whole), or why it did not
    answer."""
    with grpc.insecure_channel(served.stage(stage)["address"]) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        try:
            reply = check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def replicas(served: Served, state: str) -> float:
    return metrics.total(served.status["planner_metrics"], "prism_planner_replicas",
                         role="worker", state=state)  # fmt: skip


def decisions(served: Served, reason: str) -> float:
    return metrics.total(served.status["planner_metrics"], "prism_planner_decisions_total",
                         role="worker", reason=reason)  # fmt: skip


def test_the_planner_adds_a_worker_for_a_queue_and_drains_it_away_after(models, tmp_path):
    served = Served(
        ["--mode", "epd", "--model", models["llava"], "--engine", "sim", "--front-workers", "1",
         "--sim-max-num-seqs", "1", "--sim-decode-step-ms", "40",
         "--planner", "slo", "--max-replicas", "worker=2", "--ttft-slo-ms", "600",
         "--itl-slo-ms", "1000", "--planner-interval-s", "1", "--planner-cooldown-s", "2"],
        tmp_path,
    )  # fmt: skip
    try:
        assert [s["name"] for s in served.status["stages"]][:2] == ["worker-0", "worker-1"]
        assert wait_for(lambda: replicas(served, "running") == 1, timeout=30), served.tail()
        # Planned, and started as a warm spare: it serves no request yet.
        assert wait_for(lambda: served.pid("worker-1") is not None, timeout=60), served.tail()
        spare = served.pid("worker-1")
        assert wait_for(lambda: health(served, "worker-1") == "NOT_SERVING", timeout=60)
        # Six streams on one sequence at a time: each waits for five others.
        heavy = Load(served, clients=6)
        try:
            assert wait_for(lambda: replicas(served, "running") == 2, timeout=120), served.tail()
            # Its queue, or the time to first token, missed the goal: one decision.
            assert decisions(served, "queue") + decisions(served, "ttft") == 1
            # The spare was promoted, not a process started.
            assert served.pid("worker-1") == spare
            assert health(served, "worker-1") == "SERVING"
        finally:
            heavy_outcomes = heavy.stop()
        # A user who reads each answer before the next: one worker takes that with room.
        light = Load(served, clients=1, pause_s=0.5)
        try:
            assert wait_for(lambda: replicas(served, "running") == 1, timeout=120), served.tail()
            assert decisions(served, "headroom") + decisions(served, "idle") == 1
            # It drained and exited, while the light load went on.
            assert wait_for(lambda: served.pid("worker-1") is None, timeout=60), served.tail()
        finally:
            light_outcomes = light.stop()
        assert set(heavy_outcomes) == {"completed"}, heavy_outcomes
        assert set(light_outcomes) == {"completed"}, light_outcomes
        assert served.answers()
    finally:
        served.stop()
