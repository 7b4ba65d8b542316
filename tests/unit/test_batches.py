"""OpenAI's Batch API in the gateway alone, called by the official openai SDK before a
processor that answers from a script: files in and out, each line answered as the same
request sent alone, a bad line failing alone, refusals naming what is wrong, cancel, a
completion window that ends, a batch taken up again after its front died, and batch lines
that wait while an interactive request is in flight."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import grpc
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from support.scripted import Call

from prism.gateway.app import create_app
from prism.gateway.batch.opening import open_batch
from prism.gateway.batch.runner import BatchRunner, alive, me
from prism.gateway.batch.schemas import BatchRequest, BatchSettings
from prism.gateway.batch.store import BatchStore
from prism.proto.v1 import common_pb2, inference_pb2
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError
from prism.rpc.server import InFlightLimit

USAGE = common_pb2.Usage(prompt_tokens=9, completion_tokens=3, total_tokens=12)


class Echo:
    """A processor that answers each chat with its last message's text, and keeps the
    requests; `hold` keeps every call waiting until set."""

    def __init__(self, hold: bool = False, failures: int = 0) -> None:
        self.requests: list[str] = []
        self.hold = hold
        self.failures = failures

    def chat(self, request: inference_pb2.ChatRequest) -> Call | Held:
        text = request.messages[-1].content[0].text
        self.requests.append(text)
        if self.failures:
            self.failures -= 1
            return Failing()
        if self.hold:
            return Held()
        reply = inference_pb2.ChatResponse(text=f"echo {text}", model="m", usage=USAGE,
                                           finish_reason=common_pb2.FINISH_REASON_STOP)  # fmt: skip
        return Call([reply])

    async def close(self) -> None:
        pass


class Held(Call):
    def __init__(self) -> None:
        super().__init__([])

    async def _each(self):
        await asyncio.Event().wait()
        yield None


class Failing(Call):
    def __init__(self) -> None:
        super().__init__([])

    async def _each(self):
        raise PrismError(grpc.StatusCode.UNAVAILABLE, "no processor yet")
        yield None


def line(custom_id: str, text: str, **body) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": body})  # fmt: skip


def settings(root: Path, **fields) -> BatchSettings:
    limits = {"max_file_bytes": 1 << 20, "max_lines": 100, "concurrency": 4, **fields}
    return BatchSettings(BatchStore(root), **limits)


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "batches"


def sdk(processor, batch: BatchSettings) -> tuple[openai.OpenAI, TestClient]:
    app = create_app(Router(StaticRegistry({})), processor=processor, batch=batch)
    http = TestClient(app)
    client = openai.OpenAI(api_key="none", base_url=f"{http.base_url}/v1", http_client=http,
                           max_retries=0)  # fmt: skip
    return client, http


def upload(client: openai.OpenAI, *lines: str) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("in.jsonl", data), purpose="batch").id


def wait(client: openai.OpenAI, batch_id: str, *statuses: str, timeout: float = 20) -> object:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def entries(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def _counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("prism_batch_requests_total", {"outcome": outcome}) or 0.0


def test_each_line_is_answered_as_its_request_alone_and_a_bad_line_fails_alone(root):
    processor = Echo()
    client, http = sdk(processor, settings(root))
    counted = _counted("completed"), _counted("failed")
    with http:
        file_id = upload(client, *[line(f"req-{i}", f"hello {i}") for i in range(6)],
                         "{not json", line("too-hot", "x", temperature=5))  # fmt: skip
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "t"})  # fmt: skip
        assert created.request_counts.total == 8 and created.metadata == {"job": "t"}
        batch = wait(client, created.id, "completed")
        asked = [{"role": "user", "content": "hello 3"}]
        alone = http.post("/v1/chat/completions", json={"model": "m", "messages": asked}).json()
        output, errors = entries(client, batch.output_file_id), entries(client, batch.error_file_id)
        listed = client.batches.list()
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 2)
    assert (_counted("completed") - counted[0], _counted("failed") - counted[1]) == (6, 2)
    assert [entry["custom_id"] for entry in output] == [f"req-{i}" for i in range(6)]
    for i, entry in enumerate(output):
        response = entry["response"]
        assert response["status_code"] == 200 and entry["error"] is None
        assert response["body"]["choices"][0]["message"]["content"] == f"echo hello {i}"
        assert entry["id"].startswith("batch_req_") and response["request_id"] == entry["id"]
    body = output[3]["response"]["body"]
    assert (body["choices"], body["usage"]) == (alone["choices"], alone["usage"])
    bad_json, too_hot = errors
    assert bad_json["custom_id"] is None and bad_json["response"] is None
    assert bad_json["error"]["code"] == "invalid_line" and "line 7" in bad_json["error"]["message"]
    assert too_hot["custom_id"] == "too-hot" and too_hot["response"]["status_code"] == 400
    assert too_hot["response"]["body"]["error"]["param"] == "temperature"
    assert sorted(processor.requests) == sorted([f"hello {i}" for i in range(6)] + ["hello 3"])
    assert batch.usage.input_tokens == 6 * 9 and batch.usage.output_tokens == 6 * 3
    assert batch.completed_at >= batch.in_progress_at >= created.created_at
    assert [b.id for b in listed.data] == [created.id]


def test_a_responses_batch_answers_each_line_as_the_responses_api(root):
    client, http = sdk(Echo(), settings(root))
    with http:
        asked = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "m", "input": f"hi {i}", "store": False}}
                 for i in range(3)]  # fmt: skip
        file_id = upload(client, *map(json.dumps, asked))
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/responses",
                                        completion_window="24h")  # fmt: skip
        batch = wait(client, created.id, "completed")
        output = entries(client, batch.output_file_id)
    texts = [entry["response"]["body"]["output"][0]["content"][0]["text"] for entry in output]
    assert texts == ["echo hi 0", "echo hi 1", "echo hi 2"]
    assert all(entry["response"]["body"]["object"] == "response" for entry in output)


@pytest.mark.parametrize(
    ("lines", "endpoint", "param", "words"),
    [([line("a", "x")], "/v1/embeddings", "endpoint", "Invalid enum value"),
     (['{"method": "POST", "url": "/v1/chat/completions", "body": {}}'],
      "/v1/chat/completions", "input_file_id", "line 1: missing custom_id"),
     ([line("a", "x"), "", line("a", "y")], "/v1/chat/completions", "input_file_id",
      "line 3: custom_id 'a' is used twice"),
     ([line("a", "x")], "/v1/completions", "input_file_id", "is not the batch's endpoint"),
     ([line(str(i), "x") for i in range(4)], "/v1/chat/completions", "input_file_id",
      "more than 3 requests")],
)  # fmt: skip
def test_a_batch_that_cannot_run_is_refused_naming_why(root, lines, endpoint, param, words):
    client, http = sdk(Echo(), settings(root, max_lines=3))
    with http:
        file_id = upload(client, *lines)
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                  completion_window="24h")  # fmt: skip
        assert client.batches.list().data == []
    error = refused.value.body
    assert error["param"] == param and words in error["message"]


def test_files_refused_named_and_deleted(root):
    client, http = sdk(Echo(), settings(root, max_file_bytes=200))
    with http:
        with pytest.raises(openai.BadRequestError) as large:
            upload(client, line("a", "x" * 200))
        with pytest.raises(openai.BadRequestError) as purpose:
            client.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError):
            client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
        file_id = upload(client, line("a", "x"))
        assert client.files.retrieve(file_id).bytes == len(line("a", "x")) + 1
        assert [f.id for f in client.files.list(purpose="batch")] == [file_id]
        assert client.files.delete(file_id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
        no_purpose = http.post("/v1/files", files={"file": ("in.jsonl", b"{}")})
        too_many = http.get("/v1/batches", params={"limit": 500})
        # Said too large by its length: refused unread.
        said = {"content-length": str(200 + (64 << 10) + 1),
                "content-type": "multipart/form-data; boundary=b"}  # fmt: skip
        declared = http.post("/v1/files", content=b"x" * 100, headers=said)
    assert (large.value.body["param"], purpose.value.body["param"]) == ("file", "purpose")
    assert (no_purpose.status_code, no_purpose.json()["error"]["param"]) == (400, "purpose")
    assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "limit")
    assert (declared.status_code, declared.json()["error"]["param"]) == (400, "file")
    assert not list((root / "files").iterdir())


def test_cancel_ends_the_lines_in_flight_and_is_idempotent(root):
    processor = Echo(hold=True)
    client, http = sdk(processor, settings(root, concurrency=2))
    with http:
        file_id = upload(client, *[line(str(i), f"q{i}") for i in range(5)])
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h")  # fmt: skip
        wait(client, created.id, "in_progress")
        _until(lambda: len(processor.requests) == 2)
        assert client.batches.cancel(created.id).status == "cancelling"
        batch = wait(client, created.id, "cancelled")
        again = client.batches.cancel(created.id)
    assert again.status == "cancelled" and again.cancelled_at == batch.cancelled_at
    assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 0)
    assert batch.output_file_id is None and len(processor.requests) == 2


def test_a_batch_whose_file_is_deleted_before_it_runs_fails_naming_why(root):
    batch = settings(root)
    record = batch.store.add_file("in.jsonl", "batch", (line("a", "x") + "\n").encode())
    request = BatchRequest(record["id"], "/v1/chat/completions")
    created = open_batch(batch.store, request, batch.max_lines)
    batch.store.delete_file(record["id"])
    client, http = sdk(Echo(), batch)
    with http:
        failed = wait(client, created["id"], "failed")
    (error,) = failed.errors.data
    assert error.code == "invalid_input_file" and record["id"] in error.message
    assert failed.failed_at is not None and failed.output_file_id is None


def test_a_completed_batch_cannot_be_cancelled(root):
    client, http = sdk(Echo(), settings(root))
    with http:
        file_id = upload(client, line("a", "x"))
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h")  # fmt: skip
        wait(client, created.id, "completed")
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.cancel(created.id)
    assert "completed" in refused.value.body["message"]


def test_lines_not_answered_within_the_window_expire(root):
    clock = [1000.0]
    batch = settings(root, concurrency=1)
    object.__setattr__(batch.store, "_timer", lambda: clock[0])
    processor = Echo(hold=True)
    client, http = sdk(processor, batch)
    with http:
        file_id = upload(client, line("a", "x"), line("b", "y"))
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="1m")  # fmt: skip
        assert created.expires_at == 1060
        _until(lambda: processor.requests == ["x"])
        clock[0] = 1061.0
        ended = wait(client, created.id, "expired")
        errors = entries(client, ended.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("a", "batch_expired"), ("b", "batch_expired")]  # fmt: skip
    assert ended.expired_at == 1061 and ended.request_counts.failed == 2


def test_a_line_the_mesh_could_not_take_yet_is_tried_again(root):
    processor = Echo(failures=2)
    client, http = sdk(processor, settings(root, concurrency=1))
    with http:
        file_id = upload(client, line("a", "x"))
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h")  # fmt: skip
        batch = wait(client, created.id, "completed")
    assert batch.request_counts.completed == 1 and processor.requests == ["x"] * 3


def test_a_batch_whose_front_died_is_taken_up_where_it_stopped(root):
    """A batch whose front's claim lapsed, with two of its lines answered: another front
    answers the three others, each once."""
    batch = settings(root)
    first, first_http = sdk(Echo(), batch)
    with first_http:
        file_id = upload(first, *[line(str(i), f"q{i}") for i in range(5)])
    store = batch.store
    created = {"id": "batch_dead", "object": "batch", "endpoint": "/v1/chat/completions",
               "input_file_id": file_id, "status": "in_progress", "created_at": 1,
               "expires_at": time.time() + 3600, "request_counts": {"total": 5}}  # fmt: skip
    store.add_batch(created)
    # Its front's claim has lapsed.
    store._run("UPDATE batches SET owner = 'elsewhere:7', lease = ?", (time.time() - 1,))
    for number in (1, 3):
        answered = {"status_code": 200, "body": {}}
        store.answer(
            "batch_dead", number, True, {"custom_id": str(number - 1), "response": answered}
        )
    processor = Echo()
    client, http = sdk(processor, batch)
    with http:
        done = wait(client, "batch_dead", "completed")
        output = entries(client, done.output_file_id)
    assert sorted(processor.requests) == ["q1", "q3", "q4"]
    assert [entry["custom_id"] for entry in output] == ["0", "1", "2", "3", "4"]


def test_batch_lines_wait_while_an_interactive_request_is_in_flight(root):
    async def scenario() -> list[str]:
        app = create_app(Router(StaticRegistry({})), processor=Echo(), batch=settings(root))
        app.state.interactive = interactive = InFlightLimit(0)
        store = app.state.batches.store
        record = store.add_file("in.jsonl", "batch", (line("a", "x") + "\n").encode())
        store.add_batch({"id": "batch_b", "object": "batch", "status": "validating",
                         "endpoint": "/v1/chat/completions", "input_file_id": record["id"],
                         "created_at": 1, "expires_at": time.time() + 60,
                         "request_counts": {"total": 1}})  # fmt: skip
        runner = BatchRunner(app, app.state.batches, interactive)
        with interactive.admit():
            task = asyncio.create_task(runner.run_batch("batch_b"))
            await asyncio.sleep(0.3)
            held = app.state.processor.requests[:]
        await asyncio.wait_for(task, 5)
        return [*held, "|", *app.state.processor.requests]

    assert asyncio.run(scenario()) == ["|", "x"]


def test_few_batch_lines_run_while_interactive_requests_come_and_all_after_a_quiet_second(root):
    interactive = InFlightLimit(0)
    app = create_app(Router(StaticRegistry({})), processor=Echo(),
                     batch=settings(root, concurrency=8, concurrency_beside=2))  # fmt: skip
    runner = BatchRunner(app, app.state.batches, interactive)
    assert runner._concurrency() == 8
    with interactive.admit():
        assert runner._concurrency() == 0
    assert runner._concurrency() == 2
    interactive.admitted_at -= 1.0
    assert runner._concurrency() == 8


def _until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_claim_held_by_a_process_gone_from_this_host_is_no_claim():
    host = me().rpartition(":")[0]
    assert me() == f"{host}:{os.getpid()}" and alive(me()) and alive("elsewhere/1:1")
    # Above any pid the kernel hands out.
    assert not alive(f"{host}:{2**31 - 1}")
    # Another pid namespace under the same name: its processes are not seen from here.
    assert alive(f"{socket.gethostname()}/1:{2**31 - 1}")
