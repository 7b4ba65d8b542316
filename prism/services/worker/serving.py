"""The worker stage on a vLLM engine as a process: `serve` starts the engine and serves its
`EngineService` (and, where the role prefills, `KvEventsService`) on the stage runtime.
(`--engine sim`: prism.services.sim.serving.)"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from prism import telemetry
from prism.engine.kv_events import KvEvents
from prism.engine.launch import config_info, embeddings_device, start_engine, stop_engine
from prism.media.audio import AudioDecoder
from prism.media.modalities import per_prompt
from prism.media.video import VideoDecoder
from prism.modes import EngineRole, modes_served
from prism.runtime.stage import Stage
from prism.services.worker.adapters import serve_adapters
from prism.services.worker.kv_publisher import KvPublisher
from prism.services.worker.roles import make_role
from prism.services.worker.servicer import EngineServicer
from prism.transfer import open_transfer

if TYPE_CHECKING:
    from prism.config.commands import WorkerStageConfig


async def serve(config: WorkerStageConfig) -> None:
    with tempfile.TemporaryDirectory(prefix="prism-worker-") as directory:
        await _serve(config, Path(directory))


async def _serve(config: WorkerStageConfig, directory: Path) -> None:
    worker, media = config.worker, config.media
    # Roles that prefill tell what their prefix cache holds; decode is routed by load.
    kv_events = KvEvents(directory) if worker.role != EngineRole.DECODE else None
    # The engine before the stage: on the CPU its core is forked from this process, which
    # must not yet run the stage's tracing (its exporter's thread would start again in the
    # core, and export over this process's gRPC channel there).
    engine = start_engine(
        config, directory, per_prompt(media), kv_events.config() if kv_events else None
    )
    stage = Stage(config, EngineRole(worker.role).mesh_role)
    role = make_role(worker.role, engine, worker.kv_lease_s)
    reads_embeddings = worker.enable_mm_embeds or role.reads_embeddings
    transfer = (
        open_transfer(
            config.transfer.transfer, worker.pool_mib * 2**20, device=embeddings_device(engine)
        )
        if reads_embeddings
        else None
    )
    videos = VideoDecoder.for_model(config.model.model, media.video_frames, media.video_fps)
    audios = AudioDecoder.for_model(config.model.model)
    servicer = EngineServicer(engine, role, transfer, config.limit.max_in_flight, videos, audios)
    collectors = [telemetry.transfer_collector(transfer)] if transfer else []
    collectors.append(
        telemetry.gauge(
            "prism_engine_requests_in_flight", "Requests this worker runs", servicer.in_flight
        )
    )
    telemetry.info("prism_engine_config", "The running engine's settings", config_info(engine))
    serve_adapters(servicer.service, servicer.loras)
    services, tasks = [servicer.service], [servicer.watch]
    if kv_events is not None:
        kv_events.engine = engine
        services.append(kv_events_service(kv_events).service)
        tasks.append(kv_events.read)
    try:
        await stage.serve(
            services,
            modes_served(worker.role, worker.enable_mm_embeds),
            collectors,
            in_flight=servicer.in_flight,
            tasks=tasks,
        )
    finally:
        stop_engine(engine)
        if transfer is not None:
            transfer.close()


def kv_events_service(kv_events: KvEvents) -> KvPublisher:
    """`KvEventsService`, serving what the engine's KV events say it holds."""
    publisher = KvPublisher(kv_events.blocks.keys, lambda: kv_events.block_size)
    kv_events.send = publisher.send
    return publisher
