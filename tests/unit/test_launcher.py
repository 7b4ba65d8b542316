"""The launcher's plan: which stages a mode runs and how they are wired (no processes)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from support.meshes import mesh_config

from prism.cli import build_parser
from prism.config.commands import MeshConfig
from prism.config.common import LogConfig
from prism.config.registry import RegistryConfig
from prism.ops import gpus, launcher, template
from prism.ops.plan import check_model, plan
from prism.runtime.ports import _ephemeral_ports, free_port


def flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


@pytest.mark.parametrize("mode,prefill_role", [("e/p/d", "prefill"), ("ep/d", "encode_prefill")])
def test_disaggregated_modes_wire_prefill_and_decode(mode, prefill_role):
    stages = plan(mesh_config(mode, "m", prefill_workers=2, decode_workers=1))
    names = [stage.name for stage in stages]
    encoders = ["encoder-0"] if mode == "e/p/d" else []
    assert names == [*encoders, "prefill-0", "prefill-1", "decode-0", "front"]
    by_name = {stage.name: stage for stage in stages}
    assert flag(by_name["prefill-1"].argv, "--role") == [prefill_role]
    assert flag(by_name["decode-0"].argv, "--role") == ["decode"]
    engines = [by_name[n] for n in ("prefill-0", "prefill-1", "decode-0")]
    kv_ports = [flag(stage.argv, "--kv-port")[0] for stage in engines]
    assert len(set(kv_ports)) == 3
    peers = flag(by_name["front"].argv, "--peer")
    assert sorted(peer.split("=")[0] for peer in peers) == sorted(
        [*(["encoder"] if encoders else []), "prefill", "prefill", "decode"]
    )
    assert f"decode={by_name['decode-0'].address}" in peers
    assert flag(by_name["front"].argv, "--mode") == [mode]


def test_engines_get_disjoint_cores():
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        pytest.skip("the caller chose the cores")
    stages = plan(mesh_config("ep/d", "m"))
    prefill, decode = (s for s in stages if s.name in ("prefill-0", "decode-0"))
    assert prefill.cpus and decode.cpus
    if len(os.sched_getaffinity(0)) >= 2:
        assert not prefill.cpus & decode.cpus
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(prefill.cpus)))
    # More engines than cores: the prefill keeps a core of its own, the decodes share.
    cores = len(os.sched_getaffinity(0))
    stages = plan(mesh_config("e/p/d", "m", decode_workers=cores + 1))
    prefill, *decodes = (s for s in stages if s.name.startswith(("prefill", "decode")))
    assert all(not prefill.cpus & decode.cpus for decode in decodes)


def test_free_ports_avoid_the_ephemeral_range():
    ephemeral = _ephemeral_ports()
    assert all(free_port() not in ephemeral for _ in range(20))


def test_a_dynamic_registry_replaces_the_static_peers():
    consul = RegistryConfig("consul://127.0.0.1:8500", consul_check_interval="1s")
    stages = plan(mesh_config("e/pd", "m", encoders=2, workers=2,
                             routing="least-loaded", registry=consul))  # fmt: skip
    assert [s.name for s in stages] == [
        "encoder-0",
        "encoder-1",
        "worker-0",
        "worker-1",
        "front",
    ]
    for stage in stages:
        assert flag(stage.argv, "--registry") == ["consul://127.0.0.1:8500"]
        assert flag(stage.argv, "--consul-check-interval") == ["1s"]
        assert flag(stage.argv, "--peer") == []
        # Each argv is one the stage's parser takes.
        build_parser().parse_args(stage.argv[stage.argv.index("prism.cli") + 1 :])
    assert flag(stages[-1].argv, "--routing") == ["least-loaded"]


def test_serve_forwards_its_registry_flags_and_replica_counts():
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--mode", "e/p/d", "--prefill", "1", "--decode", "2",
         "--registry", "consul://h:8500", "--consul-token", "t"]
    )  # fmt: skip
    assert (args.prefill_workers, args.decode_workers) == (1, 2)
    config = MeshConfig.from_args(args)
    assert config.registry.to_argv() == ["--registry", "consul://h:8500"]
    # The token reaches every stage in its environment, not its command line.
    for stage in plan(config):
        assert stage.env["CONSUL_HTTP_TOKEN"] == "t"
        assert "t" not in stage.argv
    # The static registry's entries are the launcher's --peer flags: it forwards nothing.
    static = build_parser().parse_args(["serve", "--model", "m", "--advertise-host", "a"])
    assert MeshConfig.from_args(static).registry.to_argv() == []


def test_parsers_go_to_the_processor_and_reasoning_to_every_engine():
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--reasoning-parser", "deepseek_r1"]
    )  # fmt: skip
    config = mesh_config("e/p/d", "m", tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        reasoning_parser=args.reasoning_parser)  # fmt: skip
    by_name = {stage.name: stage for stage in plan(config)}
    front = by_name["front"].argv
    assert flag(front, "--tool-call-parser") == ["hermes"]
    assert "--enable-auto-tool-choice" in front
    for name in ("front", "prefill-0", "decode-0"):
        assert flag(by_name[name].argv, "--reasoning-parser") == ["deepseek_r1"], name
    for name in ("prefill-0", "decode-0", "encoder-0"):
        assert not flag(by_name[name].argv, "--tool-call-parser"), name
    plain = plan(mesh_config("epd", "m"))
    assert not any("--reasoning-parser" in stage.argv for stage in plain)


def test_the_public_grpc_api_and_kserve_are_where_serve_is_told():
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.grpc_port, args.grpc_host, args.kserve_grpc_port) == (50050, "", 0)
    assert (args.front, args.http_host, args.http_port) == ("combined", "", 8000)
    config = mesh_config("epd", "m", grpc_host="0.0.0.0", grpc_port=50050,
                        kserve_grpc_port=8001)  # fmt: skip
    by_name = {stage.name: stage for stage in plan(config)}
    front = by_name["front"]
    # Bound on every address, reached at the mesh's own host; HTTP at the mesh's host.
    assert flag(front.argv, "--host") == ["0.0.0.0"]
    assert flag(front.argv, "--port") == ["50050"]
    assert front.address == "127.0.0.1:50050"
    assert flag(front.argv, "--http-host") == ["127.0.0.1"]
    assert flag(front.argv, "--kserve-grpc-port") == ["8001"]
    assert flag(front.argv, "--max-in-flight") == ["256"]
    assert flag(by_name["worker-0"].argv, "--host") == ["127.0.0.1"]
    # Port 0: a free one; no KServe unless asked.
    default = {stage.name: stage for stage in plan(mesh_config("epd", "m"))}
    assert int(flag(default["front"].argv, "--port")[0]) > 0
    assert not flag(default["front"].argv, "--kserve-grpc-port")


def test_a_gateway_apart_calls_the_processor_and_is_bounded_as_it_is():
    config = mesh_config("epd", "m", front="split", kserve_grpc_port=8001, http_port=8080)
    by_name = {stage.name: stage for stage in plan(config)}
    processor, gateway = by_name["processor"], by_name["gateway"]
    assert gateway.address == "http://127.0.0.1:8080"
    assert (flag(gateway.argv, "--host"), flag(gateway.argv, "--port")) == (["127.0.0.1"], ["8080"])
    assert flag(gateway.argv, "--peer") == [f"processor={processor.address}"]
    assert flag(gateway.argv, "--kserve-grpc-port") == ["8001"]
    assert not flag(processor.argv, "--kserve-grpc-port")
    assert flag(gateway.argv, "--max-in-flight") == flag(processor.argv, "--max-in-flight")
    assert flag(processor.argv, "--http-port") == []


def test_serve_describes_every_endpoint_and_writes_them_as_json(tmp_path):
    config = mesh_config("e/p/d", "m", served_model_name="tiny", kserve_grpc_port=8001)
    mesh = launcher.Mesh(plan(config))
    status = launcher.endpoints(config, mesh)
    assert status["model"] == "tiny" and status["openai"] == "http://127.0.0.1:8000/v1"
    assert status["grpc"] == mesh.address("front")
    assert status["kserve_grpc"] == "127.0.0.1:8001"
    assert [s["role"] for s in status["stages"]] == ["encoder", "prefill", "decode", "front"]
    text = launcher.describe(status).splitlines()
    assert text[0] == "prism (e/p/d) ready: http://127.0.0.1:8000/v1"
    assert any(status["grpc"] in line and "prism.v1.InferenceService" in line for line in text)
    assert any("127.0.0.1:8001" in line and "KServe v2" in line for line in text)
    for stage in mesh.stages:
        assert any(stage.address in line and stage.metrics_url in line for line in text)
    path = tmp_path / "status.json"
    launcher._write_status(str(path), status)
    assert json.loads(path.read_text()) == status
    assert not (tmp_path / "status.json.partial").exists()


def test_simulated_engines_get_their_flags_and_no_cores_of_their_own(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--mode", "ep/d", "--engine", "sim", "--decode", "2",
         "--sim-decode-step-ms", "2.5"]
    )  # fmt: skip
    config = MeshConfig.from_args(args)
    assert config.sim.sim_decode_step_ms == 2.5
    engines = [stage for stage in plan(config) if stage.name.startswith(("prefill", "decode"))]
    assert len(engines) == 3
    for stage in engines:
        assert flag(stage.argv, "--engine") == ["sim"]
        assert not stage.cpus and "VLLM_CPU_OMP_THREADS_BIND" not in stage.env
        worker = build_parser().parse_args(stage.argv[stage.argv.index("worker") :])
        assert (worker.engine, worker.sim_decode_step_ms) == ("sim", 2.5)


def test_several_simulated_engines_share_a_process_each_its_own_peer():
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--engine", "sim", "--workers", "5", "--sim-engines", "2"]
    )
    stages = plan(MeshConfig.from_args(args))
    workers = [stage for stage in stages if stage.name.startswith("worker")]
    assert [flag(s.argv, "--sim-engines") for s in workers] == [["2"], ["2"], []]
    for stage in workers:
        port = int(flag(stage.argv, "--port")[0])
        assert stage.replicas == [f"127.0.0.1:{port + i}" for i in range(len(stage.replicas))]
    (front,) = (stage for stage in stages if stage.name == "front")
    peers = [a.removeprefix("worker=") for a in flag(front.argv, "--peer")]
    assert peers == [a for s in workers for a in s.replicas] and len(set(peers)) == 5


def test_free_ports_in_a_row_are_each_free_and_handed_out_once():
    first = free_port(count=4)
    ephemeral = _ephemeral_ports()
    assert all(first + i not in ephemeral for i in range(4))
    assert all(not first <= free_port() < first + 4 for _ in range(50))


def test_the_template_runs_the_cpus_stages_and_no_mesh_on_gpus():
    stages = plan(mesh_config("e/p/d", "m", log_level="warning"))
    # Global flags before the stage command, as the plan writes them.
    assert stages[0].argv[3:5] == ["--log-level", "warning"]
    assert all(template.runs(stage) for stage in stages)
    # What each imports as it starts, the engine and the servicers included.
    assert {stage.name: template.imports(stage.argv)[1:] for stage in stages} == {
        "encoder-0": template.MODULES["encoder"],
        "prefill-0": ("prism.services.worker.serving",),
        "decode-0": ("prism.services.worker.serving",),
        "front": ("prism.services.front", "prism.services.processor.servicer"),
    }
    # A simulated engine's worker imports neither vLLM nor torch.
    args = build_parser().parse_args(["serve", "--model", "m", "--engine", "sim"])
    (sim,) = [stage for stage in plan(MeshConfig.from_args(args)) if stage.name == "worker-0"]
    assert template.imports(sim.argv) == ("prism.cli", *template.SIM_WORKER)
    # A stage that runs through another command (a network namespace's) is spawned.
    wrapped = dataclasses.replace(stages[0], argv=["ip", "netns", "exec", "h1", *stages[0].argv])
    assert not template.runs(wrapped)
    # A mesh with a stage on a GPU: no template, no process started.
    stages[1].placement = gpus.Placement((0,))
    assert not template.runs(stages[1])
    assert template.Template.for_stages(stages) is None


def test_a_replica_count_the_mode_has_no_role_for_is_refused():
    with pytest.raises(ValueError, match="--prefill-workers does not apply to --mode epd"):
        plan(mesh_config("epd", "m", prefill_workers=3))
    with pytest.raises(ValueError, match="--encoders does not apply to --mode ep/d"):
        plan(mesh_config("ep/d", "m", encoders=2))
    with pytest.raises(ValueError, match="--workers does not apply to --mode e/p/d"):
        plan(mesh_config("e/p/d", "m", workers=2))


def test_serve_takes_the_seed_and_global_flags_after_its_command():
    args, unknown = build_parser().parse_known_args(
        ["--log-level", "warning", "serve", "--model", "m", "--mode", "ep/d", "--seed", "7",
         "--log-format", "json"]
    )  # fmt: skip
    assert unknown == [] and (args.log_level, args.log_format) == ("warning", "json")
    config = MeshConfig.from_args(args, log=LogConfig.from_args(args))
    engines = [s for s in plan(config) if s.name.startswith(("prefill", "decode"))]
    assert engines and all(flag(s.argv, "--seed") == ["7"] for s in engines)
    assert all(flag(s.argv, "--log-format") == ["json"] for s in plan(config))


def test_a_missing_model_directory_is_refused_once_and_a_hub_id_left_to_the_stages(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "empty").mkdir(parents=True)
    (tmp_path / "models" / "tiny").mkdir()
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    check_model("models/tiny")
    for model in ("Qwen/Qwen2-VL-2B-Instruct", "gpt2"):
        check_model(model)
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        check_model("models/empty")
    for missing in ("models/typo", "./typo", str(tmp_path / "typo")):
        with pytest.raises(ValueError, match="no such model directory"):
            check_model(missing)
