"""`prism.v1.MessagesService`: Anthropic's Messages API over gRPC, from the REST router's
`open_message`, so that both answer alike. Objects travel as JSON text."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from prism.gateway.anthropic.messenger import Chat, open_message
from prism.proto.v1 import messages_pb2, messages_pb2_grpc
from prism.rpc.errors import invalid
from prism.runtime.service import Service

SERVICE = messages_pb2.DESCRIPTOR.services_by_name["MessagesService"]


def messages_service(chat: Chat) -> Service:
    service = Service(SERVICE, messages_pb2_grpc)

    async def create(request: messages_pb2.CreateMessageRequest) -> AsyncIterator[Any]:
        try:
            body = json.loads(request.request)
        except json.JSONDecodeError as exc:
            raise invalid(f"request is not valid JSON: {exc}", "request") from None
        opened = await open_message(chat, body, "CreateMessage")
        if not opened.stream:
            yield messages_pb2.CreateMessageResponse(message=_text(await opened.whole()))
            return
        # Closed at once if the caller goes: the generation ends with it.
        async with contextlib.aclosing(opened.events()) as stream:
            async for events in stream:
                for _, data in events:
                    yield messages_pb2.CreateMessageResponse(event=_text(data))

    service.stream("CreateMessage", create)
    return service


def _text(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))
