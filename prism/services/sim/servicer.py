"""The simulated engine's `EngineService`: each role as a vLLM worker's looks to a processor
(prism.services.sim)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from prism.config.sim import SimConfig
from prism.kv_index import lay_out, prompt_keys
from prism.media.modalities import MODALITIES
from prism.modes import EngineRole
from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2, errors_pb2
from prism.rpc.channel import channel as open_channel
from prism.rpc.errors import PrismError, invalid
from prism.services.sim.engine import Seq, SimEngine
from prism.services.worker import check_request, engine_service
from prism.services.worker.kv_publisher import KvPublisher

if TYPE_CHECKING:
    from prism.config.common import ModelConfig
    from prism.config.sim import SimEngineConfig

log = logging.getLogger(__name__)

_PREFILLS = (EngineRole.PREFILL, EngineRole.ENCODE_PREFILL)
_FINISH = {"length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}


def sim_config(sim: SimEngineConfig, model: ModelConfig, stream_interval: int = 1) -> SimConfig:
    return SimConfig(
        prefill_tokens_per_s=sim.sim_prefill_tokens_per_s,
        decode_step_s=sim.sim_decode_step_ms / 1000,
        block_size=sim.sim_block_size,
        num_blocks=sim.sim_kv_blocks,
        max_num_seqs=sim.sim_max_num_seqs,
        max_num_batched_tokens=sim.sim_max_num_batched_tokens,
        max_model_len=model.max_model_len or _model_len(model.model),
        stream_interval=stream_interval,
    )


def _model_config(model: str) -> dict:
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _model_len(model: str) -> int:
    config = _model_config(model)
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings", SimConfig.max_model_len))


def placeholders(model: str) -> dict[str, int]:
    """The model's image and video placeholder tokens, from its config alone."""
    config = _model_config(model)
    found = {modality.name: modality.placeholder(config) for modality in MODALITIES}
    return {name: token for name, token in found.items() if token is not None}


class SimServicer:
    def __init__(
        self,
        engine: SimEngine,
        role: EngineRole,
        placeholders: dict[str, int],
        media_tokens: int,
        kv_tokens_per_s: float,
        address: tuple[str, int],
        kv_lease_s: float = 30.0,
        max_in_flight: int = 0,
        publisher: KvPublisher | None = None,
    ) -> None:
        self.engine = engine
        # Its KV events, for a role whose cache routing scores.
        self.publisher = publisher
        self.role = role
        self.placeholders = placeholders
        self.media_tokens = media_tokens
        self.kv_tokens_per_s = kv_tokens_per_s
        # Where decode workers reach this one (its gRPC server): the "side channel".
        self.address = address
        self.kv_lease_s = kv_lease_s
        self._running: dict[str, Seq] = {}
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.service = engine_service(self.generate, self.abort, max_in_flight)
        self.service.hold_while(self._holding)

    async def _holding(self) -> bool:
        # A prefill drained lives on until decodes have read what it holds, or its leases end.
        return bool(self._leases)

    def _media(self, request: engine_pb2.GenerateRequest) -> dict[str, list[tuple[str, int]]]:
        """Each item of the prompt, by modality: its identity and its tokens."""
        which = request.WhichOneof("media")
        # An item's identity and tokens, by the form the media came in.
        describe = {
            "files": lambda m, file: (m.content_hash(file.data), self.media_tokens),
            "embeddings": lambda _, handle: (handle.content_hash, handle.embeddings.shape[0]),
            "layouts": lambda _, layout: (layout.uuid, layout.num_tokens),
        }.get(which or "")
        if describe is None:
            return {}
        media = getattr(request, which)
        return {m.name: [describe(m, item) for item in m.items(media)] for m in MODALITIES}

    def _prompt(
        self, request: engine_pb2.GenerateRequest
    ) -> tuple[int, list[int], engine_pb2.MediaLayouts]:
        """The prompt's length with its media expanded, its block keys, and its layouts."""
        media = self._media(request)
        layouts = engine_pb2.MediaLayouts()
        items: dict[int, list[tuple[str, int]]] = {}
        for modality in MODALITIES:
            token = self.placeholders.get(modality.name)
            if token is None:
                continue
            given = media.get(modality.name, [])
            count = sum(1 for t in request.prompt_token_ids if t == token)
            if count != len(given):
                raise invalid(
                    f"the prompt has {count} {modality.name} placeholders for {len(given)} items",
                    "prompt_token_ids",
                )
            items[token] = given
            modality.items(layouts).extend(
                engine_pb2.MediaLayout(uuid=uuid, num_tokens=n) for uuid, n in given
            )
        tokens, spans = lay_out(request.prompt_token_ids, set(items), items)
        return len(tokens), prompt_keys(tokens, spans, self.engine.config.block_size), layouts

    async def _read_kv(self, params: engine_pb2.KvTransferParams) -> None:
        """Decode: the prompt's KV "read" from the prefill that holds it, which then frees
        it; an error as a failed NIXL read's when that prefill no longer holds it."""
        await asyncio.sleep(params.remote_num_tokens / self.kv_tokens_per_s)
        address = f"{params.remote_host}:{params.remote_port}"
        channel = self._channels.get(address)
        if channel is None:
            # Over the mesh's TLS, as every stage calls another.
            channel = self._channels[address] = open_channel(address)
        try:
            reply = await engine_pb2_grpc.EngineServiceStub(channel).Abort(
                engine_pb2.EngineServiceAbortRequest(request_id=params.remote_request_id),
                timeout=10,
            )
            held = reply.aborted
        except grpc.aio.AioRpcError:
            held = False
        if not held:
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                "the prompt's KV cache could not be read from the prefill engine "
                f"{params.remote_engine_id} at {address}",
                reason=errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED,
                param="kv_transfer_params",
            )

    def _seq(self, request: engine_pb2.GenerateRequest, length: int, keys: list[int]) -> Seq:
        sampling = request.sampling
        if sampling.logprobs or sampling.HasField("prompt_logprobs"):
            raise invalid("the simulated engine computes no logprobs", "logprobs")
        room = self.engine.config.max_model_len - length
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else room
        if self.role in _PREFILLS:
            max_tokens = 1
        seed = str(sampling.seed) if sampling.HasField("seed") else request.request_id
        return Seq(
            request.request_id,
            length,
            keys,
            max(1, max_tokens),
            seed,
            prefilled=self.role == EngineRole.DECODE,
            hold=self.role in _PREFILLS,
            stream_interval=sampling.stream_interval,
        )

    async def generate(
        self, request: engine_pb2.GenerateRequest
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        check_request(request)
        decode = self.role == EngineRole.DECODE
        if decode != request.HasField("kv_transfer_params"):
            need = "needs" if decode else "takes no"
            raise invalid(f"a {self.role} worker {need} kv_transfer_params", "kv_transfer_params")
        length, keys, layouts = self._prompt(request)
        seq = self._seq(request, length, keys)
        self._running[seq.request_id] = seq
        completed = False
        try:
            if decode:
                await self._read_kv(request.kv_transfer_params)
            async for output in self.engine.generate(seq):
                reply = engine_pb2.GenerateResponse(token_ids=output.token_ids)
                if output.first:
                    reply.first.prompt_tokens = output.prompt_tokens
                    reply.first.cached_tokens = output.cached_tokens
                    if output.finish:
                        # The first message is not the last: that one follows, tokenless.
                        yield reply
                        reply = engine_pb2.GenerateResponse()
                if output.finish:
                    log.info("%s %s: %d prompt tokens, %d generated, %s", self.role,
                             seq.request_id, length, seq.generated, output.finish)  # fmt: skip
                    reply.last.reason = _FINISH[output.finish]
                    if seq.hold and output.finish == "length":
                        self._hand_off(seq, layouts, reply.last)
                yield reply
            completed = True
        except ValueError as exc:
            raise invalid(str(exc), "prompt_token_ids") from None
        finally:
            self._running.pop(seq.request_id, None)
            if not completed:
                # Cut short after the hold, if it came: no decode will read it.
                self._release(seq.request_id)

    def _hand_off(
        self, seq: Seq, layouts: engine_pb2.MediaLayouts, finish: engine_pb2.Finish
    ) -> None:
        host, port = self.address
        finish.kv_transfer_params.CopyFrom(
            engine_pb2.KvTransferParams(
                do_remote_prefill=True,
                remote_block_ids=[engine_pb2.KvBlockIds(ids=range(len(seq.shared) + seq.fresh))],
                remote_engine_id=f"sim-{host}:{port}",
                remote_request_id=seq.request_id,
                remote_host=host,
                remote_port=port,
                tp_size=1,
                remote_num_tokens=seq.prompt_len,
                remote_prefill_cached_tokens=seq.cached_tokens,
            )
        )
        if layouts.images or layouts.videos:
            finish.layouts.CopyFrom(layouts)
        loop = asyncio.get_running_loop()
        self._leases[seq.request_id] = loop.call_later(
            self.kv_lease_s, self._release, seq.request_id
        )

    def _release(self, request_id: str) -> bool:
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()
        return self.engine.release(request_id)

    async def abort(
        self, request: engine_pb2.EngineServiceAbortRequest
    ) -> engine_pb2.EngineServiceAbortResponse:
        seq = self._running.get(request.request_id)
        aborted = seq is not None and self.engine.abort(seq)
        released = self._release(request.request_id)
        return engine_pb2.EngineServiceAbortResponse(aborted=aborted or released)

    def in_flight(self) -> int:
        return len(self._running)
