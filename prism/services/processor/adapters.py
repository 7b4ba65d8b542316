"""The models a processor serves: its base model and the LoRA adapters beside it
(`--lora-modules`, or loaded at run time), each named by a request's `model` as `vllm
serve` names them.

A request for an adapter carries the adapter's name and path to every worker it passes
(prism.stage.v1.LoraAdapter), which loads it the first time; in P/D both prefill and
decode apply it. Its name also roots the keys of its prompt's blocks (prism.kv_index), as
vLLM keys an adapter's prefix cache apart from the base model's and from other adapters'.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import grpc

from prism import telemetry
from prism.config.lora import LoraConfig
from prism.modes import MeshRole
from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2, errors_pb2, inference_pb2
from prism.rpc.channel import call_metadata, connected
from prism.rpc.errors import PrismError, invalid
from prism.runtime.service import Service
from prism.services.processor.adapter_state import AdapterState
from prism.services.processor.pipeline import Pipeline

log = logging.getLogger(__name__)
# Seconds an engine may take to load an adapter (or drop one).
_CALL_S = 60.0


class ServedModels:
    """The base model `base` (served as `name`) and the adapters `adapters` (name → path),
    as changed at run time: in `state` if given, else in this processor's memory."""

    def __init__(
        self, name: str, base: str, adapters: dict[str, str], state: AdapterState | None = None
    ) -> None:
        self.name = name
        self.base = base
        self._adapters = dict(adapters)
        self.state = state

    @classmethod
    def of(cls, name: str, base: str, lora: LoraConfig) -> ServedModels:
        """The models `lora`'s flags serve beside `base`; ValueError if malformed."""
        state = AdapterState(lora.lora_state) if lora.lora_state else None
        return cls(name, base, lora.modules(), state)

    @property
    def adapters(self) -> dict[str, str]:
        held = self.state.read() if self.state is not None else None
        return self._adapters if held is None else held

    @contextlib.contextmanager
    def changing(self) -> Iterator[dict[str, str]]:
        """The adapters, to change in the block."""
        if self.state is None:
            yield self._adapters
        else:
            with self.state.changing(self._adapters) as adapters:
                yield adapters

    def resolve(self, model: str) -> engine_pb2.LoraAdapter | None:
        """The adapter a request's `model` names, counted (prism_lora_requests); None for
        the base model (named, or not named at all). Refused (NOT_FOUND, vLLM's message)
        when it names neither."""
        if not model or model == self.name:
            return None
        if (path := self.adapters.get(model)) is not None:
            telemetry.LORA_REQUESTS.labels(model).inc()
            return engine_pb2.LoraAdapter(name=model, path=path)
        raise PrismError(
            grpc.StatusCode.NOT_FOUND,
            f"The model `{model}` does not exist.",
            reason=errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
            param="model",
        )

    @staticmethod
    def count(adapter: engine_pb2.LoraAdapter | None, usage: common_pb2.Usage) -> None:
        """Counts an answered request's tokens under its adapter (prism_lora_tokens)."""
        if adapter is not None:
            telemetry.LORA_TOKENS.labels(adapter.name, "prompt").inc(usage.prompt_tokens)
            telemetry.LORA_TOKENS.labels(adapter.name, "completion").inc(usage.completion_tokens)

    def listed(self, created: int, max_model_len: int) -> list[inference_pb2.Model]:
        """The base model, then each adapter with the base as its parent."""
        base = inference_pb2.Model(id=self.name, owned_by="prism", created=created,
                                   max_model_len=max_model_len, root=self.base)  # fmt: skip
        return [base, *(
            inference_pb2.Model(id=name, owned_by="prism", created=created,
                                max_model_len=max_model_len, root=path, parent=self.name)
            for name, path in self.adapters.items()
        )]  # fmt: skip


class AdapterLoading:
    """`LoadAdapter` and `UnloadAdapter` of `InferenceService`: adapters loaded and unloaded
    at run time, as vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

    A load is allowed only under `allowed` directories (none: loading at run time is off),
    and is made on every engine replica first, so that an adapter that cannot be loaded is
    refused with the engine's cause before it is served; replicas that start later load it
    from the requests that name it. One past what the engines hold at once (`capacity`)
    is refused too, and dropped from them again. Where several fronts share their ports
    (`shared`), a load reaches one of them: it is refused there unless the adapters are
    kept in a file they share (`--lora-state`, which `prism serve` gives them)."""

    def __init__(
        self, models: ServedModels, pipeline: Pipeline, allowed: list[str], shared: bool
    ) -> None:
        self.models = models
        self.pipeline = pipeline
        self.allowed = [os.path.realpath(directory) for directory in allowed]
        self.shared = shared

    def serve(self, service: Service) -> None:
        service.unary("LoadAdapter", self.load)
        service.unary("UnloadAdapter", self.unload)

    async def load(
        self, request: inference_pb2.LoadAdapterRequest
    ) -> inference_pb2.LoadAdapterResponse:
        self._check_allowed()
        name = request.name
        if not name or not request.path:
            raise invalid(
                "lora_name and lora_path are required", "lora_name" if not name else "lora_path"
            )
        if name == self.models.name or name in self.models.adapters:
            raise invalid(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        path = os.path.realpath(request.path)
        if not any(os.path.commonpath([path, root]) == root for root in self.allowed):
            raise invalid(f"{request.path} is not under --allowed-lora-dirs", "lora_path")
        adapter = engine_pb2.LoraAdapter(name=name, path=path)
        engines = self._engines()
        if idle := [role for role, addresses in engines.items() if not addresses]:
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE, f"no {idle[0]} engine is serving to load it on"
            )
        # Each engine that loaded it, with its --max-loras.
        loaded: dict[str, int] = {}
        try:
            for address in _every(engines):
                stub = await self._stub(address)
                reply = await stub.LoadAdapter(
                    engine_pb2.EngineServiceLoadAdapterRequest(adapter=adapter),
                    metadata=call_metadata(), timeout=_CALL_S,
                )  # fmt: skip
                loaded[address] = reply.max_loras
        except grpc.aio.AioRpcError as exc:
            await self._drop(name, list(loaded))
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(exc.details() or "", "lora_path") from None
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE, f"engine {address}: {exc.details()}"
            ) from None
        most, bound = capacity(engines, loaded)
        # Counted and added under the state's lock, so that loads at once cannot both pass.
        with self.models.changing() as adapters:
            served = len(adapters)
            if served < most:
                adapters[name] = path
        if served >= most:
            await self._drop(name, list(loaded))
            raise invalid(
                f"The lora adapter '{name}' cannot be loaded: the mesh serves {served} "
                f"adapters, as many as its engines hold at once ({bound}); unload one first",
                "lora_name",
            )
        log.info("LoRA adapter %r loaded from %s", name, path)
        return inference_pb2.LoadAdapterResponse()

    async def unload(
        self, request: inference_pb2.UnloadAdapterRequest
    ) -> inference_pb2.UnloadAdapterResponse:
        self._check_allowed()
        if request.name not in self.models.adapters:
            raise PrismError(
                grpc.StatusCode.NOT_FOUND,
                f"The lora adapter '{request.name}' cannot be found.",
                reason=errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
                param="lora_name",
            )
        with self.models.changing() as adapters:
            adapters.pop(request.name, None)
        await self._drop(request.name, _every(self._engines()))
        log.info("LoRA adapter %r unloaded", request.name)
        return inference_pb2.UnloadAdapterResponse()

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise PrismError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "loading LoRA adapters at run time is off: start Prism with "
                "--allowed-lora-dirs DIR (adapters under DIR may be loaded)",
            )
        if self.shared and self.models.state is None:
            raise PrismError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this front shares its ports with other fronts (--front-workers), which "
                "would not know the adapter: give them one --lora-state file, or serve it "
                "with --lora-modules",
            )

    def _engines(self) -> dict[MeshRole, list[str]]:
        """Every replica of each role that runs an engine."""
        roles = [role for role in self.pipeline.mode.roles if role != MeshRole.ENCODER]
        return {role: self.pipeline.router.registry.endpoints(role) for role in roles}

    async def _stub(self, address: str) -> engine_pb2_grpc.EngineServiceStub:
        """The engine's stub, once its channel is connected (a replica that started moments
        ago is given that moment)."""
        channel = self.pipeline.peers.channel(address)
        await connected(channel)
        return engine_pb2_grpc.EngineServiceStub(channel)

    async def _drop(self, name: str, addresses: list[str]) -> None:
        """Unloads `name` from the engines at `addresses`; one that cannot be asked drops
        it with its process, or from its cache as other adapters come."""
        request = engine_pb2.EngineServiceUnloadAdapterRequest(name=name)
        for address in addresses:
            try:
                stub = await self._stub(address)
                await stub.UnloadAdapter(request, metadata=call_metadata(), timeout=_CALL_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("engine %s: adapter %r not unloaded: %s", address, name, exc.details())


def _every(engines: dict[MeshRole, list[str]]) -> list[str]:
    """The addresses of every role's replicas, in one list."""
    return [address for addresses in engines.values() for address in addresses]


def capacity(engines: dict[MeshRole, list[str]], limits: dict[str, int]) -> tuple[int, str]:
    """How many adapters the engines hold at once, and that bound as flags say it: per role,
    the sum of its replicas' --max-loras (`limits`, by address; each adapter has an owner
    among them under KV routing); the least over the roles, since in P/D prefill and decode
    both apply it."""
    bounds = []
    for role, addresses in engines.items():
        held = [limits[a] for a in addresses if a in limits]
        replicas = f"{len(held)} {role} replica{'s' if len(held) != 1 else ''}"
        each = str(held[0]) if len(set(held)) == 1 else " + ".join(map(str, held))
        bounds.append((sum(held), f"{replicas} with --max-loras {each}"))
    return min(bounds)
