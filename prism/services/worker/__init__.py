"""The worker stage: `EngineService` in one role, on a vLLM engine
(prism.services.worker.servicer) or, with `--engine sim`, on a simulated one without a
model (prism.services.sim); prism.services.worker.serving starts either. What both
engines' services share is here."""

from __future__ import annotations

from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.rpc.errors import invalid
from prism.rpc.server import InFlightLimit
from prism.runtime.service import Service, StreamHandler, UnaryHandler


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
