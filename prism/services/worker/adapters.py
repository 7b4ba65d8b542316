"""`EngineService.LoadAdapter` and `UnloadAdapter`: the processor loads an adapter loaded at
run time on every engine first, so that one that cannot be loaded is refused (400, naming
the cause) before the mesh serves it, and drops it from them when it is unloaded."""

from __future__ import annotations

from prism.engine.lora import LoraAdapters
from prism.proto.stage.v1 import engine_pb2
from prism.rpc.errors import invalid
from prism.runtime.service import Service


def serve_adapters(service: Service, loras: LoraAdapters) -> None:
    """Adds the two handlers to the worker's `service`, on the engine's `loras`."""

    async def load(
        request: engine_pb2.EngineServiceLoadAdapterRequest,
    ) -> engine_pb2.EngineServiceLoadAdapterResponse:
        adapter = request.adapter
        if not adapter.name or not adapter.path:
            raise invalid("an adapter needs a name and a path", "adapter")
        try:
            await loras.request(adapter.name, adapter.path)
        except ValueError as exc:
            raise invalid(str(exc), "adapter") from None
        return engine_pb2.EngineServiceLoadAdapterResponse(max_loras=loras.max_loras)

    async def unload(
        request: engine_pb2.EngineServiceUnloadAdapterRequest,
    ) -> engine_pb2.EngineServiceUnloadAdapterResponse:
        unloaded = await loras.drop(request.name)
        return engine_pb2.EngineServiceUnloadAdapterResponse(unloaded=unloaded)

    service.unary("LoadAdapter", load)
    service.unary("UnloadAdapter", unload)
