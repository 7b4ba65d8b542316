"""`prism.v1.ResponsesService`: the Responses API over gRPC, from the REST router's
Responder, so that both answer alike and share one store. Objects travel as JSON text."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from prism.gateway.openai.responses.respond import Responder
from prism.proto.v1 import responses_pb2, responses_pb2_grpc
from prism.rpc.errors import invalid
from prism.runtime.service import Service

SERVICE = responses_pb2.DESCRIPTOR.services_by_name["ResponsesService"]


def responses_service(responder: Responder) -> Service:
    service = Service(SERVICE, responses_pb2_grpc)

    async def respond(request: responses_pb2.RespondRequest) -> AsyncIterator[Any]:
        try:
            body = json.loads(request.request)
        except json.JSONDecodeError as exc:
            raise invalid(f"request is not valid JSON: {exc}", "request") from None
        opened = await responder.open(body, "Respond")
        if not opened.stream:
            yield responses_pb2.RespondResponse(response=_text(await opened.whole()))
            return
        # Closed at once if the caller goes: the generation ends with it.
        async with contextlib.aclosing(opened.events()) as stream:
            async for events in stream:
                for event in events:
                    yield responses_pb2.RespondResponse(event=_text(event))

    async def get(request: responses_pb2.GetResponseRequest) -> Any:
        stored = responder.store.get(request.response_id)
        return responses_pb2.GetResponseResponse(response=_text(stored.response))

    async def delete(request: responses_pb2.DeleteResponseRequest) -> Any:
        responder.store.delete(request.response_id)
        return responses_pb2.DeleteResponseResponse()

    service.stream("Respond", respond)
    service.unary("GetResponse", get)
    service.unary("DeleteResponse", delete)
    return service


def _text(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))
