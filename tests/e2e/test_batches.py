"""End to end through real processes: the official openai SDK's files and batches against
every mode. A 200-line batch of chats, with images and without, answers each line as the
same request sent alone (greedy: as one offline vLLM engine answers it,
tests/support/oracle.py), each `custom_id` once; a completions batch too. (A front killed
mid-batch: test_batch_resume.py.)"""

from __future__ import annotations

import time

import openai
from support.batches import CHATS, COMPLETIONS, batch_line, entries
from support.cases import CONCURRENT_CASES, openai_client

LINES = 200


def run_batch(client: openai.OpenAI, lines: list[str], endpoint: str, timeout: float = 300):
    data = ("\n".join(lines) + "\n").encode()
    file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                  completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + timeout
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def answers(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return entries(client.files.content(file_id).text)


def test_a_multimodal_batch_answers_every_line_as_its_request_alone(mesh, oracle):
    expected = oracle(mesh.family)
    asked = {f"line-{i}": CHATS[i % len(CHATS)] for i in range(LINES)}
    client = openai_client(mesh)
    lines = [batch_line(mesh.model, custom_id, name) for custom_id, name in asked.items()]
    batch = run_batch(client, lines, "/v1/chat/completions")
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (LINES, LINES)
    assert batch.error_file_id is None
    output = answers(client, batch.output_file_id)
    assert sorted(entry["custom_id"] for entry in output) == sorted(asked)
    wrong = {}
    for entry in output:
        body, name = entry["response"]["body"], asked[entry["custom_id"]]
        got = (body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"],
               body["usage"]["prompt_tokens"])  # fmt: skip
        want = expected[name]
        if got != (want["text"], len(want["token_ids"]), want["prompt_tokens"]):
            wrong[entry["custom_id"]] = (got, want["text"])
    assert not wrong, wrong
    # The whole answer as the request sent alone gets it, the image's too.
    _, messages, max_tokens = CONCURRENT_CASES[asked["line-1"]]
    alone = client.chat.completions.create(model=mesh.model, messages=messages,
                                           max_tokens=max_tokens, temperature=0)  # fmt: skip
    (line_1,) = (entry for entry in output if entry["custom_id"] == "line-1")
    assert line_1["response"]["body"]["choices"] == [c.model_dump(exclude_unset=True)
                                                      for c in alone.choices]  # fmt: skip
    assert batch.usage.output_tokens == sum(len(expected[n]["token_ids"]) for n in asked.values())


def test_a_completions_batch_answers_as_offline_vllm(mesh, oracle):
    expected = oracle(mesh.family)
    client = openai_client(mesh)
    lines = [batch_line(mesh.model, name, name) for name in COMPLETIONS]
    batch = run_batch(client, lines, "/v1/completions")
    output = answers(client, batch.output_file_id)
    got = {entry["custom_id"]: entry["response"]["body"]["choices"][0]["text"] for entry in output}
    assert got == {name: expected[name]["text"] for name in COMPLETIONS}
