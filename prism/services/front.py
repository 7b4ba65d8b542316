"""`prism front`: the processor and the OpenAI REST API (and KServe) in one process, the
HTTP door calling the processor's handlers as its gRPC server does, without a hop. The
Responses API is served on both doors, REST and gRPC (`prism.v1.ResponsesService`, beside
`InferenceService`), from one store; Anthropic's Messages API too
(`prism.v1.MessagesService`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from prism.config.commands import FrontStageConfig
from prism.gateway.anthropic.rpc import messages_service
from prism.gateway.client import LocalCall
from prism.gateway.door import HttpDoor, ensure_doors_free
from prism.gateway.openai.responses.respond import Responder
from prism.gateway.openai.responses.rpc import responses_service
from prism.gateway.openai.responses.store import ResponseStore
from prism.runtime.service import Service
from prism.services.processor import serving

if TYPE_CHECKING:
    # Not at run time: it loads vLLM and torch, which serving.serve imports when it serves.
    from prism.services.processor.servicer import InferenceServicer


async def serve(config: FrontStageConfig) -> None:
    ensure_doors_free(config)
    store = ResponseStore.of(config.gateway)

    def doors(servicer: InferenceServicer) -> list[HttpDoor]:
        return [HttpDoor(config, servicer.service.handlers, store)]

    def services(servicer: InferenceServicer) -> list[Service]:
        # As the door's InProcessClient calls Chat, with the gateway's deadline.
        chat = functools.partial(LocalCall, servicer.service.handlers.Chat,
                                 timeout=config.gateway.request_timeout or None)  # fmt: skip
        return [responses_service(Responder(store, chat)), messages_service(chat)]

    await serving.serve(config, doors, services)
