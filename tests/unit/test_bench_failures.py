"""The bench says why a request failed: an HTTP error's status and message, an error event
in a stream after its 200, a timeout or the client's error, as a short reason; and the
scale bench tallies reasons that differ only in ids and numbers as one. Pure: a fake
session stands in for the server; nothing is started or sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from bench.lib.load import (
    DETAIL_CHARS,
    ServerFailed,
    failure_reason,
    http_failure,
    normalised,
    one,
    stream_failure,
)
from bench.scale import failures_text, medians

URL = "http://front/v1/chat/completions"
REQUEST_ID = "0f3c9a7e5b2d4c18a6e9f01b2c3d4e5f"


@dataclass
class FakeReply:
    status: int
    lines: list[str]

    async def __aenter__(self) -> FakeReply:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def text(self) -> str:
        return "".join(self.lines)

    @property
    def content(self) -> AsyncIterator[bytes]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[bytes]:
        for line in self.lines:
            yield line.encode()


@dataclass
class FakeSession:
    reply: FakeReply

    def post(self, url: str, json: dict) -> FakeReply:
        return self.reply


def sse(*events: dict) -> list[str]:
    """A stream's lines: each event, then the end."""
    lines = [line for event in events for line in (f"data: {json.dumps(event)}\n", "\n")]
    return [*lines, "data: [DONE]\n"]


def chunk(content: str) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"delta": {"content": content}}]}


def failure(reply: FakeReply) -> ServerFailed:
    with pytest.raises(ServerFailed) as caught:
        asyncio.run(one(FakeSession(reply), URL, {}))  # type: ignore[arg-type]
    return caught.value


def test_an_http_error_fails_with_its_status_and_the_openai_message():
    body = {"error": {"message": f"no worker is ready (request {REQUEST_ID})",
                      "type": "server_error", "param": None, "code": "unavailable"}}  # fmt: skip
    failed = failure(FakeReply(503, [json.dumps(body)]))
    assert failed.reason == f"HTTP 503: no worker is ready (request {REQUEST_ID})"
    # The URL for a run that stops on it, not for the tally.
    assert str(failed) == f"{URL}: {failed.reason}"


def test_an_http_error_without_an_openai_body_gives_the_body_cut_short():
    assert (
        http_failure(502, "<html>\n  Bad Gateway\n</html>")
        == "HTTP 502: <html> Bad Gateway </html>"
    )
    assert http_failure(504, "") == "HTTP 504"
    # vLLM's older flat error body.
    flat = {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    assert http_failure(400, json.dumps(flat)) == "HTTP 400: too long"
    reason = http_failure(500, "word " * 100)
    assert reason.startswith("HTTP 500: word word") and reason.endswith("word ...")
    assert len(reason) <= len("HTTP 500: ") + DETAIL_CHARS


def test_an_error_event_mid_stream_fails_the_request_after_its_200():
    error = {"error": {"message": "the engine stopped", "type": "server_error"}}
    failed = failure(FakeReply(200, sse(chunk("a"), chunk("b"), error)))
    assert failed.reason == "stream error: server_error: the engine stopped"


def test_only_an_event_with_an_error_is_a_failure():
    assert stream_failure(chunk("a")) is None
    assert stream_failure({"choices": [], "usage": {"completion_tokens": 2}, "error": None}) is None
    assert stream_failure({"error": "overloaded"}) == "stream error: overloaded"


def test_a_stream_without_errors_is_timed_as_before():
    usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 52}}
    lines = sse(chunk("a"), chunk("b"), chunk("c"), usage)
    sample = asyncio.run(one(FakeSession(FakeReply(200, lines)), URL, {}))  # type: ignore[arg-type]
    assert (sample.tokens, sample.prompt_tokens, len(sample.gaps)) == (3, 52, 2)
    assert 0 <= sample.ttft <= sample.total


def test_timeouts_and_client_errors_have_reasons_of_their_own():
    assert failure_reason(TimeoutError()) == "timeout"
    # aiohttp's own timeouts are client errors and timeouts both.
    assert failure_reason(aiohttp.ServerTimeoutError("read")) == "timeout"
    lost = aiohttp.ClientConnectionError("Cannot connect to host 127.0.0.1:8123")
    assert failure_reason(lost) == "ClientConnectionError: Cannot connect to host 127.0.0.1:8123"
    assert failure_reason(aiohttp.ServerDisconnectedError("")) == "ServerDisconnectedError"


def test_reasons_that_differ_only_in_ids_and_numbers_are_one():
    one_ = f"HTTP 503: no worker is ready (request {REQUEST_ID})"
    other = "HTTP 503: no worker is ready (request 9b1e77d2c0a84f6e8d3b5a2c1e0f9d8c)"
    assert normalised(one_) == normalised(other) == "HTTP 503: no worker is ready (request <id>)"
    # The kind, an HTTP status say, stays; words without digits stay.
    assert (
        normalised("HTTP 429: 12 requests queued, limit 8")
        == "HTTP 429: N requests queued, limit N"
    )
    lost = "ClientConnectionError: Cannot connect to host 127.0.0.1:8123"
    assert normalised(lost) == "ClientConnectionError: Cannot connect to host N.N.N.N:N"
    assert normalised("stream error: server_error: cmpl-3f2a91bc stopped") == (
        "stream error: server_error: <id> stopped"
    )
    assert normalised("timeout") == "timeout"


def row(failures: dict[str, int], rps: float) -> dict:
    return {"front": "prism", "streams": 64, "failures": sum(failures.values()),
            "failure_reasons": failures, "requests_per_s": rps,
            "cpu_s_per_1000": {"gateway": rps / 10}}  # fmt: skip


def test_the_rounds_total_their_failures_by_reason():
    rounds = [[row({}, 10.0)], [row({"timeout": 2}, 12.0)],
              [row({"HTTP 503: busy": 1, "timeout": 1}, 11.0)]]  # fmt: skip
    (merged,) = medians(rounds)
    assert merged["failures"] == 4
    assert merged["failure_reasons"] == {"timeout": 3, "HTTP 503: busy": 1}
    assert merged["requests_per_s"] == 11.0
    assert failures_text(merged) == "failures 4 (timeout x3; HTTP 503: busy x1)"
    assert failures_text(rounds[0][0]) == "failures 0"
