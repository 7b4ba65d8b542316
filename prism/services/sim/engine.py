"""A simulated engine: vLLM's scheduling and prefix cache without a model.

It runs steps as vLLM's V1 scheduler does: every running sequence that has its prompt
decodes one token, and what is left of the token budget goes to prompts (chunked, the
running ones first, then new ones in arrival order, while there are sequence slots and
KV blocks). A step takes `decode_step_s` plus its prompt tokens at `prefill_tokens_per_s`,
slept, not computed. KV is counted in blocks: a prompt's full blocks are cached under
their keys (prism.kv_index) once computed, reused by later prompts that start the same
way, and evicted least recently used when blocks run out; a decode that finds no block
preempts the newest sequence, which computes its tokens again later. Idle, it waits.

Tokens are not sampled: each is a function of the sequence's seed (or id) and position,
so that a decode engine draws the token its prefill drew, as seeded engines do.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from prism.config.sim import SimConfig

# Generated tokens come from this range, plain tokens in the vocabularies Prism builds
# and in common ones (special tokens sit below it or far above it).
_TOKENS = range(256, 1024)


class BlockPool:
    """KV blocks by count: free ones, cached ones under their keys (in use, or evictable
    in least recently used order), and uncached ones in use."""

    def __init__(self, num_blocks: int, changed: Callable[[list[int], list[int]], None]) -> None:
        """`changed(stored, removed)` hears of every key cached and evicted."""
        self.num_blocks = num_blocks
        self.free = num_blocks
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._changed = changed

    def keys(self) -> list[int]:
        return list(self._refs)

    def available(self) -> int:
        return self.free + len(self._evictable)

    def used(self) -> int:
        return self.num_blocks - self.available()

    def cached_prefix(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, are cached."""
        count = 0
        for key in keys:
            if key not in self._refs:
                break
            count += 1
        return count

    def take(self, keys: Sequence[int], fresh: int) -> bool:
        """Uses the cached blocks `keys` and `fresh` new ones, evicting if it must; False
        (and nothing taken) if the blocks are not there."""
        evictable = sum(1 for key in keys if key in self._evictable)
        if self.available() - evictable < fresh:
            return False
        for key in keys:
            if self._refs[key] == 0:
                del self._evictable[key]
            self._refs[key] += 1
        evicted = []
        while self.free < fresh:
            key, _ = self._evictable.popitem(last=False)
            del self._refs[key]
            evicted.append(key)
            self.free += 1
        self.free -= fresh
        if evicted:
            self._changed([], evicted)
        return True

    def cache(self, keys: Sequence[int]) -> list[int]:
        """Names computed fresh blocks by `keys`; returns the keys the sequence now holds
        (a key another sequence cached first is shared, and the block freed)."""
        stored = []
        for key in keys:
            if key in self._refs:
                if self._refs[key] == 0:
                    del self._evictable[key]
                self._refs[key] += 1
                self.free += 1
            else:
                self._refs[key] = 1
                stored.append(key)
        if stored:
            self._changed(stored, [])
        return list(keys)

    def give_back(self, keys: Sequence[int], fresh: int) -> None:
        for key in keys:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                self._evictable[key] = None
        self.free += fresh

    def clear(self) -> None:
        """Drops every evictable block (vLLM's prefix cache reset)."""
        for key in self._evictable:
            del self._refs[key]
        self.free += len(self._evictable)
        removed = list(self._evictable)
        self._evictable.clear()
        if removed:
            self._changed([], removed)


@dataclass
class Output:
    """What one step gave a sequence: new tokens; on the first, the prompt's usage; on
    the last, why it ended."""

    token_ids: list[int]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first: bool = False
    finish: str = ""

    def then(self, later: Output) -> Output:
        """This output and the `later` one, as one."""
        self.token_ids += later.token_ids
        self.finish = later.finish
        return self


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt_len: int
    keys: list[int]
    max_tokens: int
    seed: str
    # Decode with prefill's KV: the prompt needs no computing.
    prefilled: bool = False
    # Prefill roles: keep the prompt's blocks after the end, until released.
    hold: bool = False
    # Tokens a reply holds after the first (the request's; the engine's if larger).
    stream_interval: int = 1
    computed: int = 0
    generated: int = 0
    cached_tokens: int = 0
    shared: list[int] = field(default_factory=list)
    fresh: int = 0
    started: bool = False
    finished: bool = False
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)

    @property
    def length(self) -> int:
        """Tokens whose KV the sequence needs: the prompt and what it generated."""
        return self.prompt_len + self.generated

    def token(self, position: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=4).digest()
        return _TOKENS[int.from_bytes(digest, "little") % len(_TOKENS)]


class SimEngine:
    def __init__(
        self,
        config: SimConfig,
        changed: Callable[[list[int], list[int]], None] = lambda stored, removed: None,
    ) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks, changed)
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        # Finished prefills whose blocks wait for a decode to read them.
        self.held: dict[str, Seq] = {}
        self.steps = 0
        self.preemptions = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    async def generate(self, seq: Seq) -> AsyncIterator[Output]:
        """Runs `seq` to its end; aborted if the caller stops reading."""
        if seq.prompt_len + 1 > self.config.max_model_len:
            raise ValueError(
                f"the prompt ({seq.prompt_len} tokens) leaves no room to generate within "
                f"the model's {self.config.max_model_len} tokens"
            )
        if self.blocks_for(seq.prompt_len) > self.config.num_blocks:
            raise ValueError(
                f"the prompt ({seq.prompt_len} tokens) needs more KV than the engine has"
            )
        if not seq.finished:
            self.waiting.append(seq)
            self._wake.set()
        interval = max(seq.stream_interval, self.config.stream_interval)
        try:
            while True:
                output = await seq.outputs.get()
                # What is ready leaves together; after the first token, a reply waits for
                # `interval` tokens or the end, as vLLM's --stream-interval.
                while not output.finish and (
                    not seq.outputs.empty()
                    or (not output.first and len(output.token_ids) < interval)
                ):
                    output = output.then(await seq.outputs.get())
                yield output
                if output.finish:
                    return
        finally:
            if not seq.finished:
                self.abort(seq)

    def abort(self, seq: Seq) -> bool:
        if seq.finished:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, "abort", hold=False)
        return True

    def release(self, request_id: str) -> bool:
        """Frees the blocks a finished prefill holds for `request_id`."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.pool.give_back(seq.shared, seq.fresh)
        seq.shared, seq.fresh = [], 0
        self._wake.set()
        return True

    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def _finish(self, seq: Seq, reason: str, hold: bool) -> None:
        seq.finished = True
        if hold:
            self.held[seq.request_id] = seq
        else:
            self.pool.give_back(seq.shared, seq.fresh)
            seq.shared, seq.fresh = [], 0
        seq.outputs.put_nowait(Output([], finish=reason))
        # Its blocks and its slot may let a waiting sequence in.
        self._wake.set()

    def _admit(self, seq: Seq) -> bool:
        """Gives `seq` the blocks its tokens need, its prompt's cached ones first."""
        if seq.prefilled:
            # A decode has the prompt's KV but for its last token, which it computes
            # again to draw the first token, as a vLLM decode engine does.
            if not self.pool.take([], self.blocks_for(seq.length)):
                return False
            seq.computed, seq.fresh = seq.length - 1, self.blocks_for(seq.length)
            return True
        # As vLLM, the last prompt token is always computed: it gives the next token.
        reusable = min(
            self.pool.cached_prefix(seq.keys), (seq.length - 1) // self.config.block_size
        )
        shared = seq.keys[:reusable]
        fresh = self.blocks_for(seq.length) - reusable
        if not self.pool.take(shared, fresh):
            return False
        seq.shared, seq.fresh = shared, fresh
        seq.computed = reusable * self.config.block_size
        if not seq.started:
            seq.cached_tokens = seq.computed
        return True

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Blocks for `seq`'s first `tokens`, preempting the newest sequences for them;
        False where `seq` itself is preempted."""
        while self.blocks_for(tokens) > len(seq.shared) + seq.fresh:
            if self.pool.take([], 1):
                seq.fresh += 1
                continue
            newest = self.running[-1]
            self._preempt()
            if newest is seq:
                return False
        return True

    def _preempt(self) -> None:
        """Frees the newest running sequence's blocks; it waits first in line to compute
        its tokens again."""
        seq = self.running.pop()
        self.preemptions += 1
        self.pool.give_back(seq.shared, seq.fresh)
        seq.shared, seq.fresh, seq.computed = [], 0, 0
        self.waiting.insert(0, seq)

    def _schedule(self) -> tuple[dict[Seq, int], int]:
        """The step's tokens for each sequence (a decode's is one), and how many of
        them are prompt tokens."""
        budget = self.config.max_num_batched_tokens
        chunks: dict[Seq, int] = {}
        for seq in list(self.running):
            if seq not in self.running or not budget:
                continue
            tokens = min(seq.length - seq.computed, budget)
            if self._grow(seq, seq.computed + tokens):
                chunks[seq] = tokens
                budget -= tokens
        while self.waiting and budget and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.pop(0)
            self.running.append(seq)
            chunks[seq] = min(seq.length - seq.computed, budget)
            budget -= chunks[seq]
        decodes = sum(
            1 for seq, tokens in chunks.items() if seq.started and seq.computed == seq.length - 1
        )
        return chunks, sum(chunks.values()) - decodes

    def _step_seconds(self, prompt_tokens: int) -> float:
        return self.config.decode_step_s + prompt_tokens / self.config.prefill_tokens_per_s

    async def _run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            started = time.monotonic()
            chunks, prompt_tokens = self._schedule()
            if not chunks:
                # Nothing fits until a sequence ends (or is aborted).
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(
                max(0.0, started + self._step_seconds(prompt_tokens) - time.monotonic())
            )
            self.steps += 1
            for seq, tokens in chunks.items():
                if seq.finished or seq not in self.running:
                    continue
                seq.computed += tokens
                if seq.computed == seq.length:
                    if not seq.started:
                        self._cache_prompt(seq)
                    self._emit(seq)

    def _cache_prompt(self, seq: Seq) -> None:
        """The prompt's full blocks, computed, go into the prefix cache."""
        full = min(len(seq.keys), seq.prompt_len // self.config.block_size)
        new = seq.keys[len(seq.shared) : full]
        if new:
            seq.shared = seq.shared + self.pool.cache(new)
            seq.fresh -= len(new)

    def _emit(self, seq: Seq) -> None:
        """The sequence's next token; its end, where it has all it asked for."""
        token = seq.token(seq.generated)
        seq.generated += 1
        output = Output([token])
        if not seq.started:
            seq.started = True
            output.first = True
            output.prompt_tokens = seq.prompt_len
            output.cached_tokens = seq.cached_tokens
        seq.outputs.put_nowait(output)
        if seq.generated >= seq.max_tokens or seq.length >= self.config.max_model_len:
            self.running.remove(seq)
            self._finish(seq, "length", hold=seq.hold)
