"""Runs the batches of a store, one at a time per front, beneath the interactive traffic at
this front's doors: a line starts only while no interactive generation is in flight, at most
`concurrency_beside` lines are in flight while interactive requests come (one came within a
second), and `concurrency` after a quiet second. So the batch takes the capacity interactive
requests leave idle, an interactive request waits behind no queue of batch lines, and few
batch lines share the engines with it (bench/batch.py measures what each costs)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from prism import telemetry
from prism.gateway.batch import lines
from prism.gateway.batch.schemas import BatchSettings
from prism.gateway.batch.store import LEASE_S, RUNNABLE, BatchStore
from prism.rpc.errors import PrismError
from prism.rpc.server import InFlightLimit

log = logging.getLogger(__name__)

# Statuses a line is tried again after, later: the mesh is busy or not there yet (a front
# just started), not wrong about the request.
TRANSIENT = (429, 503)
RETRY_S = (0.5, 1.0, 2.0, 5.0)
# How often a runner looks for batches to take up, and a batch's runner for a cancel from
# any front.
LOOK_S = 0.5
# Interactive requests "come" while one came within this long.
QUIET_S = 1.0
# How often a runner waiting for a slot looks again.
SLOT_S = 0.02


def _host() -> str:
    """This host as its processes see one another: its name, and the pid namespace (fronts
    in containers that share a name do not see each other's processes)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def me() -> str:
    return f"{_host()}:{os.getpid()}"


def alive(owner: str) -> bool:
    """Whether the front `owner` (`me()` of some front) may still run its batch: on another
    host, it may (its claim lapses if not); here, while its process lives."""
    host, _, pid = owner.rpartition(":")
    if host != _host():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


@dataclass
class Batch:
    """A batch being run: its record as last looked at (`looked`), its lines in flight,
    and when its claim was last renewed."""

    record: dict[str, Any]
    running: dict[asyncio.Task, lines.Line] = field(default_factory=dict)
    looked: float = 0.0
    renewed: float = 0.0


class BatchRunner:
    def __init__(
        self, app: Any, settings: BatchSettings, interactive: InFlightLimit, owner: str = ""
    ) -> None:
        self.app = app
        self.store = settings.store
        self.settings = settings
        self.interactive = interactive
        self.owner = owner or me()
        self.endpoints = lines.endpoints(app.routes)
        # Set when a batch is created here: taken up at once rather than at the next look.
        self.wake = asyncio.Event()
        self._free = asyncio.Event()

    async def run(self) -> None:
        """Takes up batches until cancelled."""
        while True:
            batch_id = self.store.claim(self.owner, alive)
            if batch_id is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), LOOK_S)
                self.wake.clear()
                continue
            try:
                await self.run_batch(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch %s stopped; it is taken up again", batch_id)
                await asyncio.sleep(LOOK_S)
            finally:
                self.store.release(batch_id, self.owner)

    async def run_batch(self, batch_id: str) -> None:
        record = self.store.update(batch_id, ("validating",), status="in_progress",
                                   in_progress_at=int(self.store.now()))  # fmt: skip
        try:
            data = self.store.content_path(record["input_file_id"]).read_bytes()
            requests = lines.read(data, record["endpoint"], self.settings.max_lines)
        except PrismError as exc:
            # Its file deleted, or over a limit lowered since: it cannot run.
            error = {"code": "invalid_input_file", "message": exc.message, "param": exc.param,
                     "line": None}  # fmt: skip
            self.store.update(batch_id, RUNNABLE, status="failed", failed_at=int(self.store.now()),
                              errors={"object": "list", "data": [error]})  # fmt: skip
            return
        answered = self.store.answered(batch_id)
        todo = [line for line in requests if line.number not in answered]
        batch = Batch(record)
        ending = ""
        try:
            for line in todo:
                ending = await self._slot(batch)
                if ending:
                    break
                if line.problem:
                    self._keep(batch_id, line, False, lines.failure(line, "invalid_line",
                                                                   line.problem))  # fmt: skip
                    continue
                task = asyncio.create_task(self._line(batch, line))
                batch.running[task] = line
                task.add_done_callback(functools.partial(self._done, batch))
            while batch.running and not ending:
                ending = await self._slot(batch, all_done=True)
        finally:
            for task in batch.running:
                task.cancel()
            await asyncio.gather(*batch.running, return_exceptions=True)
        await self._finish(batch, ending or "completed", todo)

    def _done(self, batch: Batch, task: asyncio.Task) -> None:
        batch.running.pop(task, None)
        self._free.set()

    async def _slot(self, batch: Batch, all_done: bool = False) -> str:
        """Waits until a line may start (or, with `all_done`, until the lines in flight
        end); "" then, or why the batch ends first: cancelled, expired."""
        while True:
            ending = self._ending(batch)
            if ending:
                return ending
            if all_done and not batch.running:
                return ""
            if not all_done and len(batch.running) < self._concurrency():
                return ""
            self._free.clear()
            # A slot may open as interactive requests end, which nothing signals: looked at
            # often.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._free.wait(), LOOK_S if all_done else SLOT_S)

    def _concurrency(self) -> int:
        """Lines that may be in flight now: none while an interactive request is; few while
        they come; all the settings allow after a quiet second."""
        if self.interactive.count:
            return 0
        if time.monotonic() - self.interactive.admitted_at < QUIET_S:
            return self.settings.concurrency_beside
        return self.settings.concurrency

    def _ending(self, batch: Batch) -> str:
        now = self.store.now()
        if now - batch.looked >= LOOK_S:
            # Another front may have cancelled it.
            batch.record, batch.looked = self.store.batch(batch.record["id"]), now
        if now - batch.renewed >= LEASE_S / 3:
            self.store.renew(batch.record["id"], self.owner)
            batch.renewed = now
        if batch.record["status"] == "cancelling":
            return "cancelled"
        if now >= batch.record["expires_at"]:
            return "expired"
        return ""

    async def _line(self, batch: Batch, line: lines.Line) -> None:
        endpoint = batch.record["endpoint"]
        with telemetry.BATCH_IN_FLIGHT.track_inprogress():
            for delay in (*RETRY_S, None):
                status, entry = await lines.answer(self.app, self.endpoints[endpoint], endpoint,
                                                   line)  # fmt: skip
                if status not in TRANSIENT or delay is None:
                    break
                await asyncio.sleep(delay)
        self._keep(batch.record["id"], line, 200 <= status < 300, entry)

    def _keep(self, batch_id: str, line: lines.Line, ok: bool, entry: dict[str, Any]) -> None:
        self.store.answer(batch_id, line.number, ok, entry)
        telemetry.BATCH_REQUESTS.labels("completed" if ok else "failed").inc()

    async def _finish(self, batch: Batch, status: str, todo: list[lines.Line]) -> None:
        """Writes the output and error files and ends the batch as `status`."""
        batch_id, now = batch.record["id"], int(self.store.now())
        if status == "expired":
            answered = self.store.answered(batch_id)
            message = "This request could not be executed before the completion window expired."
            for line in todo:
                if line.number not in answered:
                    self._keep(batch_id, line, False, lines.failure(line, "batch_expired", message))
        if status == "completed":
            self.store.update(batch_id, ("in_progress",), status="finalizing", finalizing_at=now)
        files = {}
        for ok, name in ((True, "output"), (False, "error")):
            answers = "\n".join(self.store.answers(batch_id, ok))
            if answers:
                written = self.store.add_file(f"{batch_id}_{name}.jsonl", "batch_output",
                                              answers.encode() + b"\n")  # fmt: skip
                files[f"{name}_file_id"] = written["id"]
        ended = self.store.update(batch_id, ("in_progress", "finalizing", "cancelling"),
                                  status=status, **{f"{status}_at": now}, **files,
                                  usage=_usage(self.store, batch_id))  # fmt: skip
        log.info("batch %s %s: %s", batch_id, ended["status"], ended["request_counts"])


def _usage(store: BatchStore, batch_id: str) -> dict[str, Any]:
    """The tokens of the batch's answered lines, together."""
    totals = {"input_tokens": 0, "output_tokens": 0, "cached_tokens": 0, "reasoning_tokens": 0}
    for text in store.answers(batch_id, True):
        usage = json.loads(text)["response"]["body"].get("usage") or {}
        totals["input_tokens"] += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        totals["output_tokens"] += usage.get("completion_tokens", usage.get("output_tokens", 0))
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        totals["cached_tokens"] += details.get("cached_tokens") or 0
        reasoning = usage.get("output_tokens_details") or {}
        totals["reasoning_tokens"] += reasoning.get("reasoning_tokens") or 0
    return {
        "input_tokens": totals["input_tokens"],
        "input_tokens_details": {"cached_tokens": totals["cached_tokens"]},
        "output_tokens": totals["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": totals["reasoning_tokens"]},
        "total_tokens": totals["input_tokens"] + totals["output_tokens"],
    }
