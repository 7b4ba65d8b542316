"""What the Batch API keeps: uploaded files in a directory, and in a SQLite file beside them
the files' records, the batches, and each line's answer once it has one. On disk, so that a
front killed mid-batch and started again (or another front sharing the directory: `prism
serve --front-workers N`) goes on where it stopped: a line answered is never answered again,
a line not answered is."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from prism.rpc.errors import PrismError

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, filename TEXT NOT NULL, "
    "purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, "
    "batch TEXT NOT NULL, status TEXT NOT NULL, owner TEXT NOT NULL DEFAULT '', "
    "lease REAL NOT NULL DEFAULT 0)",
    "CREATE TABLE IF NOT EXISTS answers (batch TEXT NOT NULL, line INTEGER NOT NULL, "
    "ok INTEGER NOT NULL, answer TEXT NOT NULL, PRIMARY KEY (batch, line))",
)
# A batch's runner is one front at a time; a front that stops renewing its claim for this
# long (killed, say) leaves the batch to another.
LEASE_S = 30.0
# Batches a runner may take up: not yet ended.
RUNNABLE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def not_found(what: str, given: str, param: str) -> PrismError:
    return PrismError(grpc.StatusCode.NOT_FOUND, f"No such {what}: '{given}'", param=param)


class BatchStore:
    """Files and batches under `root` (created, readable by this user only, when first
    written to; a front that never sees a batch writes nothing)."""

    def __init__(self, root: str | Path, timer: Callable[[], float] = time.time) -> None:
        self.root = Path(root).expanduser()
        self._timer = timer
        # One connection, used under a lock: its calls are short, and the app's threads and
        # its loop may both come here.
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def _connection(self, create: bool) -> sqlite3.Connection | None:
        if self._db is None:
            path = self.root / "batches.db"
            if not create and not path.exists():
                return None
            (self.root / "files").mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            # Readers and a writer at once, across the fronts that share the directory; a
            # commit (a line's answer) is not flushed to the disk each time, in the event
            # loop: a process killed loses none (the WAL is in the OS's hands), only the
            # host's crash may lose the last ones, which are answered again.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            for statement in SCHEMA:
                db.execute(statement)
            self._db = db
        return self._db

    def _run(self, sql: str, args: tuple = (), create: bool = True) -> sqlite3.Cursor | None:
        with self._lock:
            db = self._connection(create)
            return None if db is None else db.execute(sql, args)

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        cursor = self._run(sql, args, create=False)
        return [] if cursor is None else cursor.fetchall()

    def now(self) -> float:
        return self._timer()

    # Files.

    def add_file(self, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        file_id = new_id("file-")
        path = self.root / "files" / file_id
        self._connection_ready()
        with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as out:
            out.write(data)
        self._run("INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                  (file_id, filename, purpose, len(data), int(self.now())))  # fmt: skip
        return self.file(file_id)

    def _connection_ready(self) -> None:
        with self._lock:
            self._connection(create=True)

    def file(self, file_id: str) -> dict[str, Any]:
        rows = self._rows("SELECT * FROM files WHERE id = ?", (file_id,))
        if not rows:
            raise not_found("file", file_id, "file_id")
        return _file(rows[0])

    def files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        if purpose is None:
            return [_file(row) for row in self._rows("SELECT * FROM files ORDER BY rowid DESC")]
        rows = self._rows("SELECT * FROM files WHERE purpose = ? ORDER BY rowid DESC", (purpose,))
        return [_file(row) for row in rows]

    def content_path(self, file_id: str) -> Path:
        self.file(file_id)
        return self.root / "files" / file_id

    def delete_file(self, file_id: str) -> None:
        self.file(file_id)
        self._run("DELETE FROM files WHERE id = ?", (file_id,))
        (self.root / "files" / file_id).unlink(missing_ok=True)

    # Batches.

    def add_batch(self, batch: dict[str, Any]) -> None:
        row = (batch["id"], batch["created_at"], json.dumps(batch), batch["status"])
        self._run("INSERT INTO batches (id, created_at, batch, status) VALUES (?, ?, ?, ?)", row)

    def batch(self, batch_id: str) -> dict[str, Any]:
        rows = self._rows("SELECT batch FROM batches WHERE id = ?", (batch_id,))
        if not rows:
            raise not_found("batch", batch_id, "batch_id")
        return self._counted(json.loads(rows[0][0]))

    def batches(self, limit: int, after: str | None) -> list[dict[str, Any]]:
        """The newest first; after `after`, those older than it."""
        if after:
            self.batch(after)
            rows = self._rows("SELECT batch FROM batches WHERE rowid < (SELECT rowid FROM "
                              "batches WHERE id = ?) ORDER BY rowid DESC LIMIT ?",
                              (after, limit))  # fmt: skip
        else:
            rows = self._rows("SELECT batch FROM batches ORDER BY rowid DESC LIMIT ?", (limit,))
        return [self._counted(json.loads(row[0])) for row in rows]

    def _counted(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with its lines' counts as they stand."""
        done = dict(self._rows("SELECT ok, COUNT(*) FROM answers WHERE batch = ? GROUP BY ok",
                               (batch["id"],)))  # fmt: skip
        counts = batch["request_counts"]
        counts["completed"], counts["failed"] = done.get(1, 0), done.get(0, 0)
        return batch

    def update(self, batch_id: str, when: tuple[str, ...] = (), **fields: Any) -> dict[str, Any]:
        """Sets `fields` of the batch, if its status is one of `when` (any, if none); the
        batch as it is after."""
        with self._lock:
            db = self._connection(create=True)
            assert db is not None
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT batch FROM batches WHERE id = ?", (batch_id,)).fetchone()
                if row is None:
                    raise not_found("batch", batch_id, "batch_id")
                batch = json.loads(row[0])
                if not when or batch["status"] in when:
                    batch.update(fields)
                    db.execute("UPDATE batches SET batch = ?, status = ? WHERE id = ?",
                               (json.dumps(batch), batch["status"], batch_id))  # fmt: skip
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return self._counted(batch)

    def claim(self, owner: str, alive: Callable[[str], bool]) -> str | None:
        """Claims a batch for `owner` to run: one not ended whose claim is nobody's, has
        lapsed, or is held by an owner not `alive`; its id, or None."""
        now = self.now()
        for batch_id, held_by, lease in self._rows(
            f"SELECT id, owner, lease FROM batches WHERE status IN {RUNNABLE} ORDER BY rowid"
        ):
            if held_by and held_by != owner and lease > now and alive(held_by):
                continue
            cursor = self._run(
                "UPDATE batches SET owner = ?, lease = ? WHERE id = ? AND owner = ? AND lease = ?",
                (owner, now + LEASE_S, batch_id, held_by, lease),
            )
            if cursor is not None and cursor.rowcount == 1:
                return batch_id
        return None

    def renew(self, batch_id: str, owner: str) -> None:
        self._run("UPDATE batches SET lease = ? WHERE id = ? AND owner = ?",
                  (self.now() + LEASE_S, batch_id, owner))  # fmt: skip

    def release(self, batch_id: str, owner: str) -> None:
        self._run("UPDATE batches SET owner = '', lease = 0 WHERE id = ? AND owner = ?",
                  (batch_id, owner))  # fmt: skip

    # Answers.

    def answered(self, batch_id: str) -> set[int]:
        return {row[0] for row in self._rows("SELECT line FROM answers WHERE batch = ?",
                                             (batch_id,))}  # fmt: skip

    def answer(self, batch_id: str, line: int, ok: bool, answer: dict[str, Any]) -> None:
        """Keeps a line's answer; a line answered already keeps its first."""
        self._run("INSERT OR IGNORE INTO answers VALUES (?, ?, ?, ?)",
                  (batch_id, line, int(ok), json.dumps(answer, separators=(",", ":"))))  # fmt: skip

    def answers(self, batch_id: str, ok: bool | None = None) -> Iterator[str]:
        """The lines' answers, `ok` or failed (or all), in the input file's order, as JSON
        text."""
        if ok is None:
            rows = self._rows("SELECT answer FROM answers WHERE batch = ? ORDER BY line",
                              (batch_id,))  # fmt: skip
        else:
            rows = self._rows("SELECT answer FROM answers WHERE batch = ? AND ok = ? "
                              "ORDER BY line", (batch_id, int(ok)))  # fmt: skip
        return (row[0] for row in rows)


def _file(row: tuple) -> dict[str, Any]:
    file_id, filename, purpose, size, created_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None}  # fmt: skip
