"""End to end through real processes: OpenAI's parameters beyond plain text (logprobs, n,
structured output, logit bias, stop strings, echo, usage, tools) answered by every mode exactly as
`vllm serve` answers them on the same tiny model (tests/support/parity.py)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from support import parity
from support.cases import openai_client

NAMES = list(parity.cases(None))
# Follow-ups are test_responses_parity.py's: each needs its first turn's id.
ANSWERED = [name for name in NAMES if not name.startswith(("bad_", "followup_"))]


def assert_same(got: object, expected: object, where: str = "") -> None:
    """Equal, but for log probabilities, which may differ by 1e-4."""
    if isinstance(expected, float) and isinstance(got, float | int):
        assert math.isclose(got, expected, abs_tol=1e-4), f"{where}: {got} != {expected}"
    elif isinstance(expected, dict) and isinstance(got, dict):
        assert got.keys() == expected.keys(), f"{where}: keys {got.keys()} != {expected.keys()}"
        for key in expected:
            assert_same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple) and isinstance(got, list | tuple):
        assert len(got) == len(expected), f"{where}: {len(got)} items != {len(expected)}"
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


@pytest.mark.parametrize("case", ANSWERED)
def test_answers_as_vllm_serve(mesh, served, case):
    expected = parity.comparable(served(mesh.family)[case])
    assert expected["status"] == 200, served(mesh.family)[case]
    sent = parity.cases(mesh.model)[case]
    got = parity.comparable(parity.ask(mesh.base_url, mesh.model, sent))
    assert_same(got, expected, case)


def test_the_cases_are_not_trivial(mesh, served):
    """Guards the parity cases: they exercise what they name."""
    answers = {name: parity.comparable(served(mesh.family)[name]) for name in ANSWERED}
    choices = answers["n_seeded"]["choices"]
    assert len(choices) == 3 and len({c["text"] for c in choices.values()}) > 1
    top = answers["chat_logprobs"]["choices"][0]["logprobs"]
    assert len(top) == 8 and all(len(tops) == 5 for _, _, tops in top)
    echo = answers["completion_echo"]["choices"][0]
    assert echo["text"].startswith("Once upon a time") and echo["logprobs"][0][1] is None
    schema = answers["json_schema"]["choices"][0]
    assert schema["finish_reason"] == "stop", schema
    jsonschema.validate(json.loads(schema["text"]), parity.SCHEMA)
    # Any object: its keys are free text, which a random-weight model may not end.
    assert answers["json_object"]["choices"][0]["text"].startswith("{")
    assert answers["choice"]["choices"][0]["text"] in ("yes", "no")
    assert answers["grammar"]["choices"][0]["text"] in ("cat", "dog", "bird")
    assert answers["stop_included"]["choices"][0]["text"] == ","
    # The context's last 20 tokens, not the 32 asked for.
    assert answers["context_nearly_full"]["usage"][1] == 20


def test_the_tool_cases_are_not_trivial(mesh, served):
    answers = {name: parity.comparable(served(mesh.family)[name]) for name in ANSWERED}
    # Chat's answers (the Responses API's have output items, not choices).
    choice = {name: answer["choices"][0] for name, answer in answers.items() if "choices" in answer}
    named = choice["tools_named"]
    assert named["finish_reason"] == "stop" and named["text"] == "" and not named["content_null"]
    assert [c["name"] for c in named["tool_calls"].values()] == ["get_time"]
    one = choice["tools_one_call"]
    assert one["finish_reason"] == "tool_calls" and len(one["tool_calls"]) == 1
    json.loads(one["tool_calls"][0]["arguments"])
    # Parallel calls, streamed, until the length cuts them short.
    assert len(choice["tools_required_stream"]["tool_calls"]) > 1
    assert len(choice["tools_auto_stream"]["tool_calls"]) > 1
    assert all(c.get("id_ok") for c in choice["tools_auto_stream"]["tool_calls"].values())
    for name in ("tools_none", "tools_auto_text", "tools_history"):
        assert choice[name]["text"] and not choice[name]["tool_calls"], name


@pytest.mark.parametrize(
    ("case", "param"),
    [
        ("bad_schema", "response_format"),
        ("bad_regex", "structured_outputs"),
        ("bad_n_greedy", "n"),
        ("bad_tools_empty", "tools"),
        ("bad_tool_choice_unknown", "tool_choice"),
        ("bad_tool_choice_without_tools", "tool_choice"),
    ],
)
def test_what_vllm_refuses_is_a_400_naming_the_parameter(mesh, served, case, param):
    assert served(mesh.family)[case]["status"] == 400
    answer = parity.ask(mesh.base_url, mesh.model, parity.cases(mesh.model)[case])
    assert answer["status"] == 400, answer
    assert answer["body"]["error"]["param"] == param, answer


@pytest.mark.parametrize("case", ["bad_context_full", "bad_context_exceeded"])
def test_a_prompt_the_context_cannot_hold_is_refused_as_vllm_refuses_it(mesh, served, case):
    expected = served(mesh.family)[case]
    assert expected["status"] == 400, expected
    answer = parity.ask(mesh.base_url, mesh.model, parity.cases(mesh.model)[case])
    assert answer["status"] == 400, answer
    assert answer["body"]["error"]["param"] == expected["body"]["error"]["param"], answer


def test_the_openai_sdk_reads_tool_calls_and_their_stream(mesh, served):
    """The official SDK's own types, whole and streamed, hold `vllm serve`'s calls."""
    whole = parity.comparable(served(mesh.family)["tools_one_call"])["choices"][0]
    streamed = parity.comparable(served(mesh.family)["tools_named_stream"])["choices"][0]
    client = openai_client(mesh)
    _, body = parity.cases(mesh.model)["tools_one_call"]
    answer = client.chat.completions.create(model=mesh.model, **body)
    (choice,) = answer.choices
    assert choice.finish_reason == whole["finish_reason"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (c["name"], c["arguments"]) for c in whole["tool_calls"].values()
    ]
    _, body = parity.cases(mesh.model)["tools_named_stream"]
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(model=mesh.model, **body):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += (call.function and call.function.name) or ""
                entry[1] += (call.function and call.function.arguments) or ""
    assert calls == {i: [c["name"], c["arguments"]] for i, c in streamed["tool_calls"].items()}
    assert reasons[-1] == streamed["finish_reason"] == "stop"
