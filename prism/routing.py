"""Which replica of a role gets the next call.

Policies: `round-robin` (each role's replicas in turn), `random`, and `least-loaded`
(fewest requests in flight: the larger of what the replica last reported through
`LoadService` and what this process has open on it). Replicas whose health probe or last
call failed are skipped while any other is left.
"""

from __future__ import annotations

import collections
import itertools
import math
import random
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import grpc

from prism.registry import Registry
from prism.rpc import PrismError

POLICIES = ("round-robin", "random", "least-loaded")


class Router:
    def __init__(
        self, registry: Registry, policy: str = "round-robin", rng: random.Random | None = None
    ):
        if policy not in POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}"
            )
        self.registry = registry
        self.policy = policy
        self._rng = rng or random.Random()
        self._turns: dict[str, itertools.count] = collections.defaultdict(itertools.count)
        self._down: set[str] = set()
        # When each replica was last marked down by a failed call.
        self._failed_at: dict[str, float] = {}
        self._reported: dict[str, int] = {}
        self._open: collections.Counter[str] = collections.Counter()

    def pick(self, role: str, exclude: Collection[str] = ()) -> str:
        candidates = [a for a in self.registry.endpoints(role) if a not in exclude]
        if not candidates:
            raise PrismError(grpc.StatusCode.UNAVAILABLE, f"no {role} is available")
        # A replica believed down may have come back; try one only when none is up.
        candidates = [a for a in candidates if a not in self._down] or candidates
        if self.policy == "random":
            return self._rng.choice(candidates)
        turn = next(self._turns[role])
        if self.policy == "least-loaded":
            lowest = min(map(self.load, candidates))
            candidates = [a for a in candidates if self.load(a) == lowest]
        return candidates[turn % len(candidates)]

    def load(self, address: str) -> int:
        return max(self._reported.get(address, 0), self._open[address])

    @contextmanager
    def using(self, address: str) -> Iterator[None]:
        """Counts a call open on `address` for as long as the block runs."""
        self._open[address] += 1
        try:
            yield
        finally:
            self._open[address] -= 1

    def report(
        self,
        address: str,
        serving: bool,
        in_flight: int | None = None,
        probed_at: float | None = None,
    ) -> None:
        """What a probe of `address`, sent at `probed_at` (time.monotonic()), found.

        A probe answered before a call to the replica failed says nothing of it since: a
        replica killed mid-stream would otherwise come back into routing (and take the
        request that migrates away from it) on the answer its last probe got alive."""
        if serving:
            if probed_at is None or probed_at >= self._failed_at.get(address, -math.inf):
                self._down.discard(address)
        else:
            self._down.add(address)
        if in_flight is not None:
            self._reported[address] = in_flight

    def mark_down(self, address: str) -> None:
        """A call to `address` failed as if it were gone; the next probe may clear it."""
        self._down.add(address)
        self._failed_at[address] = time.monotonic()
