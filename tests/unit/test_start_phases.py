"""What `prism serve` shows while a mesh starts: each stage's phase read from its output,
the output relayed with the stage's name, the order in which stages that share a device
or compiled graphs start, and the flags that bound and speed up the start."""

from __future__ import annotations

import io
import json
import logging
import threading

from support.meshes import mesh_config

from prism.cli import build_parser
from prism.config.commands import MeshConfig
from prism.ops import phases
from prism.ops.plan import plan

# As vLLM 0.32 logs them: its worker process, then its engine core (GPU and CPU).
ENGINE_START = [
    "(EngineCore pid=7) INFO 11-28 17:11:26 [core.py:133] Initializing a V1 LLM engine (v0.32.0)",
    "(EngineCore pid=7) INFO 11-28 17:11:27 [cpu_model_runner.py:68] Starting to load model m...",
    "(EngineCore pid=7) INFO 11-28 17:11:27 [default_loader.py:501] Loading weights took 0.02 s",
    "(EngineCore pid=7) INFO 11-28 17:11:30 [backends.py:1167] Dynamo bytecode transform time: 4 s",
    "(EngineCore pid=7) INFO 11-28 17:11:40 [mem_utils.py:218] Memory profiling takes 2.1 seconds.",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 40%|####      | 27/67",
    "(EngineCore pid=7) INFO 11-28 17:12:15 [core.py:402] init engine (profile, create kv cache, "
    "warmup model) took 46.67 s",
]


def test_each_phase_of_an_engines_start_is_read_from_vllms_lines():
    seen = [phases.phase_of(line) for line in ENGINE_START]
    assert seen == ["starting the engine", "loading weights", None, "compiling",
                    "profiling memory", "capturing graphs", "starting its server"]  # fmt: skip
    # A warm start loads what an engine before it compiled; on the CPU, compiling is
    # Inductor's work during the warm-up.
    warm = "INFO 11-28 17:11:30 [backends.py:296] Directly load the compiled graph(s) for compile"
    assert phases.phase_of(warm) == "loading compiled graphs"
    aot = "INFO 11-28 17:11:30 [decorators.py:319] [backbone] Directly load AOT compilation from"
    assert phases.phase_of(aot) == "loading compiled graphs"
    cpu = "INFO 11-28 17:11:28 [cpu_model_runner.py:87] Warming up model for the compilation..."
    assert phases.phase_of(cpu) == "compiling"
    assert phases.phase_of("2026-11-28 17:15:30,757 INFO prism.runtime.stage [] serving") is None


def test_vllms_lines_below_the_stages_level_are_held_back_and_the_rest_shown():
    info, warning = ENGINE_START[0], "(EngineCore pid=7) WARNING 11-28 17:11:26 [x.py:1] careful"
    assert not phases.shown(info, logging.WARNING) and phases.shown(info, logging.INFO)
    assert phases.shown(warning, logging.WARNING)
    # Prism's own lines are at the stage's level already; tracebacks and prints always show.
    assert phases.shown("2026-11-28 17:15:30,757 INFO prism.x [] hello", logging.WARNING)
    assert phases.shown("Traceback (most recent call last):", logging.ERROR)


def test_the_relay_names_the_stage_on_each_line_and_follows_its_phase():
    out, progress = io.StringIO(), phases.Progress()
    assert progress.phase == phases.IMPORTING
    lines = [f"{line}\n" for line in ENGINE_START[:3]] + ["Traceback: boom\n", "no newline"]
    phases.relay(lines, out, "decode-0  | ", logging.WARNING, progress, threading.Lock())
    assert out.getvalue() == "decode-0  | Traceback: boom\ndecode-0  | no newline\n"
    assert progress.phase == "loading weights"
    assert progress.describe().startswith("loading weights for 0 s (")


def test_the_relay_reads_on_once_its_output_is_closed():
    out, progress = io.StringIO(), phases.Progress()
    out.close()
    phases.relay(iter(ENGINE_START), out, "", logging.DEBUG, progress, threading.Lock())
    # Read to the end (a stage whose output nobody reads would block), phases followed.
    assert progress.phase == "starting its server"


def _by_name(config: MeshConfig) -> dict:
    return {stage.name: stage for stage in plan(config)}


def test_stages_that_share_a_gpu_start_one_after_another():
    stages = _by_name(mesh_config("e/p/d", "m", gpus=["0"]))
    assert stages["encoder-0"].after == []
    assert stages["prefill-0"].after == ["encoder-0"]
    assert stages["decode-0"].after == ["prefill-0"]
    assert stages["front"].after == []
    # Each engine on a GPU of its own (the encoder beside the first) starts at once.
    stages = _by_name(mesh_config("e/p/d", "m", gpus=["0,1"]))
    assert (stages["prefill-0"].after, stages["decode-0"].after) == (["encoder-0"], [])


def test_engines_given_their_kv_cache_in_bytes_start_together_on_one_gpu():
    # Their start profiles no memory that a neighbour's could be counted in.
    flags = ["--kv-cache-memory-bytes", "2147483648"]
    stages = _by_name(mesh_config("e/p/d", "m", gpus=["0"], vllm_flags=flags))
    assert all(stage.after == [] for stage in stages.values())


def test_cpu_engines_that_compile_wait_for_the_first_and_share_one_cache(tmp_path):
    eager = _by_name(mesh_config("ep/d", "m", gpus=["none"], decode_workers=2))
    assert all(stage.after == [] for stage in eager.values())
    flags = ["--no-enforce-eager"]
    compiled = mesh_config("ep/d", "m", gpus=["none"], decode_workers=2, vllm_flags=flags,
                           compile_cache=str(tmp_path))  # fmt: skip
    stages = _by_name(compiled)
    assert stages["prefill-0"].after == []
    assert stages["decode-0"].after == stages["decode-1"].after == ["prefill-0"]
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert stages[name].env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
        assert stages[name].env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert "VLLM_CACHE_ROOT" not in stages["front"].env


def test_vllm_logs_its_phases_while_the_launcher_shows_the_stages_level(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    config = mesh_config("epd", "m")
    config.log.log_level = "warning"
    worker = _by_name(config)["worker-0"]
    assert worker.env["VLLM_LOGGING_LEVEL"] == "INFO" and worker.log_level == "WARNING"
    assert worker.tag_lines
    config.log.log_format = "json"
    assert not _by_name(config)["worker-0"].tag_lines
    # A level the user gives vLLM is what it logs, and all of it is shown.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    worker = _by_name(config)["worker-0"]
    assert worker.env["VLLM_LOGGING_LEVEL"] == "DEBUG" and worker.log_level == "DEBUG"


def test_the_start_timeout_and_the_compile_cache_are_flags():
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--start-timeout", "90", "--compile-cache", "/c"]
    )
    config = MeshConfig.from_args(args)
    assert config.serve.start_timeout == 90.0 and config.serve.compile_cache == "/c"
    default = MeshConfig.from_args(build_parser().parse_args(["serve", "--model", "m"]))
    assert default.serve.start_timeout == 1800.0


def test_the_relay_of_a_json_mesh_makes_every_line_json_naming_its_stage():
    out, progress = io.StringIO(), phases.Progress()
    lines = [
        '{"level": "INFO", "logger": "vllm.v1.engine", "message": "Starting to load model"}\n',
        '{"level": "DEBUG", "logger": "vllm.config", "message": "held back"}\n',
        '{"level": "INFO", "logger": "prism.services", "message": "serving"}\n',
        "Traceback (most recent call last):\n",
    ]
    phases.relay(lines, out, "", logging.INFO, progress, threading.Lock(), json_stage="decode-0")
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["message"] for r in records] == [
        "Starting to load model",
        "serving",
        "Traceback (most recent call last):",
    ]
    assert {r["stage"] for r in records} == {"decode-0"}
    assert progress.phase == "loading weights"
