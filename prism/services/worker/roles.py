"""What an engine does in each role, behind one KV hand-off protocol.

Every role runs a request the same way (prism.services.worker): token ids in, token ids
out, one engine call. A role says what differs: the sampling it asks the engine for, the
images it takes as placeholders, what its last reply hands on, how a failed request is
explained, and what it holds after the request and frees on Abort.

- `Aggregated`: the whole answer; neither gives nor takes KV.
- `Prefill`: one token, and the prompt's KV cache held for a decode (images come as
  embeddings from the encoder, E/P/D); `EncodePrefill` the same, encoding images itself
  (EP/D).
- `Decode`: reads prefill's KV cache and generates the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from prism.engine import calls
from prism.engine.sampling import to_vllm
from prism.engine.types import AsyncLLM, SamplingParams, TokensPrompt
from prism.media.modalities import MODALITIES
from prism.modes import EngineRole
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import errors_pb2
from prism.rpc.errors import PrismError, invalid
from prism.services.worker import kv_transfer

log = logging.getLogger(__name__)

# Longest pause between tries to free a prefill's KV that the connector does not hold yet.
_RELEASE_POLL_MAX_S = 0.25


def _layouts(by_name: dict[str, list[engine_pb2.MediaLayout]]) -> engine_pb2.MediaLayouts:
    layouts = engine_pb2.MediaLayouts()
    for modality in MODALITIES:
        modality.items(layouts).extend(by_name.get(modality.name, []))
    return layouts


class Role:
    """The protocol, with what a role that hands nothing on does."""

    name: EngineRole
    # The span of a request's work in the engine.
    span_name: str
    # Whether its media come as embeddings read from an encoder over NIXL.
    reads_embeddings = False

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def params(self, request: engine_pb2.GenerateRequest, **common: Any) -> SamplingParams:
        """The engine's sampling parameters for `request`; `common` holds what every role
        asks for."""
        if request.HasField("kv_transfer_params"):
            raise invalid(f"a {self.name} worker takes no kv_transfer_params", "kv_transfer_params")
        return to_vllm(request.sampling, **common)

    def placeholders(self, layouts: engine_pb2.MediaLayouts) -> dict[str, Any]:
        """The prompt's media as laid out elsewhere: decode's alone."""
        raise invalid("only a decode worker takes layouts", "layouts")

    async def render(self, prompt: TokensPrompt) -> tuple[Any, engine_pb2.MediaLayouts]:
        """What goes to the engine, and the layout of its media if the role tells it."""
        return prompt, engine_pb2.MediaLayouts()

    def hand_off(
        self,
        request_id: str,
        output: Any,
        layouts: engine_pb2.MediaLayouts,
        finish: engine_pb2.Finish,
    ) -> None:
        """Adds to the last reply's `finish` what the next stage needs (with the images'
        `layouts` from `render`), and holds what it will read."""

    def failure(self, request: engine_pb2.GenerateRequest) -> PrismError:
        """The error of a request the engine failed."""
        return PrismError(grpc.StatusCode.INTERNAL, "the engine failed the request")

    def release(self, request_id: str) -> bool:
        """Starts freeing what the role holds for `request_id`; False if nothing."""
        return False

    def abandon(self, request_id: str) -> None:
        """Starts freeing what the engine may hold for `request_id`, whose call was cut
        short before its hand-off."""

    def settle(self, request_id: str, handed_off: bool, completed: bool, aborted: bool) -> None:
        """What a request's end leaves to free: what the next stage would read, held for a
        caller that gave up on it (an Abort that came before the hold, or a call cut
        short), now rather than at the end of the lease; or what the engine may hold of a
        call cut short before its hand-off."""
        if handed_off and (not completed or aborted):
            self.release(request_id)
        elif not completed:
            self.abandon(request_id)

    async def holding(self) -> bool:
        """Whether the engine still holds something that another stage will read."""
        return False


class Aggregated(Role):
    name = EngineRole.AGGREGATED
    span_name = "generate"


class Prefill(Role):
    """Runs the prompt with one output token; the prompt's KV cache then waits for a
    decode, under a lease of `kv_lease_s`, until Abort frees it or the lease ends."""

    name = EngineRole.PREFILL
    span_name = "prefill"
    reads_embeddings = True

    def __init__(self, engine: AsyncLLM, kv_lease_s: float = 30.0) -> None:
        super().__init__(engine)
        self.kv_lease_s = kv_lease_s
        # Request id -> end of lease, while its KV cache waits.
        self._held: dict[str, float] = {}
        self._releases: set[asyncio.Task] = set()

    def params(self, request: engine_pb2.GenerateRequest, **common: Any) -> SamplingParams:
        # One token, then the KV cache waits for a decode worker. min_tokens still bars
        # end-of-sequence from that token as it would in one engine.
        return to_vllm(
            request.sampling,
            **common,
            max_tokens=1,
            min_tokens=min(request.sampling.min_tokens, 1),
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )

    async def render(self, prompt: TokensPrompt) -> tuple[Any, engine_pb2.MediaLayouts]:
        if "multi_modal_data" not in prompt:
            return prompt, engine_pb2.MediaLayouts()
        # Rendered here rather than inside generate() to learn the media layouts.
        engine_input, layouts = await calls.render(self.engine, prompt)
        return engine_input, _layouts(layouts)

    def hand_off(
        self,
        request_id: str,
        output: Any,
        layouts: engine_pb2.MediaLayouts,
        finish: engine_pb2.Finish,
    ) -> None:
        if not output.kv_transfer_params:
            return
        finish.kv_transfer_params.CopyFrom(kv_transfer.to_proto(output.kv_transfer_params))
        if any(modality.items(layouts) for modality in MODALITIES):
            finish.layouts.CopyFrom(layouts)
        self._forget_ended_leases()
        self._held[request_id] = time.monotonic() + self.kv_lease_s

    def release(self, request_id: str) -> bool:
        until = self._held.pop(request_id, None)
        if until is None:
            return False
        self._end_lease(request_id, until)
        return True

    def abandon(self, request_id: str) -> None:
        # The engine may have finished the prompt, and so hold its KV under a lease, in the
        # moment before the call was cut short: that output was never read, and the hold
        # is known to the engine alone.
        self._held.pop(request_id, None)
        self._end_lease(request_id, time.monotonic() + self.kv_lease_s)

    async def holding(self) -> bool:
        # vLLM frees a prompt's blocks once a decode has read them, which only its
        # connector learns: ask it which of those handed off it still holds.
        self._forget_ended_leases()
        if self._held:
            try:
                held = await calls.kv_held(self.engine, list(self._held))
            except Exception as exc:  # a dead engine holds nothing a decode could read
                log.warning("prefill: cannot ask the engine what it holds (%r)", exc)
                self._held.clear()
                return False
            for read in set(self._held) - set(held):
                del self._held[read]
        return bool(self._held)

    def _forget_ended_leases(self) -> None:
        now = time.monotonic()
        for ended in [k for k, until in self._held.items() if until <= now]:
            del self._held[ended]

    def _end_lease(self, request_id: str, until: float) -> None:
        task = asyncio.create_task(self._release_kv(request_id, until))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_kv(self, request_id: str, until: float) -> None:
        # The connector learns of a finished request at the engine's next step, which a
        # busy machine may delay: keep trying, less often, until the lease would end anyway.
        pause = 0.02
        while time.monotonic() < until:
            if await calls.release_kv(self.engine, request_id) != "pending":
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, _RELEASE_POLL_MAX_S)


class EncodePrefill(Prefill):
    """Prefill that encodes the images itself (EP/D): they come as pixels."""

    name = EngineRole.ENCODE_PREFILL
    reads_embeddings = False


class Decode(Role):
    """Reads the prompt's KV cache from the prefill engine that `kv_transfer_params`
    names, and generates the answer from there."""

    name = EngineRole.DECODE
    span_name = "decode"

    def params(self, request: engine_pb2.GenerateRequest, **common: Any) -> SamplingParams:
        if not request.HasField("kv_transfer_params"):
            raise invalid("a decode worker needs kv_transfer_params", "kv_transfer_params")
        kv_params = kv_transfer.to_vllm(request.kv_transfer_params)
        # The prompt's logprobs are prefill's: decode does not run the prompt.
        return to_vllm(
            request.sampling,
            **common,
            prompt_logprobs=None,
            extra_args={"kv_transfer_params": kv_params},
        )

    def placeholders(self, layouts: engine_pb2.MediaLayouts) -> dict[str, Any]:
        """Zero embeddings shaped like prefill's: they are never read, since the media's
        KV comes from prefill, but they make vLLM lay out the prompt the same way. Each
        item's identity keeps decode's prefix cache from mixing up items whose
        placeholders look alike."""
        data: dict[str, Any] = {}
        uuids: dict[str, list[str | None]] = {}
        for modality in MODALITIES:
            items = modality.items(layouts)
            if not items:
                continue
            tensors = [calls.placeholder_embeddings(self.engine, item.num_tokens) for item in items]
            data[modality.name] = calls.embeddings_input(
                modality.name,
                tensors,
                [item.grid_thw for item in items],
                [item.second_per_grid_ts for item in items],
            )
            uuids[modality.name] = [item.uuid or None for item in items]
        return {"multi_modal_data": data, "multi_modal_uuids": uuids}

    def failure(self, request: engine_pb2.GenerateRequest) -> PrismError:
        kv = request.kv_transfer_params
        return PrismError(
            grpc.StatusCode.UNAVAILABLE,
            "the prompt's KV cache could not be read from the prefill engine "
            f"{kv.remote_engine_id} at {kv.remote_host}:{kv.remote_port}",
            reason=errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED,
            param="kv_transfer_params",
        )


def make_role(name: EngineRole, engine: AsyncLLM, kv_lease_s: float = 30.0) -> Role:
    if name == EngineRole.AGGREGATED:
        return Aggregated(engine)
    if name == EngineRole.DECODE:
        return Decode(engine)
    prefill = Prefill if name == EngineRole.PREFILL else EncodePrefill
    return prefill(engine, kv_lease_s)
