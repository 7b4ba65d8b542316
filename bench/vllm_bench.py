"""vLLM's own benchmark client against Prism in each mode and beside `vllm serve`.

    .venv/bin/python -m bench.vllm_bench --model DIR [--modes epd,e/pd,e/p/d,ep/d]
        [--rounds 2] [--prompts 256] [--concurrency 32] [--max-tokens 32]
        [--out bench/results/vllm_bench.json] [--doc docs/benchmarks.md]

The client is `vllm bench serve` (vLLM's vllm.benchmarks.serve, unmodified, run with its
own argument parser) with its defaults where the load leaves them: `--backend
openai-chat`, random multimodal prompts with one 64x64 image each, `--ignore-eos`, and no
temperature, so requests are sampled at 1.0 as OpenAI's default is. Each server, `vllm
serve` first, then a Prism mesh per mode, takes `--prompts` requests at `--concurrency`,
`--rounds` times in turn: completed and failed requests, requests/s, output tokens/s and
time to first token as the client reports them, and each failure's error. Not a test:
results go to `--out` (JSON), and `--doc` is rendered again from the results files with them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.sections.vllm_bench import vllm_bench_section
from bench.lib.servers import start_prism, start_vllm
from bench.lib.vllm_client import IMAGE, run_client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/pd,e/p/d,ep/d")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64, help="text tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RECORDS["vllm_bench"])
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="prism-vllm-bench-"))
    starts = [lambda: start_vllm(args.model, logs / "vllm.log", IMAGE)]
    for mode in args.modes.split(","):
        log = logs / f"prism-{mode.replace('/', '')}.log"
        starts.append(lambda mode=mode, log=log: start_prism(mode, args.model, log))
    rows = []
    for round_ in range(1, args.rounds + 1):
        for start in starts:
            server = start()
            try:
                rows.append(run_client(server, args, logs, round_))
            finally:
                for stop in server.stop:
                    stop()
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "errors"}), flush=True)
    result = {
        **stamp(),
        "model": args.model,
        "prompts": args.prompts,
        "input_len": args.input_len,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": rows,
    }
    save(args.out, result)
    publish(args.doc, {"vllm_bench": result})
    print(vllm_bench_section(result))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
