"""`prism front`: the processor and the OpenAI REST API (and KServe) in one process, the
HTTP door calling the processor's handlers as its gRPC server does, without a hop."""

from __future__ import annotations

from prism.config.stages import FrontStageConfig
from prism.gateway.door import HttpDoor
from prism.services.processor import serving


async def serve(config: FrontStageConfig) -> None:
    await serving.serve(config, lambda servicer: [HttpDoor(config, servicer.service.handlers)])
