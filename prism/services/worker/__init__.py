"""The worker stage: `EngineService` in one role, on a vLLM engine
(prism.services.worker.servicer) or, with `--engine sim`, on a simulated one without a
model (prism.services.worker.sim). The engine's modules are imported only when chosen:
the simulated worker starts without loading vLLM or torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.rpc.errors import invalid
from prism.rpc.server import InFlightLimit
from prism.runtime.service import Service, StreamHandler, UnaryHandler

if TYPE_CHECKING:
    from prism.config.commands import WorkerStageConfig


def check_request(request: engine_pb2.GenerateRequest) -> None:
    """What every engine asks of a request before anything else."""
    if not request.request_id:
        raise invalid("request_id is required", "request_id")
    if not request.prompt_token_ids:
        raise invalid("prompt_token_ids is empty", "prompt_token_ids")


def engine_service(generate: StreamHandler, abort: UnaryHandler, max_in_flight: int) -> Service:
    """`EngineService` served from its handlers, whatever the engine, bounded by
    `max_in_flight` requests at once."""
    service = Service(
        engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
        engine_pb2_grpc,
        InFlightLimit(max_in_flight),
    )
    service.stream("Generate", generate)
    service.unary("Abort", abort)
    return service


async def serve(config: WorkerStageConfig) -> None:
    if config.engine.engine == "sim":
        from prism.services.worker import sim

        await sim.serve(config)
    else:
        from prism.services.worker import servicer

        await servicer.serve(config)
