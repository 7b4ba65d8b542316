"""Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}`
returns, bounded in count, bytes and age. In SQLite (the standard library's): in this process's
memory, or in a file that the fronts of one `prism serve --front-workers N` share (the
kernel hands a follow-up to any of them)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from prism.config.gateway import (
    RESPONSES_MAX_ENTRIES,
    RESPONSES_MAX_MB,
    RESPONSES_TTL_S,
    GatewayConfig,
)
from prism.rpc.errors import PrismError

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, at REAL NOT NULL, "
    "response TEXT NOT NULL, messages TEXT NOT NULL, size INTEGER NOT NULL)"
)


@dataclass(frozen=True)
class Stored:
    """A response as sent, and the chat messages of its turn (instructions left out: they
    do not carry over to the next turn, as in OpenAI's API and vLLM's server)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """At most `max_entries` (the oldest go first; 0: none kept) of `max_bytes` together
    (a turn's messages keep their images' data URLs; a response larger than all is not
    kept), each for `ttl_s`."""

    def __init__(
        self,
        max_entries: int = RESPONSES_MAX_ENTRIES,
        ttl_s: float = RESPONSES_TTL_S,
        path: str = "",
        timer: Callable[[], float] = time.time,
        max_bytes: int = int(RESPONSES_MAX_MB * 2**20),
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._timer = timer
        # One connection, used under a lock: the calls are short, and the app's threads
        # and its loop may both come here.
        self._lock = threading.Lock()
        if path:
            # Conversations: readable by this user only (SQLite gives its journal the
            # file's mode).
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        self._db = sqlite3.connect(
            path or ":memory:", timeout=10, isolation_level=None, check_same_thread=False
        )
        if path:
            # Readers and a writer at once, across the processes that share the file.
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)

    @classmethod
    def of(cls, config: GatewayConfig) -> ResponseStore:
        return cls(config.responses_store_size, config.responses_ttl_s, config.responses_store,
                   max_bytes=int(config.responses_store_mb * 2**20))  # fmt: skip

    def put(self, stored: Stored) -> None:
        response, messages = json.dumps(stored.response), json.dumps(stored.messages)
        size = len(response) + len(messages)
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        now = self._timer()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                (stored.response["id"], now, response, messages, size),
            )
            self._db.execute("DELETE FROM responses WHERE at < ?", (now - self.ttl_s,))
            self._db.execute(
                "DELETE FROM responses WHERE id NOT IN "
                "(SELECT id FROM responses ORDER BY rowid DESC LIMIT ?)",
                (self.max_entries,),
            )
            # The newest first, as many as fit in the bytes.
            self._db.execute(
                "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
                "SUM(size) OVER (ORDER BY rowid DESC) AS kept FROM responses) WHERE kept > ?)",
                (self.max_bytes,),
            )

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        with self._lock:
            row = self._db.execute(
                "SELECT response, messages FROM responses WHERE id = ? AND at >= ?",
                (response_id, self._timer() - self.ttl_s),
            ).fetchone()
        if row is None:
            raise _unknown(response_id, param)
        return Stored(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> None:
        with self._lock:
            gone = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        if gone.rowcount == 0:
            raise _unknown(response_id, "response_id")


def _unknown(response_id: str, param: str) -> PrismError:
    # Unknown and expired alike: the store keeps no trace of what it let go.
    return PrismError(
        grpc.StatusCode.NOT_FOUND, f"Response with id '{response_id}' not found.", param=param
    )
