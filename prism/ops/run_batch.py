"""`prism run-batch -i IN -o OUT`: a batch file answered offline, as `vllm run-batch` does,
by the mesh `prism serve` starts with the same flags. The file is checked first (a file that
cannot run starts nothing), kept in a store of the run's own that the mesh's front runs it
from (prism.gateway.batch), and every line's answer is written to OUT in the input's order,
the failures too."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from prism.config.commands import RunBatchConfig
from prism.gateway import bodies
from prism.gateway.batch.opening import open_batch
from prism.gateway.batch.schemas import BatchRequest
from prism.gateway.batch.store import ENDED, BatchStore
from prism.ops.launcher import Mesh
from prism.ops.plan import check_model, plan
from prism.rpc.errors import PrismError
from prism.runtime.ports import free_port

# How often the store is read for the batch's progress.
LOOK_S = 0.5


def _say(line: str) -> None:
    print(f"prism run-batch: {line}", file=sys.stderr, flush=True)


def _endpoint(data: bytes) -> str:
    """The endpoint the file's first request names (a batch's lines all name one)."""
    for text in data.splitlines():
        try:
            request = json.loads(text)
        except ValueError:
            continue
        if isinstance(request, dict) and isinstance(request.get("url"), str):
            return request["url"]
    return "/v1/chat/completions"


def run(config: RunBatchConfig) -> int:
    try:
        data = Path(config.files.input_file).read_bytes()
        check_model(config.model.model)
    except (OSError, ValueError) as exc:
        _say(str(exc))
        return 2
    with tempfile.TemporaryDirectory(prefix="prism-run-batch-") as directory:
        store = BatchStore(directory)
        file_id = store.add_file(Path(config.files.input_file).name, "batch", data)["id"]
        try:
            asked = bodies.typed({"input_file_id": file_id, "endpoint": _endpoint(data)},
                                 BatchRequest)  # fmt: skip
            batch = open_batch(store, asked, config.gateway.batch_max_lines)
        except PrismError as exc:
            _say(f"{config.files.input_file}: {exc.message}")
            return 2
        config.gateway.batch_store = directory
        # Ports of its own: the run answers nobody else.
        config.http.http_port, config.serve.grpc_port = free_port(), 0
        ended = _answer(config, store, batch["id"])
        entries = list(store.answers(batch["id"]))
    Path(config.files.output_file).write_text("".join(f"{entry}\n" for entry in entries))
    counts = ended["request_counts"]
    _say(f"{ended['status']}: {counts['completed']} answered, {counts['failed']} failed; "
         f"written to {config.files.output_file}")  # fmt: skip
    return 0 if ended["status"] == "completed" else 1


def _answer(config: RunBatchConfig, store: BatchStore, batch_id: str) -> dict:
    """The batch once the mesh has run it."""
    mesh = Mesh.forking(plan(config))
    try:
        mesh.start(config.serve.start_timeout, report=_say)
        shown = -1
        while (batch := store.batch(batch_id))["status"] not in ENDED:
            counts = batch["request_counts"]
            done = counts["completed"] + counts["failed"]
            if done != shown:
                _say(f"{done}/{counts['total']} requests answered")
                shown = done
            time.sleep(LOOK_S)
        return batch
    finally:
        mesh.stop()
