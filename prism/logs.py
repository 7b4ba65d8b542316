"""Logging: every line of a request carries its request id; text or JSON lines.

The id comes in as `x-request-id` (HTTP header at the gateway, gRPC metadata between
stages) and lives in a context variable for as long as the request's task runs. A JSON
line also names the stage's role, and inside a traced request its trace id; vLLM's own
lines, which its loggers write apart, are made JSON lines of the same form.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.config
import os
import re
import sys
import tempfile
import time
from contextvars import ContextVar
from pathlib import Path

from opentelemetry import trace

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
    """One JSON object per line: time, level, logger, message, request_id, the process's
    role and, inside a traced request, its trace id (and exc)."""

    def __init__(self, role: str = "") -> None:
        super().__init__()
        self.role = role

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
        if self.role:
            line["role"] = self.role
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = format(span.trace_id, "032x")
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text", role: str = "") -> None:
    """The process's logging at `level`, as `fmt` lines (naming `role`, in JSON); Python's
    warnings go there too."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
        _vllm_as_json(role)
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)


def _vllm_as_json(role: str) -> None:
    """vLLM's lines as JSON too: vLLM configures its loggers from VLLM_LOGGING_CONFIG_PATH
    as it is imported, in this process and in those it starts (its engine core); in a
    process that has imported it already (a stage forked from the template), now."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter", "role": role}},
        "filters": {"request_id": {"()": f"{__name__}._RequestIdFilter"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "json",
                              "filters": ["request_id"], "level": level,
                              "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }  # fmt: skip
    text = json.dumps(config, sort_keys=True)
    # One file per setting, never removed: the engine core reads it after this process
    # may have gone.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"prism-vllm-logging-{digest}.json"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_text(text)
        partial.replace(path)
    # A user's own file wins; one of Prism's (a launcher's, whose role differs) does not.
    given = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")
    if not given or Path(given).name.startswith("prism-vllm-logging-"):
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    if "vllm.logger" in sys.modules:
        logging.config.dictConfig(config)
