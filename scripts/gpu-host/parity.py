"""The oracle alone, for a lease too short for verify-gpu's serve step: MODES' greedy
answers to 4 image prompts (16 tokens each) beside one offline vLLM engine's, each mesh
started in turn on the GPU, each step's seconds printed as it ends.

    python3 scripts/gpu-host/parity.py MODEL OUT_DIR e/p/d,e/pd
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import parity
from bench.lib.servers import start_prism
from bench.lib.shapes import slug

PROMPTS, TOKENS = 4, 16


def main() -> None:
    model, out, modes = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    out.mkdir(parents=True, exist_ok=True)
    begin = time.monotonic()
    result: dict = {"model": model, "prompts": PROMPTS, "max_tokens": TOKENS, "modes": {}}

    def lap(what: str) -> float:
        seconds = round(time.monotonic() - begin, 1)
        print(f"{seconds:7.1f} s  {what}", flush=True)
        result.setdefault("seconds", {})[what] = seconds
        out.joinpath("parity.json").write_text(json.dumps(result, indent=1))
        return seconds

    expected = parity.oracle(model, PROMPTS, TOKENS)
    lap("offline engine answered")
    for mode in modes:
        server = start_prism(mode, model, out / f"{slug(mode)}.log")
        lap(f"{mode} started")
        try:
            got = parity.answers(server.grpc_address, model, PROMPTS, TOKENS)
        finally:
            for stop in server.stop:
                stop()
        rows = parity.compare(expected, got)
        result["modes"][mode] = rows
        lap(f"{mode}: {sum(r['equal'] for r in rows)}/{len(rows)} prompts equal")


if __name__ == "__main__":
    main()
