"""Logging: every line of a request carries its request id; text or JSON lines.

The id comes in as `x-request-id` (HTTP header at the gateway, gRPC metadata between
stages) and lives in a context variable for as long as the request's task runs.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")
HEADER = "x-request-id"
# A request id a client may choose: printable ASCII, no spaces, at most 128 characters.
CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")
FORMATS = ("text", "json")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", ""),
            "pid": record.process,
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
