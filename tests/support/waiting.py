"""Waiting for a condition, from a thread or on an event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, period: float = 0.1) -> bool:
    """Whether `predicate` turns true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


async def until(predicate: Callable[[], bool], timeout: float = 15.0, period: float = 0.02) -> bool:
    """`wait_for` on an event loop: whether `predicate` turns true within `timeout` seconds,
    the loop running meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(period)
    return predicate()
