"""What a starting stage is doing, read from its output, and that output relayed with the
stage's name on each line.

`prism serve` shows each stage's phase while the mesh starts (an engine on a GPU spends
minutes loading, compiling and capturing graphs), and names it when the start times out.
vLLM says which phase it is in only in its log, and only at INFO: its engines log at INFO
whatever the mesh's level (`plan`), and the relay holds back vLLM's lines below the
stage's level, so that the output is what the level asks for and the phases are known.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO

IMPORTING, SERVING = "importing", "serving"

# vLLM's messages that open a phase, in the order an engine goes through them (vLLM 0.32:
# v1/engine/core.py, v1/worker/*_model_runner.py, compilation/, utils/mem_utils.py).
PHASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), phase)
    for pattern, phase in (
        (r"Initializing a V1 LLM engine", "starting the engine"),
        (r"Starting to load model", "loading weights"),
        (r"Directly load the compiled graph|Directly load AOT compilation",
         "loading compiled graphs"),
        (r"Dynamo bytecode transform|Compiling a graph for|Warming up model for the "
         r"compilation|Compiling model again", "compiling"),
        (r"Memory profiling takes|Available KV cache memory", "profiling memory"),
        (r"Capturing CUDA graphs", "capturing graphs"),
        (r"init engine \(profile, create kv cache, warmup model\) took", "starting its server"),
    )
)  # fmt: skip

# vLLM's own line format: "(EngineCore pid=12) INFO 11-28 17:11:05 [file.py:1] message".
_VLLM_LINE = re.compile(r"^(?:\(\S+ pid=\d+\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d ")


def phase_of(line: str) -> str | None:
    """The phase that `line` opens, if it opens one."""
    return next((phase for pattern, phase in PHASES if pattern.search(line)), None)


def shown(line: str, level: int) -> bool:
    """Whether `line` is shown at `level`: vLLM's lines by their own level, every other
    line (the stage logs at its own level already; tracebacks, prints) always."""
    match = _VLLM_LINE.match(line)
    return match is None or logging.getLevelName(match.group(1)) >= level


def as_json(line: str, stage: str, level: int) -> str | None:
    """`line` of a stage logging JSON as a JSON line naming `stage` (a line that is not
    JSON, a print's or a traceback's, becomes one, its text the message), or None where
    it is vLLM's and below `level`, as `shown` keeps text lines back."""
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "level": "INFO", "message": line.rstrip("\n")}  # fmt: skip
    own = logging.getLevelName(str(record.get("level", "")))
    if str(record.get("logger", "")).startswith("vllm") and isinstance(own, int) and own < level:
        return None
    record["stage"] = stage
    return json.dumps(record, ensure_ascii=False)


@dataclass
class Progress:
    """A stage's phase since its last start, and when it entered it."""

    phase: str = IMPORTING
    started: float = field(default_factory=time.monotonic)
    since: float = field(default_factory=time.monotonic)

    def enter(self, phase: str) -> None:
        if phase != self.phase:
            self.phase, self.since = phase, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def describe(self) -> str:
        """e.g. "compiling for 40 s (71 s since start)"."""
        return (
            f"{self.phase} for {time.monotonic() - self.since:.0f} s "
            f"({self.elapsed():.0f} s since start)"
        )


def relay(
    lines: Iterable[str], out: IO[str], prefix: str, level: int, progress: Progress,
    lock: threading.Lock, json_stage: str = "",
) -> None:  # fmt: skip
    """Copies `lines` to `out` with `prefix` on each (under `lock`: several stages write
    there), or with `json_stage`, as JSON lines naming that stage, keeping back those not
    shown at `level`, and follows the phase. Reads to the end even once `out` is closed:
    a stage whose output nobody reads would block."""
    for line in lines:
        if (phase := phase_of(line)) is not None:
            progress.enter(phase)
        if json_stage:
            relayed = as_json(line, json_stage, level)
        else:
            relayed = line if shown(line, level) else None
        if out.closed or relayed is None:
            continue
        with lock:
            try:
                out.write(
                    f"{prefix}{relayed}" if relayed.endswith("\n") else f"{prefix}{relayed}\n"
                )
                out.flush()
            except (ValueError, OSError):  # closed meanwhile, or a broken pipe
                pass
