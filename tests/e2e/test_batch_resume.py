"""`prism serve` with a batch running: its front SIGKILLed mid-batch is started again, takes
the batch up from its store where it stopped, and completes it with every `custom_id`
answered once, each as offline vLLM answers it."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import openai
import psutil
from support.batches import CHATS, batch_line, entries
from support.served import Served
from support.waiting import wait_for

LINES = 96


def _retrieve(client: openai.OpenAI, batch_id: str):
    """The batch, or None while the front is down."""
    try:
        return client.batches.retrieve(batch_id)
    except (openai.APIConnectionError, openai.InternalServerError):
        return None


def _answered(store: Path, batch_id: str) -> int:
    with sqlite3.connect(store / "batches.db") as db:
        return db.execute("SELECT COUNT(*) FROM answers WHERE batch = ?", (batch_id,)).fetchone()[0]


def test_a_front_killed_mid_batch_is_restarted_and_completes_each_line_once(
    models, oracle, tmp_path
):
    expected = oracle("llava")
    served = Served(["--mode", "epd", "--model", str(models["llava"]),
                     "--batch-store", str(tmp_path / "batches"), "--batch-concurrency", "1"],
                    tmp_path)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)
        asked = {f"line-{i}": CHATS[i % len(CHATS)] for i in range(LINES)}
        data = "\n".join(batch_line(served.model, c, name) for c, name in asked.items()).encode()
        file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        # Mid-batch: some lines answered, most not.
        assert wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 8,
                        timeout=120), served.tail()  # fmt: skip
        front = served.pid("front")
        assert front is not None
        killed = psutil.Process(front)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        # Its answers so far, as its store kept them (the front is gone).
        at_kill = _answered(tmp_path / "batches", batch.id)
        assert wait_for(lambda: "front exited (SIGKILL); restarting" in served.tail(200),
                        timeout=10), served.tail()  # fmt: skip
        deadline = time.monotonic() + 300
        while (done := _retrieve(client, batch.id)) is None or done.status != "completed":
            assert time.monotonic() < deadline, (done, served.tail())
            time.sleep(0.5)
        output = entries(client.files.content(done.output_file_id).text)
    finally:
        assert served.stop() == 0, served.tail()
    assert 8 <= at_kill < LINES, at_kill
    assert done.request_counts.completed == LINES and done.request_counts.failed == 0
    assert sorted(entry["custom_id"] for entry in output) == sorted(asked)
    wrong = {entry["custom_id"] for entry in output
             if entry["response"]["body"]["choices"][0]["message"]["content"]
             != expected[asked[entry["custom_id"]]]["text"]}  # fmt: skip
    assert not wrong
