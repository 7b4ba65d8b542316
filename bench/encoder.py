"""The encoder's throughput with and without batching across requests.

    .venv/bin/python -m bench.encoder --model DIR [--concurrency 32] [--requests 256]
        [--image-size 336] [--device auto] [--rounds 3] [--out bench/results/encoder.json]

Starts `prism encoder` on the model twice, as a separate process each time: with
`--batch-size 1` (each request's image is one forward pass, as before batching) and with
`--batch-size` equal to the concurrency. Each round sends `--requests` one-image `Encode`
calls, every image new (the cache never answers), `--concurrency` at a time over gRPC, and
times them from the first call to the last answer. The settings take turns round by round,
so that they share whatever else the machine is doing; the report has the medians.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import PIL.Image
import torch

from prism.proto.stage.v1 import encoder_pb2, encoder_pb2_grpc
from prism.proto.v1 import common_pb2
from prism.rpc.channel import check_health, sync_channel
from prism.runtime.ports import free_port


def image(seed: int, size: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


class Encoder:
    def __init__(self, model: str, device: str, batch_size: int, wait_ms: float) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prism.cli", "--log-level", "warning", "encoder",
             "--model", model, "--port", str(self.port), "--device", device,
             "--batch-size", str(batch_size), "--batch-wait-ms", str(wait_ms),
             "--lease-s", "2", "--pool-mib", "1024", "--max-in-flight", "0"],
        )  # fmt: skip
        address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while not check_health(address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the encoder (batch size {batch_size}) did not start")
            time.sleep(0.5)
        self.stub = encoder_pb2_grpc.EncoderServiceStub(sync_channel(address))

    def encode(self, data: bytes, request_id: str) -> float:
        started = time.perf_counter()
        request = encoder_pb2.EncodeRequest(
            request_id=request_id, images=[common_pb2.Image(data=data, mime_type="image/png")]
        )
        reply = self.stub.Encode(request, timeout=600)
        assert len(reply.embeddings.images) == 1 and not reply.embeddings.images[0].cached
        return time.perf_counter() - started

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def run_round(
    encoder: Encoder, images: list[bytes], concurrency: int, name: str
) -> dict[str, float]:
    with ThreadPoolExecutor(concurrency) as pool:
        started = time.perf_counter()
        latencies = list(
            pool.map(lambda i: encoder.encode(images[i], f"{name}-{i}"), range(len(images)))
        )
        elapsed = time.perf_counter() - started
    return {
        "images_per_s": len(images) / elapsed,
        "latency_p50_ms": statistics.median(latencies) * 1e3,
        "latency_max_ms": max(latencies) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=336, help="pixels a side")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--wait-ms", type=float, default=5.0, help="the batched encoder's wait")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/encoder.json"))
    args = parser.parse_args()

    settings = {"unbatched": 1, "batched": args.concurrency}
    encoders = {
        name: Encoder(args.model, args.device, size, args.wait_ms)
        for name, size in settings.items()
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    seed = 0
    try:
        for name, encoder in encoders.items():  # warm-up: first passes allocate
            run_round(encoder, [image(-1 - i, args.image_size) for i in range(8)], 8, name)
        for _ in range(args.rounds):
            for name, encoder in encoders.items():
                images = [image(seed + i, args.image_size) for i in range(args.requests)]
                seed += args.requests
                samples[name].append(run_round(encoder, images, args.concurrency, name))
                print(name, samples[name][-1], flush=True)
    finally:
        for encoder in encoders.values():
            encoder.stop()
    medians = {
        name: {key: statistics.median(s[key] for s in got) for key in got[0]}
        for name, got in samples.items()
    }
    report = {
        "model": args.model,
        "device": args.device,
        "concurrency": args.concurrency,
        "requests_per_round": args.requests,
        "image_size": args.image_size,
        "batch_wait_ms": args.wait_ms,
        "rounds": args.rounds,
        "statistic": "median",
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "torch": torch.__version__,
                 "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "results": medians,
        "batched_over_unbatched": (
            medians["batched"]["images_per_s"] / medians["unbatched"]["images_per_s"]
        ),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, result in medians.items():
        print(f"{name:>9}: {result['images_per_s']:.1f} images/s, "
              f"p50 {result['latency_p50_ms']:.0f} ms")  # fmt: skip
    print(f"batched / unbatched: {report['batched_over_unbatched']:.2f}x\nwrote {args.out}")


if __name__ == "__main__":
    main()
