"""`prism worker --engine sim` as a process: `serve` runs `--sim-engines` simulated engines,
each its own replica (its server, its KV events), on the stage runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prism import telemetry
from prism.config.sim import SimConfig
from prism.modes import EngineRole, modes_served
from prism.rpc.server import Server
from prism.runtime.stage import Replica, Stage
from prism.services.sim.engine import SimEngine
from prism.services.sim.servicer import SimServicer, placeholders, sim_config
from prism.services.worker.kv_publisher import KvPublisher

if TYPE_CHECKING:
    from prism.config.commands import WorkerStageConfig


async def serve(settings: WorkerStageConfig) -> None:
    worker, sim = settings.worker, settings.sim
    role = EngineRole(worker.role)
    stage = Stage(settings, role.mesh_role)
    config = sim_config(sim, settings.model, settings.engine.stream_interval)
    servicers = [_servicer(settings, role, config) for _ in range(sim.sim_engines)]
    engines = [servicer.engine for servicer in servicers]

    def in_flight() -> int:
        return sum(servicer.in_flight() for servicer in servicers)

    collectors = [
        telemetry.gauge("prism_engine_requests_in_flight", "Requests this worker runs", in_flight),
        telemetry.gauge(
            "prism_sim_kv_blocks_used", "KV blocks the simulated engines use",
            lambda: sum(engine.pool.used() for engine in engines),
        ),
    ]  # fmt: skip
    for engine in engines:
        engine.start()
    try:
        await stage.serve_replicas(
            [_replica(servicer, role) for servicer in servicers],
            modes_served(role, worker.enable_mm_embeds),
            collectors,
        )
    finally:
        for engine in engines:
            await engine.stop()


def _servicer(settings: WorkerStageConfig, role: EngineRole, config: SimConfig) -> SimServicer:
    """One simulated engine, and its service."""
    worker, sim = settings.worker, settings.sim
    publisher: KvPublisher | None = None

    def changed(stored: list[int], removed: list[int]) -> None:
        # Exact: a key is stored when first cached and removed when last evicted.
        telemetry.KV_BLOCKS_HELD.inc(len(stored) - len(removed))
        if publisher is not None:
            publisher.publish(stored, removed)

    engine = SimEngine(config, changed)
    if role != EngineRole.DECODE:
        publisher = KvPublisher(engine.pool.keys, lambda: config.block_size)
    address = (worker.kv_host or settings.address.host, settings.address.port)
    return SimServicer(
        engine, role, placeholders(settings.model.model), sim.sim_media_tokens,
        sim.sim_kv_tokens_per_s, address, worker.kv_lease_s, settings.limit.max_in_flight,
        publisher,
    )  # fmt: skip


def _replica(servicer: SimServicer, role: EngineRole) -> Replica:
    """One simulated engine as its own replica: its server, its KV events."""

    async def learn_port(server: Server) -> None:
        # A prefill names itself to decode by its server's port, known once it binds.
        servicer.address = (servicer.address[0], server.port)

    publisher = [servicer.publisher.service] if servicer.publisher else []
    return Replica([servicer.service, *publisher], servicer.in_flight, [learn_port])
