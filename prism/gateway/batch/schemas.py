"""The Batch API's request body, typed (prism.gateway.bodies), and its settings."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from prism.gateway.batch.store import BatchStore
from prism.gateway.bodies import Body

if TYPE_CHECKING:
    from prism.config.gateway import GatewayConfig

# ECMA-262 as JSON Schema's patterns are: no named groups.
_WINDOW = re.compile(r"^([1-9][0-9]*)([mh])$")


class BatchRequest(Body):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    # OpenAI's API takes "24h" alone; here any count of hours or minutes ("1h", "90m").
    completion_window: Annotated[str, msgspec.Meta(pattern=_WINDOW.pattern)] = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None


BODIES: dict[str, type[msgspec.Struct]] = {"/v1/batches": BatchRequest}


def window_s(window: str) -> int:
    """The seconds of a `completion_window` the body's pattern let through."""
    match = _WINDOW.match(window)
    assert match is not None
    count, unit = match.groups()
    return int(count) * (3600 if unit == "h" else 60)


@dataclass(frozen=True)
class BatchSettings:
    """Where a front keeps its batches, and what it takes."""

    store: BatchStore
    max_file_bytes: int
    max_lines: int
    concurrency: int
    concurrency_beside: int = 2

    @classmethod
    def of(cls, config: GatewayConfig) -> BatchSettings:
        return cls(BatchStore(Path(config.batch_store)), int(config.batch_max_file_mb * 2**20),
                   config.batch_max_lines, config.batch_concurrency,
                   config.batch_concurrency_beside)  # fmt: skip
