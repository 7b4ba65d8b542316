"""Prism in each mode against `vllm serve` on the same model, the same machine, the same load.

    .venv/bin/python bench/serve.py --model DIR [--load image|video]
        [--modes epd,e/pd,e/p/d,ep/d] [--concurrency 1,8,32] [--requests 256]
        [--max-tokens 32] [--out JSON] [--doc docs/benchmarks.md] [--profile DIR]
        [--rounds N] [--repeats 16]

Servers run one after the other: first vLLM's own OpenAI server (the anchor), then the
same with its engine as Prism's workers run it on the CPU backend (the model inside the
engine core process, so that the ratio to it is the mesh's own cost), then a
Prism mesh per mode; with `--rounds N`, all of them N times in turn, and the report gives
medians (each ratio the median of those measured within a round, beside its anchor).
Each gets the same fixed set of streaming chat requests, one image (or, with `--load
video`, one 16-frame video) each, at every concurrency level (a bounded count per level,
after a warm-up), from the asyncio client below: requests/s, output tokens/s, time to
first token and inter-token latency (p50, p99), and each Prism run's ratios to `vllm serve`
measured in the same run. For the modes that move tensors, the share of request time spent
in NIXL reads.
The video load measures the embedding cache too: `--repeats` videos, each sent twice at
concurrency 1 under different questions, and the time to first token of each sending.
Not a test: results go to `--out` (JSON; by default bench/results/latest.json for images,
bench/results/video.json for videos) and `--doc`, which shows both loads' latest results.
With `--profile`, py-spy records each Prism stage's Python process during the highest
concurrency level (of the last round) and writes one flame graph (SVG) per stage there.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from prism.launcher import Mesh, MeshConfig, http_ok, plan
from prism.ports import free_port
from prism.video import encode_video

ANCHOR = "vllm_serve"
# `vllm serve` with the engine as Prism's workers run it on the CPU backend (the model
# inside the engine core process): the same engine on both sides, so the ratio to it is
# the mesh's own cost.
SAME_ENGINE = "vllm_serve_uni"
ANCHORS = (ANCHOR, SAME_ENGINE)
RESULTS = {"image": Path("bench/results/latest.json"), "video": Path("bench/results/video.json")}
# bench/routing.py's section of the benchmarks document, written beside it.
ROUTING_SECTION = "benchmarks-routing.md"
CHOICES_SECTION = "benchmarks-choices.md"
# A short clip, every frame of which Qwen2-VL's loader takes (it samples 2 frames a second).
VIDEO_FRAMES, VIDEO_FPS = 16, 2.0


def slug(server: str) -> str:
    """A server's name in keys and file names: e/pd is e_pd, as epd is not e/p/d."""
    return server.replace("/", "_")


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


def media_part(load: str, seed: int) -> dict:
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


def requests(model: str, seeds: range, max_tokens: int, load: str = "image") -> list[dict]:
    """A fixed load: a chat per seed, each with its own image or video and question."""
    return [
        chat(
            model,
            [
                media_part(load, seed),
                {"type": "text", "text": f"Question {seed}: what is in this {load}?"},
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


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    tokens: int
    total: float


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as reply:
        reply.raise_for_status()
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    return Sample((first or started) - started, gaps, tokens, time.perf_counter() - started)


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


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or set(sample.labels) <= {"tensor"}
    }


@dataclass
class Server:
    name: str
    base_url: str
    # /metrics of the stage that reads tensors over NIXL, to measure transfer time.
    reader_metrics: str = ""
    stop: list = field(default_factory=list)
    # The Python process of each stage, to profile.
    pids: dict[str, int] = field(default_factory=dict)


def start_vllm(model: str, log: Path, limits: dict, same_engine: bool = False) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--dtype", "float32", "--enforce-eager", "--seed", "0", "--port", str(port),
            "--host", "127.0.0.1", "--limit-mm-per-prompt", json.dumps(limits),
            "--uvicorn-log-level", "warning"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if same_engine:
        argv += ["--distributed-executor-backend", "uni"]
        # As many OpenMP threads as vLLM binds on one node (all cores but its scheduler's).
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads)}
    with open(log, "w") as out:
        # In this session, as Prism's stages are: the kernel shares CPU between sessions.
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   process_group=0)  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not http_ok(f"{base_url}/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"vllm serve did not start; see {log}")
        time.sleep(0.5)

    def stop() -> None:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)

    return Server(SAME_ENGINE if same_engine else ANCHOR, base_url, stop=[stop])


def start_prism(mode: str, model: str, log: Path) -> Server:
    port = free_port()
    mesh = Mesh(plan(MeshConfig(mode=mode, model=model, http_port=port, log_level="warning",
                                max_in_flight=0)))  # fmt: skip
    with open(log, "w") as out:
        mesh.start(timeout=300, log=out)
    reader = {"e/pd": "worker", "e/p/d": "prefill"}.get(mode, "")
    metrics = mesh.stage(reader).metrics_url if reader else ""
    pids = {stage.name: stage.process.pid for stage in mesh.stages if stage.process}
    return Server(mode, f"http://127.0.0.1:{port}", metrics, stop=[mesh.stop], pids=pids)


def profiled(server: Server, profile: Path | None) -> list[subprocess.Popen]:
    """py-spy recorders, one per stage process; SIGINT makes each write its flame graph."""
    if profile is None:
        return []
    profile.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    name = slug(server.name)
    recorders = []
    for stage, pid in server.pids.items():
        argv = [str(spy), "record", "--pid", str(pid), "--rate", "100", "--nonblocking",
                "--output", str(profile / f"{name}-{stage}.svg")]  # fmt: skip
        recorders.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL))
    return recorders


def run_server(
    server: Server, loads: dict[int, tuple[list, list]], profile: Path | None = None
) -> list[dict]:
    rows = []
    for concurrency, (warm_up, load) in loads.items():
        before = scrape(server.reader_metrics) if server.reader_metrics else {}
        recorders = profiled(server, profile) if concurrency == max(loads) else []
        row = asyncio.run(drive(server.base_url, warm_up, load, concurrency))
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)
        for recorder in recorders:
            recorder.wait(timeout=60)
        if server.reader_metrics:
            after = scrape(server.reader_metrics)
            name = "prism_nixl_read_seconds_sum"
            read = after.get(name, 0.0) - before.get(name, 0.0)
            row["nixl_read_share"] = read / row["request_seconds_total"]
        row["server"] = server.name
        rows.append(row)
        print(f"{server.name:>10} c={concurrency:<3} {row['requests_per_s']:7.2f} req/s "
              f"{row['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:7.1f} ms "
              f"ITL p50 {row['itl_ms_p50']:6.2f} ms", flush=True)  # fmt: skip
    return rows


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


def suffix(concurrency: int, top: int) -> str:
    """Ratios at the highest level have plain keys; the others end in _c<level>."""
    return "" if concurrency == top else f"_c{concurrency}"


def ratios(rows: list[dict]) -> dict[str, float]:
    out = {}
    for anchor_name in ANCHORS:
        anchor = {r["concurrency"]: r for r in rows if r["server"] == anchor_name}
        if not anchor:
            continue
        top = max(anchor)
        for row in rows:
            base = anchor.get(row["concurrency"])
            if row["server"] == anchor_name or base is None:
                continue
            name = f"{slug(row['server'])}_vs_{anchor_name}"
            end = suffix(row["concurrency"], top)
            out[f"{name}_rps_ratio{end}"] = row["requests_per_s"] / base["requests_per_s"]
            out[f"{name}_tokens_ratio{end}"] = (
                row["output_tokens_per_s"] / base["output_tokens_per_s"]
            )
            out[f"{slug(row['server'])}_minus_{anchor_name}_ttft_p50_ms{end}"] = (
                row["ttft_ms_p50"] - base["ttft_ms_p50"]
            )
    return out


def medians(rounds: list[list[dict]]) -> list[dict]:
    """Per server and level, the median of each measure over the rounds, and the
    requests/s of every round."""
    rows = []
    for first in rounds[0]:
        which = (first["server"], first["concurrency"])
        same = [r for rows in rounds for r in rows if (r["server"], r["concurrency"]) == which]
        row = {
            key: float(np.median([r[key] for r in same])) if isinstance(value, float) else value
            for key, value in first.items()
        }
        if "requests_per_s" in first:
            row["requests_per_s_by_round"] = [r["requests_per_s"] for r in same]
        rows.append(row)
    return rows


def median_ratios(rounds: list[list[dict]]) -> dict[str, float]:
    """Each ratio taken within a round, against the anchor run beside it; then the median."""
    per_round = [ratios(rows) for rows in rounds]
    return {key: float(np.median([r[key] for r in per_round])) for key in per_round[0]}


def plots(path: Path, rows: list[dict]) -> list[str]:
    """PNG plots of the image load beside `path`, and the markdown that shows them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    shown = []
    for key, label, name in (("requests_per_s", "requests/s", "rps"),
                             ("ttft_ms_p50", "TTFT p50 (ms)", "ttft"),
                             ("itl_ms_p50", "inter-token latency p50 (ms)", "itl")):  # fmt: skip
        figure, axes = plt.subplots(figsize=(6, 4))
        for server in servers:
            points = [(r["concurrency"], r[key]) for r in rows if r["server"] == server]
            axes.plot(*zip(*points, strict=True), marker="o", label=server)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrency")
        axes.set_ylabel(label)
        axes.legend()
        axes.grid(alpha=0.3)
        image = path.parent / f"benchmarks-{name}.png"
        figure.tight_layout()
        figure.savefig(image, dpi=110)
        plt.close(figure)
        shown.append(f"![{label}]({image.name})")
    return shown


def table(result: dict) -> list[str]:
    """One row per server and level, with ratios to each anchor that ran."""
    rows = result["rows"]
    anchors = [a for a in ANCHORS if any(r["server"] == a for r in rows)]
    names = {ANCHOR: "vllm serve", SAME_ENGINE: "vllm serve, same engine"}
    lines = [
        "| server | concurrency | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | "
        + "".join(f"req/s vs {names[a]} | " for a in anchors)
        + "NIXL read share |",
        "|---|" + "---:|" * (8 + len(anchors)),
    ]
    top = max(r["concurrency"] for r in rows if r["server"] == ANCHOR)
    for r in rows:
        end = suffix(r["concurrency"], top)
        ratios = [
            1.0 if r["server"] == anchor else result.get(
                f"{slug(r['server'])}_vs_{anchor}_rps_ratio{end}", float("nan"))
            for anchor in anchors
        ]  # fmt: skip
        share = f"{100 * r['nixl_read_share']:.2f} %" if "nixl_read_share" in r else ""
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} "
            f"| {r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} | "
            + "".join(f"{ratio:.2f} | " for ratio in ratios)
            + f"{share} |"
        )
    return lines


def setting(result: dict, what: str) -> str:
    return (
        f"Written by `make bench` on {result['when']} ({result['machine']}). Model: "
        f"{result['model']}; {result['requests']} streaming chat requests per level, {what} "
        f"each, {result['max_tokens']} tokens each, greedy. Every level has "
        "requests of its own (no prefix or media cache hits across levels), after a warm-up "
        "burst of its own. The client runs on the same machine. "
        f"Rounds: {result['rounds']}. In each round every server runs once, in turn; the "
        "table gives medians over the rounds, and each ratio is the median of the ratios "
        "measured within a round."
    )


def write_doc(path: Path, results: dict[str, dict]) -> None:
    """The latest result of each load, images first (with the notes written beside it),
    then the sections of the routing and choices benchmarks (bench/routing.py,
    bench/choices.py) that have run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmarks: Prism against `vllm serve`", ""]
    if image := results.get("image"):
        lines += [setting(image, "one 64x48 image"), "", *table(image), ""]
        lines += [*plots(path, image["rows"]), ""]
        notes = path.parent / "benchmarks-notes.md"
        if notes.exists():
            lines += [notes.read_text()]
    if video := results.get("video"):
        clip = (
            f"one {VIDEO_FRAMES}-frame 64x48 MP4 video (MPEG-4, {VIDEO_FPS:g} frames a "
            "second, every frame taken by the model's video loader)"
        )
        lines += ["## Video load", "", setting(video, clip), "", *table(video), ""]
    if video and video["resent"]:
        lines += [
            "**A video sent again.** Each of "
            f"{video['resent'][0]['requests']} new videos sent twice, one request at a time, "
            "each sending under its own question asked before the video (so the second "
            "shares no prompt prefix with the first past the chat template's); time to "
            "first token, p50:",
            "",
            "| server | first sending, ms | sent again, ms |",
            "|---|---:|---:|",
            *(
                f"| {r['server']} | {r['ttft_ms_p50_first']:.1f} | {r['ttft_ms_p50_repeat']:.1f} |"
                for r in video["resent"]
            ),
            "",
        ]
    for section in (ROUTING_SECTION, CHOICES_SECTION):
        if (path.parent / section).exists():
            lines += [(path.parent / section).read_text()]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/pd,e/p/d,ep/d")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=256, help="per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--load", choices=tuple(RESULTS), default="image")
    parser.add_argument(
        "--repeats", type=int, default=16, help="video load: videos sent twice (cache hits)"
    )
    parser.add_argument("--out", type=Path, help="default: bench/results/<load>.json")
    parser.add_argument("--doc", default="docs/benchmarks.md")
    parser.add_argument("--profile", type=Path, help="write py-spy flame graphs here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each server runs once per round, in turn; medians")  # fmt: skip
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    def loads(round_: int) -> dict[int, tuple[list, list]]:
        # Every level of every round gets requests of its own, and so does its warm-up:
        # none can be served from a prefix or image cache that an earlier one filled.
        # Each server gets the same.
        out = {}
        for level, concurrency in enumerate(levels):
            first = round_ * 10_000_000 + (level + 1) * 100_000
            warm_up = requests(
                args.model, range(first, first + concurrency), args.max_tokens, args.load
            )
            first += concurrency
            load = requests(
                args.model, range(first, first + args.requests), args.max_tokens, args.load
            )
            out[concurrency] = (warm_up, load)
        return out

    def pairs(round_: int) -> list[list[dict]]:
        first = round_ * 10_000_000 + 9_000_000
        return repeats(args.model, range(first, first + args.repeats), args.max_tokens, args.load)

    logs = Path(tempfile.mkdtemp(prefix="prism-bench-"))
    # The same caps as a Prism mesh's defaults (--max-images 8, --max-videos 4).
    limits = {"image": 8} if args.load == "image" else {"image": 8, "video": 4}
    starters = [lambda: start_vllm(args.model, logs / "vllm-serve.log", limits)]
    if args.load == "image":
        starters.append(
            lambda: start_vllm(args.model, logs / "vllm-serve-uni.log", limits, same_engine=True)
        )
    starters += [
        lambda mode=mode: start_prism(mode, args.model, logs / f"{slug(mode)}.log")
        for mode in args.modes.split(",")
    ]
    rounds: list[list[dict]] = []
    resent: list[list[dict]] = []
    for round_ in range(args.rounds):
        profile = args.profile if round_ == args.rounds - 1 else None
        rows: list[dict] = []
        resends: list[dict] = []
        for start in starters:
            server = start()
            try:
                rows += run_server(server, loads(round_), profile)
                if args.load == "video" and args.repeats:
                    row = asyncio.run(resend(server.base_url, pairs(round_)))
                    resends.append(row | {"server": server.name})
                    first, again = row["ttft_ms_p50_first"], row["ttft_ms_p50_repeat"]
                    print(f"{server.name:>10} resent: TTFT p50 {first:.1f} ms first, "
                          f"{again:.1f} ms again", flush=True)  # fmt: skip
            finally:
                for stop in server.stop:
                    stop()
        rounds.append(rows)
        resent.append(resends)
    rows = medians(rounds)
    result = {
        "load": args.load,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": rows,
        "resent": medians(resent) if resent[0] else [],
        **median_ratios(rounds),
    }
    out = args.out or RESULTS[args.load]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    shown = {load: json.loads(path.read_text()) for load, path in RESULTS.items() if path.exists()}
    write_doc(Path(args.doc), shown | {args.load: result})
    print(json.dumps({k: round(v, 3) for k, v in median_ratios(rounds).items()}, indent=2))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
