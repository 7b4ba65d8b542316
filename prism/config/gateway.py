"""Where and how a front serves the OpenAI REST API (a gateway, or a front in one process
with the processor), and what its Responses API keeps."""

from __future__ import annotations

import os
from dataclasses import dataclass

from prism.config.flags import Flags, flag

# What the Responses API keeps by default (prism.gateway.openai.responses.store).
RESPONSES_MAX_ENTRIES = 1000
RESPONSES_MAX_MB = 256.0
RESPONSES_TTL_S = 3600.0


@dataclass
class GatewayConfig(Flags):
    """The OpenAI REST API's own settings: its key, timeouts, KServe, the stored responses,
    the batches."""

    api_key: str = flag(
        help="require 'Authorization: Bearer KEY' on /v1 (default: PRISM_API_KEY; none if unset)",
        factory=lambda: os.environ.get("PRISM_API_KEY", ""),
        secret=True,
    )
    request_timeout: float = flag(
        0, "seconds a generation may take before it ends with 504 (0: no limit)", always=True
    )
    http_keep_alive_s: float = flag(
        75.0,
        "seconds an idle HTTP connection stays open: longer than the idle timeouts of "
        "clients and load balancers (aiohttp 15 s, AWS ALB 60 s), so that they close first "
        "and no request is sent on a connection the server is closing",
        metavar="S",
    )
    kserve_grpc_port: int = flag(
        0,
        "also serve KServe v2 gRPC (inference.GRPCInferenceService, as Triton with its "
        "vLLM backend) on this port (0: not served)",
    )
    responses_store_size: int = flag(
        RESPONSES_MAX_ENTRIES,
        "responses the Responses API keeps for previous_response_id and GET (the oldest "
        "goes first; 0: none kept)",
    )
    responses_store_mb: float = flag(
        RESPONSES_MAX_MB,
        "megabytes the stored responses take at most, their images' data URLs included (the "
        "oldest go first; a response larger than all is not kept)",
        metavar="MB",
    )
    responses_ttl_s: float = flag(RESPONSES_TTL_S, "seconds a stored response is kept", metavar="S")
    responses_store: str = flag(
        "",
        "a SQLite file for the stored responses, which fronts that share it all find "
        "(default: this process's memory; prism serve --front-workers N gives its fronts one)",
        metavar="PATH",
    )
    batch_store: str = flag(
        help="a directory for the Batch API's files and batches (a SQLite file and the files), "
        "which fronts that share it all serve, and a front started again goes on from (default: "
        "$XDG_STATE_HOME/prism/batches, or ~/.local/state/prism/batches)",
        metavar="DIR",
        factory=lambda: os.path.join(
            os.environ.get("XDG_STATE_HOME") or "~/.local/state", "prism", "batches"
        ),
    )
    batch_max_file_mb: float = flag(
        200.0, "megabytes a file uploaded for the Batch API may take at most", metavar="MB"
    )
    batch_max_lines: int = flag(50000, "requests a batch's input file may hold at most")
    batch_concurrency: int = flag(
        8,
        "a batch's requests in flight at most at a front while no interactive request has come "
        "there for a second (a batch's request starts only while none is in flight)",
        minimum=1,
    )
    batch_concurrency_beside: int = flag(
        2,
        "a batch's requests in flight at most at a front while interactive requests come there: "
        "fewer keep their time to first token close to what it is without the batch",
        minimum=1,
    )


@dataclass
class HttpConfig(Flags):
    """Where a front's OpenAI REST API answers."""

    http_host: str = flag("", "address the OpenAI REST API binds (default: --host)")
    http_port: int = flag(8000, "port of the OpenAI REST API", always=True)


@dataclass
class BatchFilesConfig(Flags):
    """`prism run-batch`'s files, as `vllm run-batch` names them."""

    input_file: str = flag(
        help="the batch's requests: a JSONL file of OpenAI's batch input format", aliases=("-i",)
    )
    output_file: str = flag(
        help="where every request's answer goes, in the input's order, failures too (JSONL)",
        aliases=("-o",),
    )
