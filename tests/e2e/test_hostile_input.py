"""Malformed and hostile requests, table-driven, against every mesh: each gets its 4xx
with an OpenAI error body naming the parameter, none reaches an engine, and the mesh
answers a good request afterwards."""

from __future__ import annotations

import base64
import functools
import io
import json
import urllib.request

import grpc
import PIL.Image
import pytest
from support.content import audio, data_url, png, user

from prism.devtools.tiny_models import MAX_POSITIONS
from prism.gateway.openai.chat import chat_request
from prism.gateway.openai.completions import completion_request
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.rpc.channel import sync_channel
from prism.rpc.errors import PrismError

CHAT, COMPLETIONS = "/chat/completions", "/completions"
# The part after the text in `chat(...)`'s message, and its URL.
PART = "messages[0].content[1]"
IMAGE_URL = PART + ".image_url"


def encoded(fmt: str, size: tuple[int, int] = (8, 8), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new(mode, size).save(buffer, fmt)
    return buffer.getvalue()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts, **fields) -> dict:
    return {"model": "MODEL", "messages": user("Look.", *parts), "max_tokens": 2, **fields}


def b64(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"></svg>'


@functools.cache
def cases() -> dict[str, tuple[str, dict | bytes, int, str | None]]:
    """name -> (path, body: JSON or raw bytes, HTTP status, param named in the error)."""
    # 8000 x 8000 pixels (64 M, over the 40 M cap) in a few hundred kilobytes.
    bomb = encoded("PNG", (8000, 8000), "L")
    return {
        "not json": (CHAT, b"{nope", 400, None),
        "json array": (CHAT, b"[1, 2]", 400, None),
        "no model": (CHAT, {"messages": user("hi")}, 400, "model"),
        "unknown model": (CHAT, {**chat(), "model": "nope"}, 404, "model"),
        "no messages": (CHAT, {"model": "MODEL"}, 400, "messages"),
        "empty messages": (CHAT, {"model": "MODEL", "messages": []}, 400, "messages"),
        "message not object": (CHAT, {"model": "MODEL", "messages": ["hi"]}, 400, "messages[0]"),
        "unknown role": (CHAT, {"model": "MODEL", "messages": [{"role": "robot", "content": "x"}]},
                         400, "messages[0].role"),
        "content not text": (CHAT, {"model": "MODEL", "messages": [{"role": "user", "content": 7}]},
                             400, "messages[0].content"),
        "audio part without data": (CHAT, chat({"type": "input_audio", "input_audio": {}}), 400,
                                    PART + ".input_audio.data"),
        "unknown part": (CHAT, chat({"type": "hologram"}), 400, PART + ".type"),
        "text part without text": (CHAT, chat({"type": "text"}), 400, PART + ".text"),
        "image part without url": (CHAT, chat({"type": "image_url"}), 400,
                                   IMAGE_URL),
        "image from assistant": (CHAT, {"model": "MODEL", "messages": [
            {"role": "assistant", "content": [image(data_url(png(1)))]}]}, 400,
            "messages[0].content[0]"),
        "temperature not a number": (CHAT, chat(temperature="hot"), 400, "temperature"),
        "temperature too high": (CHAT, chat(temperature=5), 400, "temperature"),
        "top_p negative": (CHAT, chat(top_p=-1), 400, "top_p"),
        "max_tokens zero": (CHAT, chat(max_tokens=0), 400, "max_tokens"),
        "max_tokens a string": (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
        "max_tokens beyond the context": (CHAT, chat(max_tokens=10**9), 400, "max_tokens"),
        "max_completion_tokens beyond the context": (
            CHAT, chat(max_completion_tokens=MAX_POSITIONS + 1), 400, "max_completion_tokens"),
        "completion max_tokens beyond the context": (
            COMPLETIONS, {"model": "MODEL", "prompt": "hi", "max_tokens": 10**9}, 400,
            "max_tokens"),
        "n above 128": (CHAT, chat(n=129), 400, "n"),
        "n above 1, greedy": (CHAT, chat(n=2, temperature=0), 400, "n"),
        "stop a number": (CHAT, chat(stop=123), 400, "stop"),
        "negative stop token": (CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
        "fractional seed": (CHAT, chat(seed=1.5), 400, "seed"),
        "unknown parameter": (CHAT, chat(frobnicate=True), 400, "frobnicate"),
        "top_logprobs above 20": (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        "tools": (CHAT, chat(tools=[]), 400, "tools"),
        "file url": (CHAT, chat(image("file:///etc/passwd")), 400, IMAGE_URL),
        "gopher url": (CHAT, chat(image("gopher://127.0.0.1:70/")), 400,
                       IMAGE_URL),
        "svg": (CHAT, chat(image(b64(SVG, "image/svg+xml"))), 415, IMAGE_URL),
        "gif": (CHAT, chat(image(b64(encoded("GIF"), "image/gif"))), 415,
                IMAGE_URL),
        "text as png": (CHAT, chat(image(b64(b"just text", "image/png"))), 415,
                        IMAGE_URL),
        "truncated png": (CHAT, chat(image(b64(png(2)[:60], "image/png"))), 400,
                          IMAGE_URL),
        "bad base64": (CHAT, chat(image("data:image/png;base64,@@@@")), 400,
                       IMAGE_URL),
        "decompression bomb": (CHAT, chat(image(b64(bomb, "image/png"))), 400,
                               IMAGE_URL),
        "too many images": (CHAT, chat(*[image(data_url(png(1)))] * 9), 400, "messages"),
        "audio to a model that hears none": (
            CHAT, chat({"type": "audio_url", "audio_url": {"url": b64(audio(1), "audio/wav")}}),
            400, PART + ".audio_url"),
        "prompt over the context": (CHAT, {"model": "MODEL",
                                           "messages": user("word " * MAX_POSITIONS)},
                                    400, "input_tokens"),
        "completion without prompt": (COMPLETIONS, {"model": "MODEL"}, 400, "prompt"),
        "completion token out of vocabulary": (COMPLETIONS, {"model": "MODEL", "prompt": [10**9]},
                                               400, "prompt"),
        "suffix": (COMPLETIONS, {"model": "MODEL", "prompt": "hi", "suffix": "!"}, 400, "suffix"),
        "prompt_logprobs when streaming": (
            COMPLETIONS, {"model": "MODEL", "prompt": "hi", "prompt_logprobs": 1, "stream": True},
            400, "prompt_logprobs"),
    }  # fmt: skip


def for_mesh(mesh, body: dict) -> bytes:
    """`body`, naming the mesh's model where it says MODEL."""
    return json.dumps(body).replace('"MODEL"', json.dumps(mesh.model)).encode()


def post(mesh, path: str, body: dict | bytes) -> tuple[int, dict]:
    if isinstance(body, dict):
        body = for_mesh(mesh, body)
    request = urllib.request.Request(
        mesh.base_url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def engine_prompt_tokens(mesh) -> float:
    return sum(
        value for stage in mesh.engine_stages for key, value in mesh.metrics(stage).items()
        if key.startswith("vllm:prompt_tokens_total")
    )  # fmt: skip


def table(image_server) -> dict[str, tuple[str, dict | bytes, int, str | None]]:
    """`cases()`, and those that need the test's image server."""
    real_png = image_server("/hostile/real.png", png(3)).replace("localhost", "127.0.0.1")
    return {
        **cases(),
        # A real PNG on loopback, by address: the mesh allows the test server's name only.
        "ssrf to loopback": (CHAT, chat(image(real_png)), 400, IMAGE_URL),
        "ssrf by redirect": (CHAT, chat(image(image_server("/hostile/hop", location=real_png))),
                             400, IMAGE_URL),
    }  # fmt: skip


def test_hostile_requests_get_their_4xx_and_the_mesh_keeps_serving(mesh, image_server):
    table_ = table(image_server)
    assert len(table_) >= 25
    before = engine_prompt_tokens(mesh)
    for name, (path, body, status, param) in table_.items():
        got, reply = post(mesh, path, body)
        assert got == status, (name, reply)
        error = reply["error"]
        assert error["param"] == param and error["message"], (name, error)
        assert error["type"] == "invalid_request_error", (name, error)
    # None of it reached an engine.
    assert engine_prompt_tokens(mesh) == before
    status, reply = post(mesh, CHAT, chat(image(data_url(png(4)))))
    assert status == 200 and reply["choices"][0]["message"]["content"] is not None
    assert engine_prompt_tokens(mesh) > before


# The public gRPC API's names for OpenAI's fields.
GRPC_PARAMS = {"max_completion_tokens": "max_tokens"}


def test_the_same_table_over_the_public_grpc_api(mesh, image_server):
    """Each case that is a well-formed request, as the REST door turns it into the public
    gRPC API's, is refused over gRPC too: the status the REST door maps it to, the same
    parameter, and nothing reaches an engine. (The rest are malformed JSON or OpenAI
    fields, which protobuf's types or the REST door's parsing refuse.)"""
    stub = inference_pb2_grpc.InferenceServiceStub(sync_channel(mesh.processor))
    calls = {CHAT: (chat_request, stub.Chat), COMPLETIONS: (completion_request, stub.Complete)}
    before, sent, wrong = engine_prompt_tokens(mesh), [], {}
    for name, (path, body, status, param) in table(image_server).items():
        if isinstance(body, bytes):
            continue
        convert, call = calls[path]
        try:
            request = convert(json.loads(for_mesh(mesh, body)))
        except PrismError:
            continue
        with pytest.raises(grpc.RpcError) as info:
            list(call(request, timeout=60))
        error = PrismError.from_rpc_error(info.value)
        if (error.http_status, error.param) != (status, GRPC_PARAMS.get(param, param)):
            wrong[name] = error
        sent.append(name)
    assert not wrong, wrong
    assert len(sent) >= 15, sent
    assert engine_prompt_tokens(mesh) == before


@pytest.mark.parametrize(
    "request_,param",
    [
        (inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(
            content=[inference_pb2.ContentPart(text="hi")])]), "messages[0].role"),
        (inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(
            role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(
                image=common_pb2.Image(url="http://127.0.0.1:9/x.png"))])]),
         "messages[0].content[0].image_url"),
        (inference_pb2.ChatRequest(
            messages=[inference_pb2.ChatMessage(
                role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(text="hi")])],
            sampling=common_pb2.SamplingParams(n=3, temperature=0)), "n"),
        (inference_pb2.ChatRequest(
            messages=[inference_pb2.ChatMessage(
                role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(text="hi")])],
            sampling=common_pb2.SamplingParams(max_tokens=10**9)), "max_tokens"),
    ],
    ids=["no role", "ssrf", "n", "max_tokens"],
)  # fmt: skip
def test_grpc_callers_get_invalid_argument(mesh, request_, param):
    stub = inference_pb2_grpc.InferenceServiceStub(sync_channel(mesh.processor))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Chat(request_, timeout=60))
    error = PrismError.from_rpc_error(info.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.param == param
