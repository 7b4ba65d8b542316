"""Prism in each mode against `vllm serve` on the same model, the same machine, the same load.

    .venv/bin/python -m bench.serve --model DIR [--load image|video|audio|lora]
        [--modes epd,e/pd,e/p/d,ep/d] [--concurrency 1,8,32] [--requests 256]
        [--max-tokens 32] [--out JSON] [--doc docs/benchmarks.md] [--profile DIR]
        [--rounds N] [--repeats 16]

Servers run one after the other: first vLLM's own OpenAI server (the anchor), then the
same with its engine as Prism's workers run it on the CPU backend (the model inside the
engine core process, so that the ratio to it is the mesh's own cost), then a
Prism mesh per mode; with `--rounds N`, all of them N times in turn, and the report gives
medians (each ratio the median of those measured within a round, beside its anchor).
Each gets the same fixed set of streaming chat requests, one image (or, with `--load
video`, one 16-frame video; with `--load audio`, one 2 s clip as `input_audio`) each, at
every concurrency level (a bounded count per level, after a warm-up), from the asyncio
client below: requests/s, output tokens/s, time to first token and inter-token latency
(p50, p99), and each Prism run's ratios to `vllm serve` measured in the same run. For the
modes that move tensors, the share of request time spent in NIXL reads.
The LoRA load (`--load lora`) asks the base model and two random adapters of it in turn,
an image each, every server serving both (`--enable-lora`, `--lora-modules`).
The video and audio loads measure the embedding cache too: `--repeats` items, each sent
twice at concurrency 1 under different questions, and the time to first token of each
sending.
Not a test: results go to `--out` (JSON; by default bench/results/latest.json for images,
bench/results/video.json for videos, bench/results/audio.json for audio,
bench/results/lora.json for adapters), and `--doc` is
rendered again from the results files with them (bench/render.py), the image load's
figures beside it.
With `--profile`, py-spy records each Prism stage's Python process during the highest
concurrency level (of the last round) and writes one flame graph (SVG) per stage there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import parity
from bench.lib.load import ADAPTERS, ServerFailed, drive, repeats, requests, resend
from bench.lib.metrics import prompt_sources, scrape
from bench.lib.profile import finish, record, tree_cpu_seconds
from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.servers import (
    DYNAMO_PYTHON,
    Server,
    StartFailed,
    may_fail,
    start_dynamo,
    start_prism,
    start_vllm,
    start_vllm_pd,
)
from bench.lib.shapes import DYNAMO_AGG, DYNAMO_E_PD, DYNAMO_PD, slug
from bench.lib.stats import anchor_pairs, median_ratios, medians, shape_pairs

LOADS = ("image", "video", "audio", "lora")
# The LoRA load's engines, on both sides: as many adapters at once as it asks for.
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/pd,e/p/d,ep/d")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=256, help="per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--load", choices=LOADS, default="image")
    parser.add_argument("--repeats", type=int, default=16, help="video, audio: items sent twice")
    parser.add_argument("--out", type=Path, help="default: bench/results/<load>.json")
    parser.add_argument("--doc", default="docs/benchmarks.md")
    parser.add_argument("--profile", type=Path, help="write py-spy flame graphs here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each server runs once per round, in turn; medians")  # fmt: skip
    parser.add_argument(
        "--anchors",
        action="store_true",
        help="NVIDIA Dynamo (aggregated, P/D, E/PD) and vLLM's own P/D beside `vllm serve` "
        "and Prism (set up by `make bench-anchors`); default --out: bench/results/anchors.json",
    )
    parser.add_argument("--doc-only", action="store_true",
                        help="rewrite --doc from the results files, running nothing")  # fmt: skip
    parser.add_argument(
        "--same-engine", action=argparse.BooleanOptionalAction, default=True,
        help="image load: also `vllm serve` with its engine as Prism's workers run it on the CPU",
    )  # fmt: skip
    parser.add_argument(
        "--parity", default="", metavar="MODES",
        help="these Prism modes' greedy answers to --parity-prompts image prompts "
        "(--parity-tokens each) beside one offline vLLM engine's (bench/parity.py)",
    )  # fmt: skip
    parser.add_argument("--parity-prompts", type=int, default=4)
    parser.add_argument("--parity-tokens", type=int, default=16)
    return parser


def level_loads(args: argparse.Namespace, round_: int) -> dict[int, tuple[list, list]]:
    """Each level's warm-up and load. Every level of every round gets requests of its own,
    and so does its warm-up: none can be served from a prefix or image cache that an
    earlier one filled. Each server gets the same."""
    out = {}
    for level, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
        first = round_ * 10_000_000 + (level + 1) * 100_000
        warm_up = requests(
            args.model, range(first, first + concurrency), args.max_tokens, args.load
        )
        first += concurrency
        load = requests(args.model, range(first, first + args.requests), args.max_tokens, args.load)
        out[concurrency] = (warm_up, load)
    return out


def adapters(model: str, logs: Path) -> tuple[str, ...]:
    """The LoRA load's adapters of `model`, built under `logs`, as NAME=PATH."""
    from prism.devtools.lora import build_lora

    return tuple(
        f"{name}={build_lora(Path(model), logs / name, rank=8, seed=seed)}"
        for seed, name in enumerate(ADAPTERS, 1)
    )


def starters(args: argparse.Namespace, logs: Path) -> list[Callable[[], Server]]:
    """What starts each server, in the order they run in every round."""
    # The same caps as a Prism mesh's defaults (--max-images 8, --max-videos 4,
    # --max-audios 4).
    limits = {"image": {"image": 8}, "video": {"image": 8, "video": 4},
              "audio": {"audio": 4}, "lora": {"image": 8}}[args.load]  # fmt: skip
    lora = adapters(args.model, logs) if args.load == "lora" else ()
    # Both sides' engines serve the adapters (`vllm serve --enable-lora --lora-modules`).
    engine = LORA_FLAGS if lora else ()
    vllm_extra = (*engine, "--lora-modules", *lora) if lora else ()
    out = [lambda: start_vllm(args.model, logs / "vllm-serve.log", limits, extra=vllm_extra)]
    if args.anchors:
        if not DYNAMO_PYTHON.exists():
            raise SystemExit("the anchors are not installed: run `make bench-anchors`")
        out += [
            may_fail(lambda: start_dynamo(DYNAMO_AGG, args.model, logs, limits), DYNAMO_AGG),
            may_fail(lambda: start_dynamo(DYNAMO_PD, args.model, logs, limits), DYNAMO_PD),
            may_fail(lambda: start_dynamo(DYNAMO_E_PD, args.model, logs, limits), DYNAMO_E_PD),
            may_fail(lambda: start_vllm_pd(args.model, logs, limits), "vllm_pd"),
        ]
    elif args.load == "image" and args.same_engine:
        out.append(
            lambda: start_vllm(args.model, logs / "vllm-serve-uni.log", limits, same_engine=True)
        )
    out += [
        may_fail(
            lambda mode=mode: start_prism(
                mode, args.model, logs / f"{slug(mode)}.log", vllm_flags=engine, lora_modules=lora
            ),
            mode,
        )
        for mode in args.modes.split(",")
    ]
    return out


def run_server(
    server: Server, loads: dict[int, tuple[list, list]], profile: Path | None = None
) -> list[dict]:
    rows = []
    for concurrency, (warm_up, load) in loads.items():
        before = scrape(server.reader_metrics) if server.reader_metrics else {}
        sources = prompt_sources(server.decode_metrics) if server.decode_metrics else {}
        top = concurrency == max(loads)
        recorders = record(server.pids, profile, slug(server.name)) if top else []
        if server.model:
            warm_up = [body | {"model": server.model} for body in warm_up]
            load = [body | {"model": server.model} for body in load]
        cpu = tree_cpu_seconds(server.pids)
        row = asyncio.run(drive(server.base_url, warm_up, load, concurrency))
        if server.pids:
            # Each stage's CPU (its engine's processes included), warm-up and load.
            spent = tree_cpu_seconds(server.pids)
            row["cpu_ms_per_request"] = {
                stage: 1000 * (spent[stage] - cpu[stage]) / (len(warm_up) + len(load))
                for stage in spent
            }
        finish(recorders, timeout=60)
        if server.reader_metrics:
            after = scrape(server.reader_metrics)
            name = "prism_nixl_read_seconds_sum"
            read = after.get(name, 0.0) - before.get(name, 0.0)
            row["nixl_read_share"] = read / row["request_seconds_total"]
        if server.decode_metrics:
            after = prompt_sources(server.decode_metrics)
            read = after.get("external_kv_transfer", 0) - sources.get("external_kv_transfer", 0)
            total = sum(after.values()) - sum(sources.values())
            # A decode that computed the prompts itself would not be a P/D split.
            row["decode_kv_read_share"] = read / total if total else 0.0
        row["server"] = server.name
        rows.append(row)
        print(f"{server.name:>10} c={concurrency:<3} {row['requests_per_s']:7.2f} req/s "
              f"{row['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:7.1f} ms "
              f"ITL p50 {row['itl_ms_p50']:6.2f} ms", flush=True)  # fmt: skip
    return rows


@dataclass
class Tally:
    """What the rounds measured: each round's rows and resent videos, each mode's parity,
    and the servers that failed or could not start (by index among the starters), and why."""

    rounds: list[list[dict]] = field(default_factory=list)
    resent: list[list[dict]] = field(default_factory=list)
    parities: dict[str, list[dict]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    def everywhere(self) -> list[list[dict]]:
        """The rounds, less every server that failed in any of them."""
        ran = set.intersection(*({r["server"] for r in rows} for rows in self.rounds))
        return [[r for r in rows if r["server"] in ran] for rows in self.rounds]


def checked(args: argparse.Namespace) -> set[str]:
    """The modes whose answers are compared with the offline engine's."""
    return set(filter(None, args.parity.split(",")))


def check_parity(
    server: Server, args: argparse.Namespace, expected: list[dict], tally: Tally
) -> None:
    """Once per mode asked for: the mesh's greedy answers beside the offline engine's."""
    if server.name not in checked(args) or server.name in tally.parities:
        return
    got = parity.answers(server.grpc_address, args.model, args.parity_prompts, args.parity_tokens)
    tally.parities[server.name] = parity.compare(expected, got)
    equal = sum(row["equal"] for row in tally.parities[server.name])
    print(f"{server.name:>10} parity: {equal}/{len(got)} prompts equal to "
          "the offline engine", flush=True)  # fmt: skip


def resent_once(server: Server, args: argparse.Namespace, round_: int) -> dict:
    """The video or audio load's media sent twice each, one request at a time."""
    first = round_ * 10_000_000 + 9_000_000
    pairs = repeats(args.model, range(first, first + args.repeats), args.max_tokens, args.load)
    row = asyncio.run(resend(server.base_url, pairs))
    first_ms, again = row["ttft_ms_p50_first"], row["ttft_ms_p50_repeat"]
    print(f"{server.name:>10} resent: TTFT p50 {first_ms:.1f} ms first, "
          f"{again:.1f} ms again", flush=True)  # fmt: skip
    return row | {"server": server.name}


def run_rounds(
    args: argparse.Namespace, starts: list[Callable[[], Server]], expected: list[dict]
) -> Tally:
    """Every server once per round, in turn; one that fails is not started again."""
    tally = Tally()
    for round_ in range(args.rounds):
        profile = args.profile if round_ == args.rounds - 1 else None
        rows: list[dict] = []
        resends: list[dict] = []
        for index, start in enumerate(starts):
            if index in tally.failed:
                continue
            try:
                server = start()
            except StartFailed as exc:
                tally.failed[index] = str(exc)
                print(f"skipped: {exc}", flush=True)
                continue
            try:
                check_parity(server, args, expected, tally)
                rows += run_server(server, level_loads(args, round_), profile)
                if args.load in ("video", "audio") and args.repeats:
                    resends.append(resent_once(server, args, round_))
            except ServerFailed as exc:
                tally.failed[index] = f"{server.name} failed: {exc}"
                print(tally.failed[index], flush=True)
            finally:
                for stop in server.stop:
                    stop()
        tally.rounds.append(rows)
        tally.resent.append(resends)
    return tally


def summary(args: argparse.Namespace, tally: Tally, ratios: dict[str, float]) -> dict:
    """The result: medians over the rounds of the servers that ran in every round, and
    their `ratios`."""
    rounds = tally.everywhere()
    result = {
        "load": args.load,
        **stamp(),
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": medians(rounds),
        "resent": medians(tally.resent) if tally.resent[0] else [],
        "not_run": sorted(tally.failed.values()),
        **ratios,
    }
    if checked(args):
        result["parity"] = {
            "prompts": args.parity_prompts, "max_tokens": args.parity_tokens,
            "modes": tally.parities,
        }  # fmt: skip
    return result


def main() -> None:
    args = parser().parse_args()
    if args.doc_only:
        publish(Path(args.doc))
        return
    logs = Path(tempfile.mkdtemp(prefix="prism-bench-"))
    # First, while no server holds the machine's memory.
    expected = (
        parity.oracle(args.model, args.parity_prompts, args.parity_tokens) if checked(args) else []
    )
    tally = run_rounds(args, starters(args, logs), expected)
    ratios = median_ratios(tally.everywhere(), shape_pairs if args.anchors else anchor_pairs)
    result = summary(args, tally, ratios)
    # The anchors' run is a record of its own; otherwise the load's.
    record = "anchors" if args.anchors else args.load
    save(args.out or RECORDS[record], result)
    publish(Path(args.doc), {record: result})
    print(json.dumps({k: round(v, 3) for k, v in ratios.items()}, indent=2))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
