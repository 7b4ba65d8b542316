"""The load: streaming chat requests with an image, a video or a clip of audio each, and
the asyncio client that sends them and times every token."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import tempfile
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from PIL import Image

from bench.lib.shapes import AUDIO_RATE, AUDIO_SECONDS, VIDEO_FPS, VIDEO_FRAMES
from bench.lib.stats import percentile
from prism.media.video import encode_video


def image_url(seed: int) -> str:
    pixels = (np.random.RandomState(seed).rand(48, 64, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_url(seed: int) -> str:
    shape = (VIDEO_FRAMES, 48, 64, 3)
    frames = list((np.random.RandomState(seed).rand(*shape) * 255).astype("uint8"))
    with tempfile.TemporaryDirectory() as scratch:
        data = encode_video(frames, VIDEO_FPS, f"{scratch}/v.mp4")
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def wav_base64(seed: int) -> str:
    """Noise, different for every seed, as 16-bit mono WAV."""
    import soundfile

    samples = np.random.RandomState(seed).uniform(-0.5, 0.5, int(AUDIO_SECONDS * AUDIO_RATE))
    buffer = io.BytesIO()
    soundfile.write(buffer, samples.astype(np.float32), AUDIO_RATE, format="WAV")
    return base64.b64encode(buffer.getvalue()).decode()


def media_part(load: str, seed: int) -> dict:
    if load == "audio":
        return {"type": "input_audio", "input_audio": {"data": wav_base64(seed), "format": "wav"}}
    if load == "video":
        return {"type": "video_url", "video_url": {"url": video_url(seed)}}
    return {"type": "image_url", "image_url": {"url": image_url(seed)}}


def chat(model: str, content: list[dict], max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# The LoRA load's models, in turn: the base model (None: the server's), then each adapter
# (bench.serve builds them, random, and every server serves them by these names).
ADAPTERS = ("a1", "a2")


def requests(model: str, seeds: range, max_tokens: int, load: str = "image") -> list[dict]:
    """A fixed load: a chat per seed, each with its own image, video or clip and question;
    the LoRA load's, an image each, asks the base model and each adapter in turn."""
    models = [model, *ADAPTERS] if load == "lora" else [model]
    media = "image" if load == "lora" else load
    return [
        chat(
            models[seed % len(models)],
            [
                media_part(media, seed),
                {"type": "text", "text": f"Question {seed}: what is in this {media}?"},
            ],
            max_tokens,
        )
        for seed in seeds
    ]


def repeats(model: str, seeds: range, max_tokens: int, load: str) -> list[list[dict]]:
    """Each seed's media sent twice, under different questions asked before it: the second
    sending shares no prompt prefix with the first past the chat template's."""
    return [
        [
            chat(
                model,
                [{"type": "text", "text": f"{ask} {seed}:"}, media_part(load, seed)],
                max_tokens,
            )
            for ask in ("Describe", "Summarize")
        ]
        for seed in seeds
    ]


class ServerFailed(RuntimeError):
    """A server answered a request with an error: its run stops, and the bench goes on.
    `reason`: the error in short, for a tally of why requests failed."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.reason = reason


# A reason's detail is a line of a progress report, or a table's cell.
DETAIL_CHARS = 120


def brief(kind: str, detail: str) -> str:
    """`<kind>: <detail>`, the detail on one line and cut to DETAIL_CHARS at a word's end
    (half an id would escape `normalised`)."""
    detail = " ".join(detail.split())
    if len(detail) > DETAIL_CHARS:
        detail = detail[: DETAIL_CHARS - 3].rsplit(" ", 1)[0] + " ..."
    return f"{kind}: {detail}" if detail else kind


def openai_error(body: object) -> dict | None:
    """The error object of an OpenAI error body, `{"error": {...}}` (a reply's or an SSE
    event's), or of vLLM's older flat one, `{"object": "error", "message": ...}`; None for
    any other body."""
    if not isinstance(body, dict):
        return None
    error = body.get("error") or (body if body.get("object") == "error" else None)
    if isinstance(error, str):
        return {"message": error}
    return error if isinstance(error, dict) else None


def http_failure(status: int, text: str) -> str:
    """`HTTP <status>: <message>`: the error body's message, or the body itself when it is
    not an OpenAI error."""
    try:
        error = openai_error(json.loads(text))
    except ValueError:
        error = None
    return brief(f"HTTP {status}", str(error.get("message") or error) if error else text)


def stream_failure(event: dict) -> str | None:
    """`stream error: <type>: <message>` for an SSE event that carries an error: a server
    that fails after its 200 says so in the stream. None for any other event."""
    error = openai_error(event)
    if error is None:
        return None
    kind, message = error.get("type"), str(error.get("message") or error)
    return brief("stream error", f"{kind}: {message}" if kind else message)


def failure_reason(exc: BaseException) -> str:
    """Why a request failed, in short: the server's error, a timeout or the client's."""
    if isinstance(exc, ServerFailed):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    return brief(type(exc).__name__, str(exc))


# An id (a request's, a uuid, a connection's): a word of 8 or more characters with both
# letters and digits in it.
_ID = re.compile(r"(?<![\w-])(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{8,}(?![\w-])")
_NUMBER = re.compile(r"\d+")


def normalised(reason: str) -> str:
    """`reason` as a key of a tally: its kind (what precedes the first ": ", `HTTP 503` say)
    as it is, the ids and numbers in the rest as `<id>` and `N`, so that failures that
    differ only in them count as one."""
    kind, colon, detail = reason.partition(": ")
    return kind + colon + _NUMBER.sub("N", _ID.sub("<id>", detail))


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    tokens: int
    total: float
    prompt_tokens: int = 0


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = prompt = 0
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            raise ServerFailed(url, http_failure(reply.status, await reply.text()))
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if failed := stream_failure(event):
                raise ServerFailed(url, failed)
            if usage := event.get("usage"):
                tokens, prompt = usage["completion_tokens"], usage["prompt_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    ttft = (first or started) - started
    return Sample(ttft, gaps, tokens, time.perf_counter() - started, prompt)


async def drive(base_url: str, warm_up: list[dict], load: list[dict], concurrency: int) -> dict:
    url = f"{base_url}/v1/chat/completions"
    limit = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=limit, timeout=timeout) as session:
        # Connections and lazy set-up, outside the measurement.
        await asyncio.gather(*(one(session, url, body) for body in warm_up))
        queue = list(load)
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                samples.append(await one(session, url, queue.pop()))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ttfts = [s.ttft * 1000 for s in samples]
    gaps = [g * 1000 for s in samples for g in s.gaps]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "seconds": elapsed,
        "requests_per_s": len(samples) / elapsed,
        "output_tokens_per_s": sum(s.tokens for s in samples) / elapsed,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p99": percentile(gaps, 99),
        "request_seconds_total": sum(s.total for s in samples),
        # Under load a server may send several tokens in one event.
        "events_per_request": float(np.mean([len(s.gaps) + 1 for s in samples])),
    }


async def resend(base_url: str, pairs: list[list[dict]]) -> dict:
    """Time to first token of each media's first sending and of its second, one at a time."""
    url = f"{base_url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        ttfts = [[(await one(session, url, body)).ttft * 1000 for body in pair] for pair in pairs]
    first, repeat = zip(*ttfts, strict=True)
    return {
        "concurrency": 1,
        "requests": len(pairs),
        "ttft_ms_p50_first": percentile(list(first), 50),
        "ttft_ms_p50_repeat": percentile(list(repeat), 50),
    }
