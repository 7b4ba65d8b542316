"""Channels to other services, made with the mesh's options and TLS, and health checks
through them."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prism import logs, tracing
from prism.rpc import options
from prism.rpc.tls import channel_credentials, channel_options


def call_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata for a call made on behalf of the current request: its request id."""
    request_id = logs.REQUEST_ID.get()
    return ((logs.HEADER, request_id),) if request_id else ()


def channel(address: str) -> grpc.aio.Channel:
    interceptors = tracing.client_interceptors()
    credentials = channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(
            address, options.CHANNEL_OPTIONS, interceptors=interceptors
        )
    return grpc.aio.secure_channel(
        address, credentials, channel_options(), interceptors=interceptors
    )


def sync_channel(address: str) -> grpc.Channel:
    credentials = channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options.CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials, channel_options())


# How long a call may wait for its channel to connect.
CONNECT_S = 3.0


async def connected(channel: grpc.aio.Channel, timeout: float = CONNECT_S) -> bool:
    """Whether `channel` is, or within `timeout` gets, connected. A server that came up (or
    back) moments ago may still be in the channel's reconnect backoff, where a call fails
    at once with the last connect error (a refusal from before it listened)."""
    if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
        return True
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(channel.channel_ready(), timeout)
    return channel.get_state() == grpc.ChannelConnectivity.READY


async def is_serving(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0) -> bool:
    """True when the server behind `channel` reports SERVING."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check_health(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """True when the server at `address` reports SERVING (blocking; for launchers and tests)."""
    with sync_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
