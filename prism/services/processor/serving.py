"""The processor stage as a process: `serve` builds the servicer from its flags and serves
it on the stage runtime, which reports SERVING, and lists the model, only while the stages
the processor calls can take a request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prism import telemetry
from prism.media.fetch import MediaLoader
from prism.media.policy import media_policy
from prism.modes import MeshRole, mode
from prism.registry import discovery_tags
from prism.routing import Router
from prism.rpc.server import Server
from prism.runtime.service import Service
from prism.runtime.stage import Door, Stage
from prism.services.processor.inputs import ModelInputs
from prism.services.processor.pipeline import Pipeline

if TYPE_CHECKING:
    from prism.config.commands import ProcessorStageConfig
    from prism.services.processor.servicer import InferenceServicer


def context_length(model: str) -> int:
    """The model's context length, read from its config as vLLM does by default."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", None) or config
    return int(text.max_position_embeddings)


async def serve(
    config: ProcessorStageConfig,
    doors: Callable[[InferenceServicer], Sequence[Door]] = lambda servicer: (),
    services: Callable[[InferenceServicer], Sequence[Service]] = lambda servicer: (),
) -> None:
    """Serves the processor of `config`, and the `doors` into its servicer and the
    `services` over it (on its gRPC server, SERVING when it is)."""
    # Here, not at the top: they load vLLM and torch, which only serving needs, not the
    # readiness tracking below.
    from transformers import AutoTokenizer

    from prism.engine.parsing import Parsers
    from prism.services.processor.adapters import AdapterLoading, ServedModels
    from prism.services.processor.servicer import InferenceServicer

    own, model, routing, tools = config.processor, config.model, config.routing, config.tools
    deployed = mode(own.mode)
    stage = Stage(config, MeshRole.PROCESSOR, config.peers.peer)
    served_model = model.served_model_name or model.model
    for role in deployed.roles:
        await stage.registry.watch(role, discovery_tags(served_model, deployed.name))
    # `kv` routing keys the blocks of a prompt's images, which needs their token counts.
    inputs = ModelInputs.of(model.model, own.enable_mm_embeds,
                            count_tokens=routing.routing == "kv")  # fmt: skip
    router = Router(
        stage.registry,
        routing.routing,
        overlap_weight=routing.kv_overlap_weight,
        encoder_slack=routing.encoder_load_slack,
        adapter_slack=routing.adapter_load_slack,
    )
    pipeline = Pipeline(deployed, router, inputs, not own.no_encoder_fallback)
    loader = MediaLoader(media_policy(config.media, config.fetch))
    tokenizer = AutoTokenizer.from_pretrained(model.model)
    try:
        parsers = Parsers.of(tokenizer, tools.tool_call_parser, config.reasoning.reasoning_parser,
                             tools.enable_auto_tool_choice)  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"prism processor: {exc}") from None
    try:
        models = ServedModels.of(served_model, model.model, config.lora)
    except ValueError as exc:
        raise SystemExit(f"prism processor: {exc}") from None
    servicer = InferenceServicer(
        tokenizer,
        models,
        pipeline,
        loader,
        model.max_model_len or context_length(model.model),
        config.limit.max_in_flight,
        own.migration_limit,
        inputs,
        parsers,
    )

    loading = AdapterLoading(servicer.models, pipeline, config.lora.allowed_lora_dirs,
                             shared=config.address.reuse_port)  # fmt: skip
    loading.serve(servicer.service)
    served = [servicer.service, *services(servicer)]
    names = [service.name for service in served]
    try:
        await stage.serve(
            served,
            [own.mode],
            [
                telemetry.cache_collector(
                    "prism_image_cache", "Image and video URL", loader.url_cache.stats
                )
            ],
            tasks=[lambda server: _track_readiness(server, pipeline, servicer, names)],
            serving=False,
            doors=doors(servicer),
        )
    finally:
        await loader.close()
        await pipeline.close()


async def _track_readiness(
    server: Server,
    pipeline: Pipeline,
    servicer: InferenceServicer,
    names: list[str],
    period: float = 1.0,
    failure_threshold: int = 3,
) -> None:
    """Reports SERVING, and lists the model, only while the stages this processor calls
    are serving.

    Like a Kubernetes probe, one slow health check on a busy stage is not an outage: the
    processor turns NOT_SERVING after `failure_threshold` failed probes in a row.
    """
    failures = failure_threshold
    while True:
        failures = 0 if await pipeline.ready() else failures + 1
        servicer.ready = failures < failure_threshold
        await server.set_serving(names, servicer.ready)
        await asyncio.sleep(period)
