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
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile

from prism.gateway import bodies
from prism.gateway.batch.opening import open_batch
from prism.gateway.batch.runner import BatchRunner
from prism.gateway.batch.schemas import BatchRequest, BatchSettings
from prism.gateway.batch.store import ENDED
from prism.rpc.errors import PrismError, invalid

# Read from an upload at a time.
_CHUNK = 1 << 20
# What a multipart body holds beside its file: boundaries, headers, the purpose.
_FORM_BYTES = 64 << 10
# The upload's form, described (the endpoint reads it itself, so FastAPI sees no parameter).
_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}}  # fmt: skip


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


@router.post("/v1/files", openapi_extra=_UPLOAD)
async def upload(request: Request) -> JSONResponse:
    """A file, multipart as OpenAI's SDK sends it; refused before it is read where its
    length says it is over the limit, and as soon as it is read past the limit otherwise."""
    settings = _settings(request.app)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_file_bytes + _FORM_BYTES:
        raise _too_large(settings)
    form = await request.form(max_files=1, max_fields=2)
    file, purpose = form.get("file"), form.get("purpose")
    if not isinstance(purpose, str):
        raise invalid("'purpose' is required", "purpose")
    if purpose != "batch":
        raise invalid(f"purpose {purpose!r} is not served: only 'batch'", "purpose")
    if not isinstance(file, UploadFile):
        raise invalid("'file' is required (a multipart file)", "file")
    data = bytearray()
    while chunk := await file.read(_CHUNK):
        data += chunk
        if len(data) > settings.max_file_bytes:
            raise _too_large(settings)
    return JSONResponse(settings.store.add_file(file.filename or "upload.jsonl", purpose,
                                                bytes(data)))  # fmt: skip


def _too_large(settings: BatchSettings) -> PrismError:
    return invalid(f"the file is larger than the limit of {settings.max_file_bytes} bytes", "file")


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
