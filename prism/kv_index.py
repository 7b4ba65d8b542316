"""What prompt blocks each replica's prefix cache holds, learned from its engine's KV
events, and how much of a prompt each could serve from it.

A block is keyed the way vLLM's prefix cache tells blocks apart: by every token before it
and in it, and by the media items whose tokens it holds, each as its identifier (Prism's
content hash, which workers give vLLM as the item's uuid) and its offset from the block's
start. Prism chains its own keys rather than reproduce vLLM's hash (its function, seed and
encoding are vLLM's to change); each replica's events name blocks by vLLM's hash, which
the index maps to its own key of the same block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# A media item's share of one block: its identifier and where it starts, counted from the
# block's first token (negative when it began in an earlier block).
MediaKey = tuple[str, int]
# vLLM names a block by bytes (sha256) or, if so configured, an int.
EngineHash = bytes | int

_ROOT = 0


@dataclass(frozen=True)
class MediaSpan:
    """Where one media item's tokens lie in a prompt, placeholders expanded."""

    identifier: str
    offset: int
    length: int


def block_key(parent: int, token_ids: Sequence[int], media: Sequence[MediaKey]) -> int:
    """The key of a block from its parent's key, its tokens and its media."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    for identifier, offset in media:
        digest.update(f"\0{identifier}\0{offset}".encode())
    return int.from_bytes(digest.digest(), "little")


def prompt_keys(token_ids: Sequence[int], media: Sequence[MediaSpan], block_size: int) -> list[int]:
    """The keys of a prompt's full blocks, first to last. `media` lie in order, as the
    engine lays them out."""
    keys: list[int] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        held = [
            (span.identifier, span.offset - start)
            for span in media
            if span.offset < end and span.offset + span.length > start
        ]
        parent = block_key(parent, token_ids[start:end], held)
        keys.append(parent)
    return keys


@dataclass
class _Replica:
    # vLLM's hash of each block held -> Prism's key of it.
    keys: dict[EngineHash, int] = field(default_factory=dict)
    # Prism's keys held, and by how many of vLLM's blocks (a block may be stored again).
    held: Counter[int] = field(default_factory=Counter)


class KvIndex:
    """Every replica's cached blocks, and which replicas hold each block."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[int, set[str]] = {}

    def stored(
        self,
        replica: str,
        hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        media: Sequence[Sequence[MediaKey]],
    ) -> bool:
        """Blocks that `replica` cached: vLLM's `hashes` of consecutive blocks whose tokens
        are `token_ids`, after the block vLLM hashed `parent` (None at the prompt's start),
        with each block's `media` (empty, or one entry per block). False if the parent is
        not known: the blocks cannot be placed, and the caller should resynchronize."""
        state = self._replicas.setdefault(replica, _Replica())
        if parent is None:
            key = _ROOT
        elif parent in state.keys:
            key = state.keys[parent]
        else:
            return False
        for i, engine_hash in enumerate(hashes):
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            key = block_key(key, tokens, media[i] if media else ())
            if engine_hash in state.keys:
                continue
            state.keys[engine_hash] = key
            state.held[key] += 1
            if state.held[key] == 1:
                self._holders.setdefault(key, set()).add(replica)
        return True

    def removed(self, replica: str, hashes: Iterable[EngineHash]) -> None:
        """Blocks that `replica` evicted."""
        state = self._replicas.get(replica)
        if state is None:
            return
        for engine_hash in hashes:
            key = state.keys.pop(engine_hash, None)
            if key is None:
                continue
            state.held[key] -= 1
            if not state.held[key]:
                del state.held[key]
                self._release(key, replica)

    def drop(self, replica: str) -> None:
        """Forgets all that `replica` holds: it cleared its cache, left, or will send a
        snapshot."""
        state = self._replicas.pop(replica, None)
        for key in state.held if state else ():
            self._release(key, replica)

    def _release(self, key: int, replica: str) -> None:
        holders = self._holders[key]
        holders.discard(replica)
        if not holders:
            del self._holders[key]

    def size(self, replica: str) -> int:
        """How many distinct blocks `replica` holds."""
        state = self._replicas.get(replica)
        return len(state.held) if state else 0

    def overlaps(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each of `replicas`, how many of the prompt's first blocks (`keys`) it holds
        in a row: what its prefix cache would serve."""
        matched = dict.fromkeys(replicas, 0)
        active = set(matched)
        for depth, key in enumerate(keys):
            active &= self._holders.get(key, set())
            if not active:
                break
            for replica in active:
                matched[replica] = depth + 1
        return matched


def rendezvous(key: str, candidates: Iterable[str]) -> list[str]:
    """`candidates` in the order that `key` prefers them (rendezvous hashing): each key has
    one owner while the candidates stay, and a candidate that leaves moves only its keys."""

    def weight(candidate: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{candidate}".encode(), digest_size=8).digest()

    return sorted(candidates, key=weight, reverse=True)
