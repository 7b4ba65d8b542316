"""End to end through real processes: reasoning split from content by vLLM's reasoning
parser, streamed and whole, alone and before a forced tool call, and as the Responses API's
reasoning item, as `vllm serve` started with the same parsers answers it
(tests/support/parity.py). In E/P/D: prefill and decode
apart, where both engines start the call's grammar only after the reasoning (one engine that
does, as in EPD, is the simpler case), and the processor parses the answer that two engines
streamed as it parses every mode's."""

from __future__ import annotations

import json

import pytest
from support import parity
from support.meshes import start_mesh
from test_openai_parity import assert_same

FAMILY = "llava"
NAMES = list(parity.reasoning_cases(None))


@pytest.fixture(scope="module")
def expected(models, tmp_path_factory) -> dict[str, dict]:
    log = tmp_path_factory.mktemp("served-reasoning") / "vllm-serve.log"
    model = str(models[FAMILY])
    return parity.reference(model, log, parity.REASONING_FLAGS, parity.reasoning_cases)


@pytest.fixture(scope="module")
def reasoning_mesh(models, expected, tmp_path_factory):
    running = start_mesh(
        FAMILY, "e/p/d", models[FAMILY], tmp_path_factory.mktemp("logs"),
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="deepseek_r1",
    )  # fmt: skip
    yield running
    running.stop()


@pytest.mark.parametrize("case", NAMES)
def test_reasoning_as_vllm_serve(reasoning_mesh, expected, case):
    want = parity.comparable(expected[case])
    assert want["status"] == 200, expected[case]
    sent = parity.reasoning_cases(reasoning_mesh.model)[case]
    got = parity.comparable(parity.ask(reasoning_mesh.base_url, reasoning_mesh.model, sent))
    assert_same(got, want, case)


def test_the_reasoning_cases_are_not_trivial(expected):
    chats = [name for name in NAMES if not name.startswith("responses")]
    choice = {name: parity.comparable(expected[name])["choices"][0] for name in chats}
    for name in ("reasoning", "reasoning_stream"):
        assert choice[name]["reasoning"] and choice[name]["text"], choice[name]
    only = choice["reasoning_only"]
    assert only["reasoning"] and only["text"] == "" and only["content_null"]
    for name in ("reasoning_then_call", "reasoning_then_call_stream"):
        called = choice[name]
        assert called["reasoning"] and called["finish_reason"] == "tool_calls", called
        (call,) = called["tool_calls"].values()
        json.loads(call["arguments"])
    for name in ("responses_reasoning", "responses_reasoning_stream"):
        kinds = [item["type"] for item in parity.comparable(expected[name])["output"]]
        assert kinds == ["reasoning", "message"], (name, kinds)
