"""The models a processor serves: its base model and the LoRA adapters beside it
(`--lora-modules`), each named by a request's `model` as `vllm serve` names them.

A request for an adapter carries the adapter's name and path to every worker it passes
(prism.stage.v1.LoraAdapter), which loads it the first time; in P/D both prefill and
decode apply it. Its name also roots the keys of its prompt's blocks (prism.kv_index), as
vLLM keys an adapter's prefix cache apart from the base model's and from other adapters'.
"""

from __future__ import annotations

import grpc

from prism import telemetry
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import errors_pb2, inference_pb2
from prism.rpc.errors import PrismError


class ServedModels:
    """The base model `base` (served as `name`) and the adapters `adapters` (name → path)."""

    def __init__(self, name: str, base: str, adapters: dict[str, str]) -> None:
        self.name = name
        self.base = base
        self.adapters = dict(adapters)

    def resolve(self, model: str) -> engine_pb2.LoraAdapter | None:
        """The adapter a request's `model` names, counted (prism_lora_requests); None for
        the base model (named, or not named at all). Refused (NOT_FOUND, vLLM's message)
        when it names neither."""
        if not model or model == self.name:
            return None
        if model in self.adapters:
            telemetry.LORA_REQUESTS.labels(model).inc()
            return engine_pb2.LoraAdapter(name=model, path=self.adapters[model])
        raise PrismError(
            grpc.StatusCode.NOT_FOUND,
            f"The model `{model}` does not exist.",
            reason=errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
            param="model",
        )

    def listed(self, created: int, max_model_len: int) -> list[inference_pb2.Model]:
        """The base model, then each adapter with the base as its parent."""
        base = inference_pb2.Model(id=self.name, owned_by="prism", created=created,
                                   max_model_len=max_model_len, root=self.base)  # fmt: skip
        return [base, *(
            inference_pb2.Model(id=name, owned_by="prism", created=created,
                                max_model_len=max_model_len, root=path, parent=self.name)
            for name, path in self.adapters.items()
        )]  # fmt: skip
