"""End to end through real processes: the parity features over gRPC, from the public
contract alone. A client process with stubs generated here from protos/prism/v1 (and
nothing of Prism's) asks the processor; its answers equal `vllm serve`'s."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import grpc_tools
import pytest
from support import parity
from support.content import png

ROOT = Path(__file__).parents[2]

# Generic: each request given as proto3 JSON, each reply printed as proto3 JSON.
CLIENT = """
import json, sys
import grpc
from google.protobuf import json_format
from prism.proto.v1 import inference_pb2, inference_pb2_grpc

address, calls = sys.argv[1], json.loads(sys.argv[2])
stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(address))
answers = []
for method, request in calls:
    kind = getattr(inference_pb2, method + "Request")
    replies = getattr(stub, method)(json_format.ParseDict(request, kind()), timeout=120)
    answers.append([json_format.MessageToDict(r, preserving_proto_field_name=True)
                    for r in replies])
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """The public contract's Python stubs, generated from the .proto files alone."""
    out = tmp_path_factory.mktemp("stubs")
    protos = ROOT / "protos"
    include = Path(grpc_tools.__file__).parent / "_proto"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"-I{include}",
         f"--python_out={out}", f"--grpc_python_out={out}",
         *map(str, sorted((protos / "prism/v1").glob("*.proto")))],
        check=True,
    )  # fmt: skip
    # Regular packages, so that these, not the installed project's, are imported.
    (out / "prism/__init__.py").touch()
    (out / "prism/v1/__init__.py").touch()
    (out / "client.py").write_text(CLIENT)
    return out


def ask(stubs: Path, address: str, calls: list) -> list[list[dict]]:
    result = subprocess.run(
        [sys.executable, "-I", str(stubs / "client.py"), address, json.dumps(calls)],
        capture_output=True, text=True, timeout=300, cwd=stubs,
        env={"PYTHONPATH": str(stubs)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _chat(text: str, sampling: dict, image: int | None = None) -> list:
    content = [{"text": text}]
    if image is not None:
        content.insert(0, {"image": {"data": base64.b64encode(png(image)).decode()}})
    messages = [{"role": "ROLE_USER", "content": content}]
    return ["Chat", {"messages": messages, "sampling": sampling}]


def by_choice(replies: list[dict]) -> dict[int, dict]:
    choices: dict[int, dict] = {}
    for reply in replies:
        into = choices.setdefault(reply.get("index", 0), {"text": "", "logprobs": []})
        into["text"] += reply.get("text", "")
        into["logprobs"] += reply.get("logprobs", [])
        if reply.get("finish_reason"):
            into["finish_reason"] = reply["finish_reason"]
    return choices


def test_logprobs_choices_and_structure_over_grpc(mesh, served, stubs):
    expected = {name: parity.comparable(served(mesh.family)[name])
                for name in ("chat_logprobs", "n_seeded", "json_schema")}  # fmt: skip
    no_blanks = {
        int(k): v for k, v in parity.cases(mesh.model)["json_schema"][1]["logit_bias"].items()
    }
    schema = {"json_schema": json.dumps(parity.SCHEMA)}
    calls = [
        _chat("Describe it.", {"temperature": 0, "max_tokens": 8, "logprobs": 5}, image=5),
        _chat("Tell me a story.", {"temperature": 1.0, "max_tokens": 6, "n": 3, "seed": 7}),
        _chat("Answer in JSON.", {"temperature": 0, "max_tokens": 48, "logit_bias": no_blanks,
                                  "structured_output": schema}, image=6),
    ]  # fmt: skip
    logprobs, sampled, structured = ask(stubs, mesh.processor, calls)

    (choice,) = by_choice(logprobs).values()
    (reference,) = expected["chat_logprobs"]["choices"].values()
    assert choice["text"] == reference["text"]
    assert choice["finish_reason"] == "FINISH_REASON_LENGTH"
    assert len(choice["logprobs"]) == len(reference["logprobs"])
    for got, (token, logprob, tops) in zip(choice["logprobs"], reference["logprobs"], strict=True):
        assert got["token"]["token"] == token
        assert got["token"]["logprob"] == pytest.approx(logprob, abs=1e-4)
        # Greedy: the drawn token is the most likely, so vLLM's list is the top five.
        assert [t.get("token", "") for t in got["top"]] == [t for t, _ in tops], (got, tops)
        assert [t["rank"] for t in got["top"]] == [1, 2, 3, 4, 5]

    texts = {index: c["text"] for index, c in by_choice(sampled).items()}
    assert texts == {i: c["text"] for i, c in expected["n_seeded"]["choices"].items()}

    (choice,) = by_choice(structured).values()
    assert choice["text"] == expected["json_schema"]["choices"][0]["text"]
    assert choice["finish_reason"] == "FINISH_REASON_STOP"


def _tool(spec: dict) -> dict:
    function = spec["function"]
    tool = {"name": function["name"], "parameters": json.dumps(function["parameters"]),
            "strict": function["strict"]}  # fmt: skip
    if "description" in function:
        tool["description"] = function["description"]
    return tool


def test_a_named_tool_call_over_grpc(mesh, served, stubs):
    """Streamed call pieces, and the whole call parsed on the last message, as `vllm serve`
    streams and answers them."""
    answers = served(mesh.family)
    streamed = parity.comparable(answers["tools_named_stream"])["choices"][0]["tool_calls"]
    whole = parity.comparable(answers["tools_named"])["choices"][0]["tool_calls"]
    body = parity.cases(mesh.model)["tools_named"][1]
    sampling = {"temperature": 0, "max_tokens": body["max_tokens"],
                "logit_bias": {int(k): v for k, v in body["logit_bias"].items()}}  # fmt: skip
    (_, call) = _chat(body["messages"][0]["content"][-1]["text"], sampling)
    call.update(tools=[_tool(tool) for tool in parity.TOOLS],
                tool_choice={"function": body["tool_choice"]["function"]["name"]})  # fmt: skip
    (replies,) = ask(stubs, mesh.processor, [["Chat", call]])

    pieces: dict[int, dict] = {}
    for reply in replies:
        assert not reply.get("text")
        for piece in reply.get("tool_calls", []):
            into = pieces.setdefault(piece.get("index", 0), {"name": "", "arguments": ""})
            into["name"] += piece.get("name", "")
            into["arguments"] += piece.get("arguments", "")
            if piece.get("id"):
                into["id_ok"] = bool(parity.TOOL_CALL_ID.fullmatch(piece["id"]))
    assert pieces == streamed and len(pieces) == 1
    last = replies[-1]
    assert last["finish_reason"] == "FINISH_REASON_STOP"
    parsed = last["parsed"]
    assert parsed["content"] == "" and parsed["finish_reason"] == "FINISH_REASON_STOP"
    assert {i: {"name": c["name"], "arguments": c["arguments"],
                "id_ok": bool(parity.TOOL_CALL_ID.fullmatch(c["id"]))}
            for i, c in enumerate(parsed["tool_calls"])} == whole  # fmt: skip
