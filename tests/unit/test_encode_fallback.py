"""When the worker encodes in the encoders' stead (prism.services.processor.encode_fallback):
the encoders' failures that say nothing of the request, counted by cause; never a request's
own error, an aborted request, or with the fallback turned off."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prism import telemetry
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError
from prism.services.processor.encode_fallback import EncodeFallback
from prism.services.processor.failover import StageCalls


def router(encoders: list[str]) -> Router:
    return Router(StaticRegistry({"encoder": encoders}))


def counted(cause: str) -> float:
    return telemetry.ENCODE_FALLBACKS.labels(cause)._value.get()


def failing(code: grpc.StatusCode):
    async def encode() -> str:
        raise PrismError(code, "no")

    return encode


async def embeddings() -> str:
    return "embeddings"


@pytest.mark.parametrize(
    ("code", "cause"),
    [(grpc.StatusCode.UNAVAILABLE, "unavailable"), (grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
     (grpc.StatusCode.INTERNAL, "failed"), (grpc.StatusCode.DEADLINE_EXCEEDED, "failed")],
)  # fmt: skip
def test_an_encoder_that_cannot_encode_leaves_it_to_the_worker(code, cause):
    fallback = EncodeFallback(router(["e:1"]))
    before = counted(cause)
    assert asyncio.run(fallback.encoded(failing(code), StageCalls())) is None
    assert counted(cause) == before + 1
    assert asyncio.run(fallback.encoded(embeddings, StageCalls())) == "embeddings"


def test_a_requests_own_error_an_abort_or_the_fallback_off_fail_the_request():
    with pytest.raises(PrismError):
        asyncio.run(EncodeFallback(router(["e:1"])).encoded(
            failing(grpc.StatusCode.INVALID_ARGUMENT), StageCalls()))  # fmt: skip
    aborted = StageCalls(aborted=True)
    with pytest.raises(PrismError):
        asyncio.run(EncodeFallback(router(["e:1"])).encoded(
            failing(grpc.StatusCode.UNAVAILABLE), aborted))  # fmt: skip
    with pytest.raises(PrismError):
        asyncio.run(EncodeFallback(router(["e:1"]), enabled=False).encoded(
            failing(grpc.StatusCode.UNAVAILABLE), StageCalls()))  # fmt: skip


def test_with_every_encoder_down_or_none_the_worker_encodes_without_calling_one():
    calls = []

    async def encode() -> str:
        calls.append(1)
        return "embeddings"

    down = router(["e:1", "e:2"])
    down.mark_down("e:1")
    assert asyncio.run(EncodeFallback(down).encoded(encode, StageCalls())) == "embeddings"
    down.mark_down("e:2")
    before = counted("unavailable")
    assert asyncio.run(EncodeFallback(down).encoded(encode, StageCalls())) is None
    assert asyncio.run(EncodeFallback(router([])).encoded(encode, StageCalls())) is None
    assert (len(calls), counted("unavailable")) == (1, before + 2)
    # A probe that finds one serving brings the encoders back.
    down.report("e:2", serving=True)
    assert asyncio.run(EncodeFallback(down).encoded(encode, StageCalls())) == "embeddings"
