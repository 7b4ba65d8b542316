"""Which replica of a role gets the next call.

Policies: `round-robin` (each role's replicas in turn), `random`, `least-loaded` (fewest
requests in flight: the larger of what the replica last reported through `LoadService` and
what this process has open on it), and `kv`: the replica whose prefix cache already holds
most of the prompt (prism.kv_index, fed by the workers' KV events), at a cost of
`overlap_weight` times the prompt blocks it would compute + the prompt blocks the calls
open on it have yet to compute, in the spirit of Dynamo's KV router; decode goes by load,
and an encoder by the media item it is to encode: each item's content hash has an owner
among the encoders (rendezvous hashing), whose embedding cache then holds it, unless the
owner has more than `encoder_slack` calls in flight beyond the least busy encoder (a burst
of one image, or of images one encoder owns, then spreads). Under `kv` a request for a LoRA
adapter goes likewise to the adapter's owner among the engines, which then holds it loaded,
unless that owner is busier than the least busy by more than `adapter_slack`. Replicas
whose health probe or last call failed (a draining one among them) are skipped while any
other is left, and when none is, one only a probe found down goes before one a call has
just failed on.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

import grpc

from prism import telemetry
from prism.config.common import POLICIES
from prism.kv_index import KvIndex
from prism.modes import MeshRole
from prism.registry import Registry
from prism.rpc.errors import PrismError

# Roles that `kv` routes by their prefix cache: those that compute the prompt.
CACHE_ROLES = (MeshRole.WORKER, MeshRole.PREFILL)


class Router:
    def __init__(
        self,
        registry: Registry,
        policy: str = "round-robin",
        rng: random.Random | None = None,
        overlap_weight: float = 1.0,
        encoder_slack: int = 4,
        adapter_slack: int = 4,
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
        # When each replica was last marked down by a failed call, until a probe sent
        # since finds it serving.
        self._failed_at: dict[str, float] = {}
        self._reported: dict[str, int] = {}
        self._open: collections.Counter[str] = collections.Counter()
        # `kv`: what each replica's prefix cache holds, its block size (0 until a worker
        # tells it), and the prompt blocks the calls open on each replica have yet to compute.
        self.index = KvIndex()
        self.block_size = 0
        self.overlap_weight = overlap_weight
        self.encoder_slack = encoder_slack
        self.adapter_slack = adapter_slack
        self._blocks: collections.Counter[str] = collections.Counter()

    def pick(
        self,
        role: str,
        exclude: Collection[str] = (),
        keys: Sequence[int] = (),
        content: str = "",
        adapter: str = "",
    ) -> str:
        """A replica of `role` for a call; `keys`, the prompt's block keys, `content`, the
        content hash of the media it encodes, and `adapter`, the LoRA adapter it runs,
        where `kv` routes by them."""
        candidates = self._candidates(role, exclude)
        telemetry.ROUTING_DECISIONS.labels(self.policy, role).inc()
        if self.policy == "kv" and content:
            owner = _owner(candidates, content)
            least = min(candidates, key=self.load)
            return least if self.load(owner) > self.load(least) + self.encoder_slack else owner
        if self.policy == "kv" and adapter:
            # The adapter's owner holds it loaded (and the prefixes computed with it);
            # past the slack, the policy's own choice.
            owner = _owner(candidates, f"adapter:{adapter}")
            if self.load(owner) <= min(map(self.load, candidates)) + self.adapter_slack:
                return owner
        if self.policy == "random":
            return self._rng.choice(candidates)
        turn = next(self._turns[role])
        if self.policy == "kv" and role in CACHE_ROLES:
            candidates = self._by_cache(candidates, keys)
        elif self.policy in ("least-loaded", "kv"):
            lowest = min(map(self.load, candidates))
            candidates = [a for a in candidates if self.load(a) == lowest]
        return candidates[turn % len(candidates)]

    def serving(self, role: str) -> bool:
        """Whether a replica of `role` is registered and not believed down."""
        return any(a not in self._down for a in self.registry.endpoints(role))

    def owner(self, role: str, content: str) -> str:
        """The replica of `role` that `kv` routing sends the media item `content` to."""
        return _owner(self._candidates(role), content)

    def _candidates(self, role: str, exclude: Collection[str] = ()) -> list[str]:
        candidates = [a for a in self.registry.endpoints(role) if a not in exclude]
        if not candidates:
            raise PrismError(grpc.StatusCode.UNAVAILABLE, f"no {role} is available")
        # A replica believed down may have come back; try one only when none is up, and
        # then first one that only a probe found down (e.g. still starting when last
        # probed) rather than one a call just failed on.
        return (
            [a for a in candidates if a not in self._down]
            or [a for a in candidates if a not in self._failed_at]
            or candidates
        )

    def _by_cache(self, candidates: list[str], keys: Sequence[int]) -> list[str]:
        """The candidates of least cost for a prompt of block `keys`."""
        matched = self.index.overlaps(keys, candidates)

        def cost(address: str) -> float:
            computed = len(keys) - matched[address]
            return self.overlap_weight * computed + self._blocks[address]

        lowest = min(map(cost, candidates))
        cheapest = [a for a in candidates if cost(a) == lowest]
        if keys:
            telemetry.ROUTING_OVERLAP.observe(max(matched[a] for a in cheapest) / len(keys))
        return cheapest

    def load(self, address: str) -> int:
        return max(self._reported.get(address, 0), self._open[address])

    @contextmanager
    def using(
        self, address: str, blocks: int = 0, keys: Sequence[int] = ()
    ) -> Iterator[Callable[[], None]]:
        """Counts a call open on `address` for as long as the block runs and, until the
        function it gives is called (the call's first reply), the blocks of its prompt of
        `blocks` blocks that `address` computes: those its prefix cache holds of `keys` not
        counted."""
        computing = max(blocks - self.index.overlaps(keys, [address])[address], 0)
        self._open[address] += 1
        self._blocks[address] += computing

        def computed() -> None:
            nonlocal computing
            self._blocks[address] -= computing
            computing = 0

        try:
            yield computed
        finally:
            self._open[address] -= 1
            computed()

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
                self._failed_at.pop(address, None)
        else:
            self._down.add(address)
        if in_flight is not None:
            self._reported[address] = in_flight

    def mark_down(self, address: str) -> None:
        """A call to `address` failed as if it were gone; the next probe may clear it."""
        self._down.add(address)
        self._failed_at[address] = time.monotonic()


def _owner(candidates: Sequence[str], content: str) -> str:
    """Rendezvous (highest random weight) hashing: the candidate that ranks first for
    `content`. When one leaves, only what it owned moves, spread over the rest; written
    here since it is a few lines and no routing library offers it alone."""

    def weight(address: str) -> bytes:
        return hashlib.blake2b(f"{address}\0{content}".encode(), digest_size=8).digest()

    return max(candidates, key=weight)
