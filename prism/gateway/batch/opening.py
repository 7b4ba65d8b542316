"""A batch opened on an uploaded file: its input checked whole (a file that cannot run is
refused now, not failed later), and its record kept, for a runner to take up."""

from __future__ import annotations

from typing import Any

from prism.gateway.batch import lines
from prism.gateway.batch.schemas import BatchRequest, window_s
from prism.gateway.batch.store import BatchStore, new_id
from prism.rpc.errors import invalid


def open_batch(store: BatchStore, request: BatchRequest, max_lines: int) -> dict[str, Any]:
    if store.file(request.input_file_id)["purpose"] != "batch":
        raise invalid("the input file's purpose is not 'batch'", "input_file_id")
    data = store.content_path(request.input_file_id).read_bytes()
    total = len(lines.read(data, request.endpoint, max_lines))
    now = int(store.now())
    batch = {"id": new_id("batch_"), "object": "batch", "endpoint": request.endpoint,
             "errors": None, "input_file_id": request.input_file_id,
             "completion_window": request.completion_window, "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now,
             "in_progress_at": None, "expires_at": now + window_s(request.completion_window),
             "finalizing_at": None, "completed_at": None, "failed_at": None,
             "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": total, "completed": 0, "failed": 0},
             "metadata": request.metadata, "usage": None}  # fmt: skip
    store.add_batch(batch)
    return store.batch(batch["id"])
