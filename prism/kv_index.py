"""What prompt blocks each replica's prefix cache holds, learned from its engine's KV
events, and how much of a prompt each could serve from it.

A block is keyed the way vLLM's prefix cache tells blocks apart: by every token before it
and in it, and by the media items whose tokens it holds, each as its identifier (Prism's
content hash, which workers give vLLM as the item's uuid) and its offset from the block's
start. Prism chains its own keys rather than reproduce vLLM's hash (its function, seed and
encoding are vLLM's to change): a worker keys the blocks its engine's events name by
vLLM's hash (`EngineBlocks`) and sends the keys; the processor's `KvIndex` holds every
replica's keys.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

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


def lay_out(
    token_ids: Sequence[int],
    placeholders: Set[int],
    items: Mapping[int, Sequence[tuple[str, int]]],
) -> tuple[list[int], list[MediaSpan]]:
    """A prompt as the engine lays it out, as far as it can be known: each placeholder
    token repeated for its item's tokens, as vLLM expands those of the families Prism
    builds. `items` gives, for a modality's placeholder token, that modality's items in
    prompt order as (identifier, token count); the prompt ends before a placeholder whose
    item is not given."""
    tokens: list[int] = []
    spans: list[MediaSpan] = []
    taken: Counter[int] = Counter()
    for token in token_ids:
        if token in placeholders:
            known = items.get(token, ())
            if taken[token] >= len(known):
                break
            identifier, length = known[taken[token]]
            taken[token] += 1
            spans.append(MediaSpan(identifier, len(tokens), length))
            tokens += [token] * length
        else:
            tokens.append(token)
    return tokens, spans


def root_key(adapter: str = "") -> int:
    """The parent of a prompt's first block: one chain per LoRA adapter (`adapter`, its
    name; "" for the base model), as vLLM keys an adapter's blocks by its name."""
    if not adapter:
        return _ROOT
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "little")


def prompt_keys(
    token_ids: Sequence[int], media: Sequence[MediaSpan], block_size: int, adapter: str = ""
) -> list[int]:
    """The keys of a prompt's full blocks, first to last, under the LoRA `adapter` ("" for
    the base model). `media` lie in order, as the engine lays them out."""
    keys: list[int] = []
    parent = root_key(adapter)
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


class EngineBlocks:
    """One engine's cached blocks as Prism's keys, from its KV events: the worker keeps
    it and sends the keys, so that the processor's index needs neither tokens nor vLLM's
    hashes."""

    def __init__(self) -> None:
        # vLLM's hash of each block held -> Prism's key of it.
        self._keys: dict[EngineHash, int] = {}
        # Prism's keys held, and by how many of vLLM's blocks (one may be stored again).
        self._held: Counter[int] = Counter()
        # Blocks refused for a parent not held.
        self.orphans = 0

    def stored(
        self,
        hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        media: Sequence[Sequence[MediaKey]],
        adapter: str = "",
    ) -> list[int]:
        """Blocks the engine cached: vLLM's `hashes` of consecutive blocks whose tokens
        are `token_ids`, after the block vLLM hashed `parent` (None at the prompt's start,
        under the LoRA `adapter`, "" for the base model), with each block's `media` (empty,
        or one entry per block). Returns the keys newly held. Blocks after a parent not
        held cannot be keyed, and are left out."""
        if parent is None:
            key = root_key(adapter)
        elif parent in self._keys:
            key = self._keys[parent]
        else:
            self.orphans += len(hashes)
            return []
        new = []
        for i, engine_hash in enumerate(hashes):
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            key = block_key(key, tokens, media[i] if media else ())
            if engine_hash in self._keys:
                continue
            self._keys[engine_hash] = key
            self._held[key] += 1
            if self._held[key] == 1:
                new.append(key)
        return new

    def removed(self, hashes: Iterable[EngineHash]) -> list[int]:
        """Blocks the engine evicted; returns the keys no longer held."""
        gone = []
        for engine_hash in hashes:
            key = self._keys.pop(engine_hash, None)
            if key is None:
                continue
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
                gone.append(key)
        return gone

    def cleared(self) -> None:
        """The engine dropped its whole prefix cache."""
        self._keys.clear()
        self._held.clear()

    def keys(self) -> list[int]:
        """Every key held."""
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)


class KvIndex:
    """Which replicas hold each block key, from what each replica's worker sends."""

    def __init__(self) -> None:
        self._replicas: dict[str, set[int]] = {}
        self._holders: dict[int, set[str]] = {}

    def update(self, replica: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        held = self._replicas.setdefault(replica, set())
        for key in removed:
            if key in held:
                held.discard(key)
                self._release(key, replica)
        for key in stored:
            if key not in held:
                held.add(key)
                self._holders.setdefault(key, set()).add(replica)

    def receive(
        self, replica: str, snapshot: bool, stored: Iterable[int], removed: Iterable[int]
    ) -> None:
        """A message of `replica`'s worker (KvEventsService): a `snapshot` of every key it
        holds, or keys it evicted and then stored."""
        if snapshot:
            self.drop(replica)
            self._replicas[replica] = set()
        self.update(replica, stored, removed)

    def drop(self, replica: str) -> None:
        """Forgets all that `replica` holds: it left, or its events were lost."""
        for key in self._replicas.pop(replica, ()):
            self._release(key, replica)

    def _release(self, key: int, replica: str) -> None:
        holders = self._holders[key]
        holders.discard(replica)
        if not holders:
            del self._holders[key]

    def size(self, replica: str) -> int:
        """How many blocks `replica` holds."""
        return len(self._replicas.get(replica, ()))

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
