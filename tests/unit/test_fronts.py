"""Several fronts (`prism serve --front-workers N`): planned to share their ports and the
mesh's bound, each with its own health and registration (no processes but test doors)."""

from __future__ import annotations

import asyncio
import os
import stat
import types

import httpx
import pytest
from grpc_health.v1 import health, health_pb2
from support.meshes import mesh_config
from test_front import _ready
from test_in_process_client import Processor
from test_launcher import flag

from prism.config.commands import FrontStageConfig
from prism.config.common import AddressConfig, ModelConfig
from prism.config.gateway import HttpConfig
from prism.config.registry import RegistryConfig
from prism.gateway.door import HttpDoor
from prism.modes import MeshRole
from prism.ops import fronts, launcher
from prism.ops.gpus import Placement
from prism.ops.plan import plan
from prism.ops.stage_process import StageProcess
from prism.runtime.ports import free_port


def test_fronts_share_the_ports_and_the_bound_and_have_their_own_health():
    config = mesh_config("e/pd", "m", engine="sim", front_workers=3, max_in_flight=100,
                         registry=RegistryConfig("consul://127.0.0.1:8500"))  # fmt: skip
    stages = plan(config)
    shared = [stage for stage in stages if stage.name.startswith("front")]
    assert [stage.name for stage in shared] == ["front-0", "front-1", "front-2"]
    assert len({stage.address for stage in shared}) == 1
    assert len({stage.url for stage in shared}) == 1
    for i, stage in enumerate(shared):
        assert flag(stage.argv, "--port") == [stage.address.rpartition(":")[2]]
        assert flag(stage.argv, "--http-port") == [str(config.http.http_port)]
        assert "--reuse-port" in stage.argv
        # A third of the mesh's bound each: together they take no more than it.
        assert flag(stage.argv, "--max-in-flight") == ["33"]
        assert flag(stage.argv, "--consul-id-suffix") == [f"front-{i}"]
        assert flag(stage.argv, "--registry") == ["consul://127.0.0.1:8500"]
    # One store of responses: a follow-up finds its first turn at any of them.
    (store,) = {tuple(flag(stage.argv, "--responses-store")) for stage in shared}
    directory = os.path.dirname(store[0])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    health_ports = {flag(stage.argv, "--health-port")[0] for stage in shared}
    metrics = {stage.metrics_url for stage in shared}
    assert len(health_ports) == len(metrics) == 3
    # `prism serve` names the one public gRPC API they share, and each as a front.
    status = launcher.endpoints(config, launcher.Mesh(stages))
    assert status["grpc"] == shared[0].address
    assert [s["role"] for s in status["stages"]][-3:] == ["front"] * 3
    # The store goes with the mesh (conversations are in it).
    launcher.Mesh(stages).stop()
    assert not os.path.exists(directory)


def test_one_front_keeps_its_name_and_the_whole_bound():
    (front,) = [s for s in plan(mesh_config("epd", "m", engine="sim")) if s.name == "front"]
    assert flag(front.argv, "--max-in-flight") == ["256"]
    assert "--reuse-port" not in front.argv and "--health-port" not in front.argv
    assert "--responses-store" not in front.argv


def test_a_split_front_is_one_gateway_and_one_processor():
    with pytest.raises(ValueError, match="--front-workers needs --front combined"):
        plan(mesh_config("epd", "m", front="split", front_workers=2))


def _stage(name: str, gpus: tuple[int, ...] = ()) -> StageProcess:
    return StageProcess(name, "h:1", [], lambda: True, placement=Placement(gpus))


@pytest.mark.parametrize(
    "engine,gpus,expected",
    [
        # 16 cores; an encoder and two engines on GPUs take three: 13, at most 8.
        ("vllm", (0,), 8),
        # Simulated engines take a core each, as the encoder does.
        ("sim", (), 8),
        # vLLM on the CPU backend is bound to every core: one front.
        ("vllm", (), 1),
    ],
)
def test_front_workers_0_takes_the_cores_the_stages_leave(monkeypatch, engine, gpus, expected):
    monkeypatch.setattr(fronts.os, "sched_getaffinity", lambda _: set(range(16)))
    config = mesh_config("e/pd", "m", engine=engine, front_workers=0)
    by_role = {MeshRole.ENCODER: [_stage("encoder-0")],
               MeshRole.WORKER: [_stage("worker-0", gpus), _stage("worker-1", gpus)]}  # fmt: skip
    assert fronts.count(config, by_role) == expected
    monkeypatch.setattr(fronts.os, "sched_getaffinity", lambda _: {0, 1})
    assert fronts.count(config, by_role) == 1


def test_doors_told_to_share_a_port_both_answer(monkeypatch):
    monkeypatch.delenv("PRISM_API_KEY", raising=False)
    port = free_port()
    config = FrontStageConfig(model=ModelConfig("m"), http=HttpConfig(http_port=port),
                              address=AddressConfig(reuse_port=True))  # fmt: skip

    async def main() -> None:
        checks = health.aio.HealthServicer()
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)
        server = types.SimpleNamespace(health=checks)
        doors = [HttpDoor(config, Processor().service.handlers) for _ in range(2)]
        serving = [asyncio.create_task(door.serve(server)) for door in doors]  # type: ignore[arg-type]
        await _ready(f"http://127.0.0.1:{port}")
        # The second bound too, rather than failing as an unshared port does.
        await asyncio.sleep(0.2)
        assert not any(task.done() for task in serving)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/v1/models")).status_code == 200
        for door in doors:
            door.close()
        await asyncio.wait_for(asyncio.gather(*serving), 15)

    asyncio.run(main())


@pytest.mark.parametrize("workers", [1, 2])
def test_fronts_keep_the_adapters_loaded_at_run_time_in_one_file_of_the_meshs(workers):
    config = mesh_config("epd", "m", engine="sim", front_workers=workers,
                         allowed_lora_dirs=["/adapters"])  # fmt: skip
    stages = plan(config)
    fronts_ = [stage for stage in stages if stage.name.startswith("front")]
    (state,) = {tuple(flag(stage.argv, "--lora-state")) for stage in fronts_}
    directory = os.path.dirname(state[0])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    launcher.Mesh(stages).stop()
    assert not os.path.exists(directory)
    # Without loading at run time, nothing to keep; a file of the user's own is theirs.
    assert "--lora-state" not in plan(mesh_config("epd", "m", engine="sim"))[-1].argv
    mine = mesh_config("epd", "m", engine="sim", allowed_lora_dirs=["/a"], lora_state="/s.json")
    assert flag(plan(mine)[-1].argv, "--lora-state") == ["/s.json"]
