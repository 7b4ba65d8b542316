"""OpenAI's Files and Batch APIs: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET
/v1/files/{id}/content; POST/GET /v1/batches, GET /v1/batches/{id}, POST
/v1/batches/{id}/cancel. The batches run in this front (prism.gateway.batch.runner) while
it serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

import grpc
from fastapi import APIRouter, FastAPI, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse

from prism.gateway import bodies
from prism.gateway.batch.opening import open_batch
from prism.gateway.batch.runner import BatchRunner
from prism.gateway.batch.schemas import BatchRequest, BatchSettings
from prism.gateway.batch.store import ENDED
from prism.rpc.errors import PrismError, invalid

# Read from an upload at a time, so that one over the limit is refused without being held.
_CHUNK = 1 << 20


@contextlib.asynccontextmanager
async def _running(app: FastAPI) -> AsyncIterator[None]:
    """Runs the store's batches while the app serves."""
    settings = _settings(app)
    runner = BatchRunner(app, settings, app.state.interactive)
    app.state.batch_runner = runner
    task = asyncio.create_task(runner.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


router = APIRouter(lifespan=_running)


def _settings(app: Any) -> BatchSettings:
    return app.state.batches


@router.post("/v1/files")
async def upload(request: Request, file: UploadFile, purpose: str = Form()) -> JSONResponse:
    settings = _settings(request.app)
    if purpose != "batch":
        raise invalid(f"purpose {purpose!r} is not served: only 'batch'", "purpose")
    data = bytearray()
    while chunk := await file.read(_CHUNK):
        data += chunk
        if len(data) > settings.max_file_bytes:
            raise invalid(f"the file is larger than the limit of {settings.max_file_bytes} "
                          "bytes", "file")  # fmt: skip
    return JSONResponse(settings.store.add_file(file.filename or "upload.jsonl", purpose,
                                                bytes(data)))  # fmt: skip


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None) -> JSONResponse:
    files = _settings(request.app).store.files(purpose)
    return JSONResponse({"object": "list", "data": files, "has_more": False})


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> JSONResponse:
    return JSONResponse(_settings(request.app).store.file(file_id))


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> JSONResponse:
    _settings(request.app).store.delete_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> FileResponse:
    path = _settings(request.app).store.content_path(file_id)
    return FileResponse(path, media_type="application/jsonl")


@router.post("/v1/batches", openapi_extra=bodies.openapi(BatchRequest))
async def create(request: Request) -> JSONResponse:
    body = bodies.decode(await request.body(), BatchRequest)
    settings = _settings(request.app)
    batch = open_batch(settings.store, body, settings.max_lines)
    request.app.state.batch_runner.wake.set()
    return JSONResponse(batch)


@router.get("/v1/batches")
async def list_batches(
    request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> JSONResponse:
    # One more than asked: whether there are more.
    batches = _settings(request.app).store.batches(limit + 1, after)
    page = batches[:limit]
    return JSONResponse({
        "object": "list", "data": page, "has_more": len(batches) > limit,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    })  # fmt: skip


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> JSONResponse:
    return JSONResponse(_settings(request.app).store.batch(batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel(request: Request, batch_id: str) -> JSONResponse:
    """Cancels a batch not ended; one cancelled, or being cancelled, is answered as it is."""
    store = _settings(request.app).store
    batch = store.update(batch_id, ("validating", "in_progress"), status="cancelling",
                         cancelling_at=int(store.now()))  # fmt: skip
    if batch["status"] in ENDED and batch["status"] != "cancelled":
        raise PrismError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"the batch is {batch['status']}: it cannot be cancelled",
                         param="batch_id")  # fmt: skip
    request.app.state.batch_runner.wake.set()
    return JSONResponse(batch)
