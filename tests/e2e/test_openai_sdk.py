"""End to end through real processes: the official OpenAI SDK against the gateway.

With greedy sampling every answer must equal, token for token, what one plain offline
vLLM engine gives on the same model directory (tests/support/oracle.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.cases import (
    ADAPTERS,
    CASES,
    CONCURRENT_CASES,
    SEEDED_CASES,
    ask_case,
    assert_answers_differ,
    openai_client,
)
from support.content import image_part, png


def ask(mesh, case: str, stream: bool, messages: list | None = None) -> tuple[str, object]:
    kind, body, max_tokens = CASES[case]
    return ask_case(mesh, (kind, messages or body, max_tokens), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_offline_vllm(mesh, oracle, case, stream):
    expected = oracle(mesh.family)[case]
    text, usage = ask(mesh, case, stream)
    assert text == expected["text"]
    assert usage.completion_tokens == len(expected["token_ids"])
    assert usage.prompt_tokens == expected["prompt_tokens"]


def test_concurrent_answers_each_equal_offline_vllms(mesh, oracle):
    """64 requests, 16 at a time, each with its own prompt (a quarter with an image):
    every answer is offline vLLM's to that prompt, token for token."""
    expected = oracle(mesh.family)
    assert_answers_differ(expected)

    def answer(name: str) -> tuple[str, int]:
        text, usage = ask_case(mesh, CONCURRENT_CASES[name], stream=True)
        return text, usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        answers = dict(zip(CONCURRENT_CASES, pool.map(answer, CONCURRENT_CASES), strict=True))
    wrong = {
        name: (answer, expected[name]["text"])
        for name, answer in answers.items()
        if answer != (expected[name]["text"], len(expected[name]["token_ids"]))
    }
    assert not wrong, wrong


def test_seeded_samples_at_concurrency_each_equal_offline_vllms(mesh, oracle):
    """16 sampled requests, 8 at a time, each with its own seed: in the modes where
    prefill and decode sample apart, every answer is offline vLLM's seeded one, by text."""
    if mesh.mode not in ("e/p/d", "ep/d"):
        pytest.skip("prefill and decode apart only")
    expected = oracle(mesh.family)
    assert_answers_differ(expected, SEEDED_CASES)
    with ThreadPoolExecutor(8) as pool:
        texts = pool.map(lambda name: ask_case(mesh, SEEDED_CASES[name], stream=True)[0],
                         SEEDED_CASES)  # fmt: skip
        wrong = {name: (text, expected[name]["text"])
                 for name, text in zip(SEEDED_CASES, texts, strict=True)
                 if text != expected[name]["text"]}  # fmt: skip
    assert not wrong, wrong
    # Sampled, not greedy: at least some answers are not the greedy ones.
    greedy = [expected[f"concurrent_{i}"]["text"] for i in range(len(SEEDED_CASES))]
    assert [expected[name]["text"] for name in SEEDED_CASES] != greedy


def test_image_changes_the_answer(oracle, mesh):
    # Guards the parity tests against a model that ignores its image.
    results = oracle(mesh.family)
    assert results["one_image"]["token_ids"] != results["other_image"]["token_ids"]


def test_http_image_url_matches_data_url(mesh, oracle, image_server):
    url = image_server(f"/{mesh.family}/one.png", png(1))
    _, messages, _ = CASES["one_image"]
    swapped = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}} if p["type"] == "image_url" else p
                for p in messages[0]["content"]
            ],
        }
    ]
    text, usage = ask(mesh, "one_image", stream=True, messages=swapped)
    assert text == oracle(mesh.family)["one_image"]["text"]
    assert usage.prompt_tokens == oracle(mesh.family)["one_image"]["prompt_tokens"]


def test_the_first_requests_after_ready_all_complete(mesh):
    """The fixture sent them the moment the mesh reported ready: no stream may end short
    without an error, or drop, because an engine or a connection was still warming up."""
    assert mesh.first_outcomes == ["completed"] * len(mesh.first_outcomes), mesh.log_problems()


def test_models_lists_the_served_model_and_its_adapters(mesh):
    models = openai_client(mesh).models.list()
    assert [m.id for m in models.data] == [mesh.model, *ADAPTERS]


def test_health(mesh):
    reply = httpx.get(mesh.base_url.removesuffix("/v1") + "/health")
    assert reply.status_code == 200


HI = [{"role": "user", "content": "hi"}]
IMAGE_PARAM = "messages[0].content[0].image_url"


def chat(**fields) -> tuple[str, dict]:
    return "chat/completions", {"model": None, "messages": HI, **fields}


def chat_with_image(url: str, count: int = 1) -> tuple[str, dict]:
    return chat(messages=[{"role": "user", "content": [image_part(url)] * count}])


# (description, path, body, HTTP status, offending parameter); model None = the served one.
BAD_REQUESTS = [
    ("unknown model", *chat(model="nope"), 404, "model"),
    ("no messages", *chat(messages=[]), 400, "messages"),
    ("bad role", *chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    ("temperature out of range", *chat(temperature=7), 400, "temperature"),
    ("max_tokens not an int", *chat(max_tokens="lots"), 400, "max_tokens"),
    ("n above 1, greedy", *chat(n=2, temperature=0), 400, "n"),
    ("svg image", *chat_with_image("data:image/svg+xml;base64,PHN2Zy8+"), 415, IMAGE_PARAM),
    ("text as image", *chat_with_image("data:image/png;base64,aGVsbG8="), 415, IMAGE_PARAM),
    ("ftp url", *chat_with_image("ftp://127.0.0.1/a.png"), 400, IMAGE_PARAM),
    ("too many images", *chat_with_image("data:image/png;base64,AAAA", 9), 400, "messages"),
    ("empty prompt", "completions", {"model": None, "prompt": ""}, 400, "prompt"),
    ("unknown model (completion)", "completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
]


@pytest.mark.parametrize(
    "path,body,status,param",
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_openai_error(mesh, path, body, status, param):
    if body.get("model", "") is None:
        body = {**body, "model": mesh.model}
    reply = httpx.post(f"{mesh.base_url}/{path}", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"] and error["code"]
    assert error["param"] == param


def test_invalid_json_is_400(mesh):
    reply = httpx.post(
        f"{mesh.base_url}/chat/completions", content=b"{not json", timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert reply.status_code == 400
    assert "JSON" in reply.json()["error"]["message"]


def test_still_serves_after_bad_requests(mesh, oracle):
    for _, path, body, _, _ in BAD_REQUESTS:
        body = {**body, "model": body["model"] or mesh.model}
        httpx.post(f"{mesh.base_url}/{path}", json=body, timeout=30)
    text, _ = ask(mesh, "one_image", stream=False)
    assert text == oracle(mesh.family)["one_image"]["text"]


def test_sse_ends_with_done(mesh):
    with httpx.stream(
        "POST",
        f"{mesh.base_url}/chat/completions",
        json={"model": mesh.model, "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 4, "stream": True},
        timeout=60,
    ) as reply:  # fmt: skip
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"


def test_a_stream_interval_sends_fewer_chunks_and_the_same_answer(mesh, oracle):
    """vLLM's per-request `stream_interval` through every hop: the first token alone, then
    that many a chunk (a decode engine's own first alone too); the text is offline vLLM's."""
    _, messages, max_tokens = CASES["one_image"]
    expected = oracle(mesh.family)["one_image"]
    chunks = list(openai_client(mesh).chat.completions.create(
        model=mesh.model, messages=messages, temperature=0, max_tokens=max_tokens,
        stream=True, extra_body={"stream_interval": 4},
    ))  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected["text"]
    tokens = len(expected["token_ids"])
    carrying = [ch for ch in chunks if ch.choices[0].delta.content]
    assert len(carrying) <= 2 + -(-(tokens - 2) // 4), (tokens, len(carrying))
