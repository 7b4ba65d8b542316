"""LoRA adapters as the front knows them: `--lora-modules` in vLLM's two forms, a request's
`model` resolved to the base or an adapter (or refused, named), the models listed as
`vllm serve` lists them, `prism serve` refusing adapters without the engines' LoRA, and
loads at run time refused where they are off, shared, duplicate or out of bounds, the
adapters the engines hold at once (their --max-loras), and the adapters changed at run
time kept in a file that fronts share (--lora-state)."""

from __future__ import annotations

import asyncio
import os
import types

import grpc
import pytest
from prometheus_client import REGISTRY
from support.meshes import mesh_config

from prism.config.lora import LoraConfig
from prism.modes import MeshRole
from prism.ops.plan import check_lora
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import PrismError
from prism.services.processor.adapter_state import AdapterState
from prism.services.processor.adapters import AdapterLoading, ServedModels, capacity


def test_lora_modules_take_name_equals_path_and_vllms_json_form():
    config = LoraConfig(["a1=/adapters/one", '{"name": "a2", "path": "rel/two"}'])
    assert config.modules() == {"a1": "/adapters/one", "a2": os.path.abspath("rel/two")}


@pytest.mark.parametrize(
    "entry,message",
    [
        ("a1", "takes NAME=PATH"),
        ("=/p", "takes NAME=PATH"),
        ('{"name": "a1"}', "JSON with a name and a path"),
    ],
)
def test_a_malformed_module_is_refused_naming_it(entry, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig([entry]).modules()


def test_an_adapter_named_twice_is_refused():
    with pytest.raises(ValueError, match="'a1' given twice"):
        LoraConfig(["a1=/x", "a1=/y"]).modules()


def test_a_requests_model_names_the_base_or_an_adapter():
    models = ServedModels("tiny", "/models/tiny", {"a1": "/adapters/one"})
    counted = REGISTRY.get_sample_value("prism_lora_requests_total", {"adapter": "a1"}) or 0
    assert models.resolve("") is None and models.resolve("tiny") is None
    adapter = models.resolve("a1")
    assert (adapter.name, adapter.path) == ("a1", "/adapters/one")
    assert REGISTRY.get_sample_value("prism_lora_requests_total", {"adapter": "a1"}) == counted + 1
    with pytest.raises(PrismError) as refused:
        models.resolve("a2")
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    assert "`a2` does not exist" in refused.value.message


def test_models_are_listed_base_first_each_adapter_with_its_parent():
    listed = ServedModels("tiny", "/models/tiny", {"a1": "/adapters/one"}).listed(7, 64)
    assert [(m.id, m.parent, m.root) for m in listed] == [
        ("tiny", "", "/models/tiny"), ("a1", "tiny", "/adapters/one")
    ]  # fmt: skip
    assert {(m.created, m.max_model_len) for m in listed} == {(7, 64)}


def test_serve_refuses_adapters_without_the_engines_lora():
    config = mesh_config("epd", "m", lora_modules=["a1=/x"])
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        check_lora(config)
    check_lora(mesh_config("epd", "m", lora_modules=["a1=/x"], vllm_flags=["--enable-lora"]))
    check_lora(mesh_config("epd", "m"))


def _loading(allowed: list[str], shared: bool = False) -> AdapterLoading:
    # Every refusal here comes before any engine is asked: no pipeline is needed.
    models = ServedModels("tiny", "/models/tiny", {"a1": "/adapters/one"})
    return AdapterLoading(models, None, allowed, shared)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "loading,request_,code,message",
    [
        (_loading([]), ("b", "/adapters/b"), "FAILED_PRECONDITION", "--allowed-lora-dirs"),
        (_loading(["/adapters"], shared=True), ("b", "/adapters/b"), "FAILED_PRECONDITION",
         "shares its ports"),
        (_loading(["/adapters"]), ("a1", "/adapters/b"), "INVALID_ARGUMENT", "already been"),
        (_loading(["/adapters"]), ("tiny", "/adapters/b"), "INVALID_ARGUMENT", "already been"),
        (_loading(["/adapters"]), ("b", "/elsewhere/b"), "INVALID_ARGUMENT",
         "not under --allowed-lora-dirs"),
        (_loading(["/adapters"]), ("b", "/adapters/../etc"), "INVALID_ARGUMENT",
         "not under --allowed-lora-dirs"),
        (_loading(["/adapters"]), ("", "/adapters/b"), "INVALID_ARGUMENT", "lora_name"),
    ],
)  # fmt: skip
def test_a_load_at_run_time_is_refused_before_any_engine_is_asked(loading, request_, code, message):
    name, path = request_
    with pytest.raises(PrismError) as refused:
        asyncio.run(loading.load(inference_pb2.LoadAdapterRequest(name=name, path=path)))
    assert refused.value.code.name == code
    assert message in refused.value.message


def test_unloading_an_adapter_the_mesh_does_not_serve_is_a_404():
    with pytest.raises(PrismError) as refused:
        asyncio.run(_loading(["/adapters"]).unload(inference_pb2.UnloadAdapterRequest(name="x")))
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    assert "'x' cannot be found" in refused.value.message


class _NoEngines:
    # A pipeline whose mode runs no engine: loads and unloads reach none.
    mode = types.SimpleNamespace(roles=[])


def test_fronts_sharing_a_state_file_serve_what_any_of_them_changed(tmp_path):
    state = str(tmp_path / "adapters.json")

    def front() -> ServedModels:
        return ServedModels("tiny", "/models/tiny", {"a1": "/adapters/one"}, AdapterState(state))

    first, second = front(), front()
    # Until a change, the flags' adapters, and no file.
    assert first.adapters == second.adapters == {"a1": "/adapters/one"}
    assert not os.path.exists(state)
    with first.changing() as adapters:
        adapters["b"] = "/adapters/b"
    assert second.resolve("b") == engine_pb2.LoraAdapter(name="b", path="/adapters/b")
    # Unloaded through the second (with its ports shared: the file makes it safe), gone
    # from the first; a front started again serves what the file holds.
    loading = AdapterLoading(second, _NoEngines(), ["/adapters"], shared=True)  # type: ignore[arg-type]
    asyncio.run(loading.unload(inference_pb2.UnloadAdapterRequest(name="a1")))
    with pytest.raises(PrismError):
        first.resolve("a1")
    assert front().adapters == {"b": "/adapters/b"}
    assert [m.id for m in front().listed(7, 64)] == ["tiny", "b"]


def test_a_change_that_fails_leaves_the_state_as_it_was(tmp_path):
    models = ServedModels("tiny", "/m", {"a1": "/adapters/one"}, AdapterState(str(tmp_path / "s")))
    with pytest.raises(RuntimeError), models.changing() as adapters:
        adapters["b"] = "/adapters/b"
        raise RuntimeError
    assert models.adapters == {"a1": "/adapters/one"}


def test_the_adapters_engines_hold_at_once_are_the_least_roles_sum_of_max_loras():
    engines = {MeshRole.PREFILL: ["p0", "p1"], MeshRole.DECODE: ["d0"]}
    assert capacity(engines, {"p0": 2, "p1": 2, "d0": 3}) == (
        3,
        "1 decode replica with --max-loras 3",
    )
    assert capacity(engines, {"p0": 1, "p1": 2, "d0": 4}) == (
        3,
        "2 prefill replicas with --max-loras 1 + 2",
    )
    assert capacity({MeshRole.WORKER: ["w0", "w1"]}, {"w0": 2, "w1": 2}) == (
        4,
        "2 worker replicas with --max-loras 2",
    )
