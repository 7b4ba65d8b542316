"""Request ids, log lines and request metrics, without engines: the gateway in-process and
the pieces on their own. The mesh-wide trace is in test_tracing.py."""

from __future__ import annotations

import json
import logging
import os
from importlib import metadata
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY

import prism
from prism import cli, logs, telemetry
from prism.gateway.app import create_app
from prism.proto.v1 import common_pb2, inference_pb2
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.runtime.ports import free_port


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def root_logging():
    """Puts the root logger's handlers and level back after a test that configures it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_log_lines_carry_the_request_id(capsys, root_logging):
    logs.configure("info", "json")
    token = logs.REQUEST_ID.set("req-42")
    try:
        logging.getLogger("prism.test").info("hello %s", "there")
    finally:
        logs.REQUEST_ID.reset(token)
    logging.getLogger("prism.test").warning("outside")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["message"] == "hello there" and lines[0]["request_id"] == "req-42"
    assert lines[0]["level"] == "INFO" and lines[0]["logger"] == "prism.test"
    assert lines[1]["request_id"] == ""
    logs.configure("info", "text")
    with_id = logs.REQUEST_ID.set("req-43")
    logging.getLogger("prism.test").info("plain")
    logs.REQUEST_ID.reset(with_id)
    assert "[req-43] plain" in capsys.readouterr().err


def test_request_timer_counts_tokens_and_latencies():
    endpoint = "test-timer"
    timer = telemetry.RequestTimer(endpoint)
    assert sample("prism_requests_in_flight", endpoint=endpoint) == 1
    assert sample("prism_requests_waiting", endpoint=endpoint) == 1
    timer.reply(inference_pb2.ChatResponse(token_ids=[1]))
    assert sample("prism_requests_waiting", endpoint=endpoint) == 0
    timer.reply(inference_pb2.ChatResponse(token_ids=[2, 3]))
    usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=4, total_tokens=11)
    timer.reply(inference_pb2.ChatResponse(token_ids=[4], usage=usage))
    timer.finish(completed=True)
    assert sample("prism_time_to_first_token_seconds_count", endpoint=endpoint) == 1
    # One observation per token after the first.
    assert sample("prism_inter_token_latency_seconds_count", endpoint=endpoint) == 3
    assert sample("prism_request_duration_seconds_count", endpoint=endpoint) == 1
    assert sample("prism_prompt_tokens_total", endpoint=endpoint) == 7
    assert sample("prism_completion_tokens_total", endpoint=endpoint) == 4
    assert sample("prism_requests_in_flight", endpoint=endpoint) == 0
    # A request that fails before its first token leaves nothing waiting.
    telemetry.RequestTimer(endpoint).finish(completed=False)
    assert sample("prism_requests_waiting", endpoint=endpoint) == 0
    assert sample("prism_request_duration_seconds_count", endpoint=endpoint) == 1


def test_gateway_returns_request_ids_and_counts_requests():
    app = create_app(Router(StaticRegistry({"processor": [f"127.0.0.1:{free_port()}"]})))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    path = "/v1/chat/completions"
    before = sample("prism_requests_total", endpoint=path, status="503")
    with TestClient(app) as c:
        given = c.post(path, json=chat, headers={"x-request-id": "my-trace-7"})
        assert given.status_code == 503 and given.headers["x-request-id"] == "my-trace-7"
        made = c.post(path, json=chat)
        assert len(made.headers["x-request-id"]) == 32
        # An id that is not a sane token is replaced, not echoed.
        bad = c.post(path, json=chat, headers={"x-request-id": "a b"})
        assert bad.headers["x-request-id"] != "a b"
        assert c.post(path, json={**chat, "n": "x"}).status_code == 400
        assert sample("prism_requests_total", endpoint=path, status="503") == before + 3
        assert sample("prism_requests_total", endpoint=path, status="400") >= 1
        metrics = c.get("/metrics")
        assert metrics.status_code == 200
        assert f'prism_requests_total{{endpoint="{path}",status="503"}}' in metrics.text
        c.get("/v1/anything/else")
        assert sample("prism_requests_total", endpoint="other", status="404") >= 1


def test_every_process_says_which_prism_it_runs(capsys):
    assert prism.__version__ == metadata.version("prism-mesh")
    assert REGISTRY.get_sample_value("prism_build_info", {"version": prism.__version__}) == 1
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"prism {prism.__version__}\n"


def test_json_lines_name_the_role_and_the_trace_and_vllm_writes_them_too(
    capsys, root_logging, monkeypatch, tmp_path
):
    # Recorded, so that the variable configure() sets is taken back after the test.
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "prism-vllm-logging-x"))
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    logs.configure("info", "json", role="worker")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        logging.getLogger("prism.test").info("inside")
    logging.getLogger("prism.test").info("outside")
    inside, outside = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert inside["role"] == outside["role"] == "worker"
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert "trace_id" not in outside
    # vLLM's loggers, in the processes it starts, take the same form from this file.
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["formatters"]["json"] == {"()": "prism.logs.JsonFormatter", "role": "worker"}
    assert config["loggers"]["vllm"]["level"] == "WARNING"
    assert not config["disable_existing_loggers"]
