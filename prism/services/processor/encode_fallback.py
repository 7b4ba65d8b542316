"""Encoding that never fails a request: where no encoder can take a request's images and
videos (none serving, all full, or the encode failed), the worker that would have read
their embeddings encodes them from the pixels instead, as in EPD, and answers the same.
`--no-encoder-fallback` fails such a request instead, for deployments that would rather
shed load than move encoding onto their engines.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from prism import telemetry
from prism.modes import MeshRole
from prism.routing import Router
from prism.rpc.errors import PrismError
from prism.services.processor.failover import StageCalls

log = logging.getLogger(__name__)

T = TypeVar("T")

# What an encoder's failure says of the encoders, by status: a request the encoder refused
# as invalid (a corrupt image, say) would fail in the worker too, and is not among them.
_CAUSES = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "full",
    grpc.StatusCode.DEADLINE_EXCEEDED: "failed",
    grpc.StatusCode.INTERNAL: "failed",
    grpc.StatusCode.UNKNOWN: "failed",
}


class EncodeFallback:
    def __init__(self, router: Router, enabled: bool = True) -> None:
        self.router = router
        self.enabled = enabled

    async def encoded(self, encode: Callable[[], Awaitable[T]], call: StageCalls) -> T | None:
        """What `encode()` gives, or None where the worker is to encode the pixels."""
        if not self.enabled:
            return await encode()
        if not self.router.serving(MeshRole.ENCODER):
            # Each call to a dead encoder would first wait for its channel to connect.
            telemetry.ENCODE_FALLBACKS.labels("unavailable").inc()
            return None
        try:
            return await encode()
        except (grpc.aio.AioRpcError, PrismError) as exc:
            error = PrismError.from_rpc_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc
            cause = _CAUSES.get(error.code)
            if cause is None or call.aborted:
                raise
            details = error.message
            log.warning("encoding in the worker: the encoders are %s (%s)", cause, details)
            telemetry.ENCODE_FALLBACKS.labels(cause).inc()
            return None
