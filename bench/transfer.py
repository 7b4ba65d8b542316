"""Moving a tensor between two processes: NIXL descriptor vs inline gRPC bytes vs memcpy.

    .venv/bin/python -m bench.transfer [--sizes 1,4,16,64] [--reps 25] [--device cpu|cuda]
        [--out PATH]

A server process holds a float32 tensor per size (as the encoder holds an embedding) and
answers two RPCs over real gRPC on loopback: `Publish` copies the tensor into its NIXL pool
and returns the `TensorDescriptor`, which this process (the worker's role) then fetches;
`Inline` returns the same bytes inside the protobuf reply. Each path is timed from the
request to the tensor in hand, against an in-process torch copy as the ceiling. Sizes are
MiB; the table shows medians. With `--device cuda`, both processes' tensors and NIXL pools
are in GPU memory (VRAM to VRAM, as an encoder and a worker on GPUs move embeddings), and
the ceiling is a device-to-device copy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent import futures
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import torch
from google.protobuf import wrappers_pb2

from prism.proto.stage.v1 import tensor_pb2
from prism.transfer.nixl import NixlTransfer

# NIXL logs INFO lines to stdout, which would land inside the table.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

MiB = 2**20
SERVICE = "prism.bench.TransferBench"
# prism.rpc caps messages at 64 MiB, which a 64 MiB tensor plus framing exceeds.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 512 * MiB),
    ("grpc.max_receive_message_length", 512 * MiB),
]
WARMUP = 2


def source(nbytes: int, device: str) -> torch.Tensor:
    """The same float32 tensor of `nbytes` in both processes, on `device`."""
    generator = torch.Generator().manual_seed(nbytes)
    return torch.randn(nbytes // 4, generator=generator).to(device)


def sync(device: str) -> None:
    """Waits for the device's queued work, so that a time covers it."""
    if device != "cpu":
        torch.cuda.synchronize()


def pool_bytes(sizes: list[int]) -> int:
    return 2 * max(sizes) + 16 * MiB


def serve(sizes: list[int], device: str, conn: Connection) -> None:
    agent = NixlTransfer(pool_bytes=pool_bytes(sizes), device=device)
    tensors = {nbytes: source(nbytes, device) for nbytes in sizes}
    tags = itertools.count()

    def publish(request: wrappers_pb2.UInt64Value, context: grpc.ServicerContext):
        agent.poll()
        return agent.publish(tensors[request.value], f"bench/{next(tags)}")

    def inline(request: wrappers_pb2.UInt64Value, context: grpc.ServicerContext):
        return wrappers_pb2.BytesValue(value=tensors[request.value].cpu().numpy().tobytes())

    def unary(handler: Callable, response_type: type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            handler,
            request_deserializer=wrappers_pb2.UInt64Value.FromString,
            response_serializer=response_type.SerializeToString,
        )

    methods = {
        "Publish": unary(publish, tensor_pb2.TensorDescriptor),
        "Inline": unary(inline, wrappers_pb2.BytesValue),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(2),
        handlers=[grpc.method_handlers_generic_handler(SERVICE, methods)],
        options=GRPC_OPTIONS,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()
    server.stop(0)
    agent.close()
    # The servicer closures outlive this frame in gRPC's threads; a tensor freed there while
    # the interpreter exits aborts it.
    tensors.clear()


def timed(
    runs: dict[str, Callable[[], dict[str, float]]], reps: int
) -> dict[str, dict[str, float]]:
    """Median of each timing each run returns, after warm-up runs.

    The runs take turns, so that they share whatever else the machine is doing.
    """
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for rep in range(WARMUP + reps):
        for name, run in runs.items():
            sample = run()
            if rep >= WARMUP:
                samples[name].append(sample)
    return {
        name: {key: statistics.median(s[key] for s in got) for key in got[0]}
        for name, got in samples.items()
    }


def bench_size(
    nbytes: int, channel: grpc.Channel, agent: NixlTransfer, reps: int, device: str
) -> dict[str, float]:
    expected = source(nbytes, device)
    publish = channel.unary_unary(
        f"/{SERVICE}/Publish",
        request_serializer=wrappers_pb2.UInt64Value.SerializeToString,
        response_deserializer=tensor_pb2.TensorDescriptor.FromString,
    )
    inline = channel.unary_unary(
        f"/{SERVICE}/Inline",
        request_serializer=wrappers_pb2.UInt64Value.SerializeToString,
        response_deserializer=wrappers_pb2.BytesValue.FromString,
    )
    request = wrappers_pb2.UInt64Value(value=nbytes)

    def via_nixl() -> dict[str, float]:
        started = time.perf_counter()
        descriptor = publish(request, timeout=60)
        described = time.perf_counter()
        read_before = agent.stats.transfer_seconds_total
        tensor = agent.fetch(descriptor, timeout_s=60)
        sync(device)
        done = time.perf_counter()
        assert torch.equal(tensor, expected)
        read = agent.stats.transfer_seconds_total - read_before
        return {
            "total": done - started,
            "rpc_publish": described - started,
            "read": read,
            "copy_out": done - described - read,
        }

    def via_inline() -> dict[str, float]:
        started = time.perf_counter()
        reply = inline(request, timeout=60)
        with warnings.catch_warnings():
            # The reply's bytes are read-only; the tensor only reads them.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(reply.value, dtype=torch.float32).to(device)
        sync(device)
        done = time.perf_counter()
        assert torch.equal(tensor, expected)
        return {"total": done - started}

    destination = torch.empty_like(expected)

    def via_memcpy() -> dict[str, float]:
        started = time.perf_counter()
        destination.copy_(expected)
        sync(device)
        return {"total": time.perf_counter() - started}

    def via_clone() -> dict[str, float]:
        started = time.perf_counter()
        expected.clone()
        sync(device)
        return {"total": time.perf_counter() - started}

    timings = timed(
        {"nixl": via_nixl, "inline": via_inline, "memcpy": via_memcpy, "clone": via_clone}, reps
    )
    result: dict[str, float] = {"size_mib": nbytes / MiB, "bytes": nbytes}
    for name in ("nixl", "inline", "memcpy"):
        result[f"{name}_ms"] = timings[name]["total"] * 1e3
        result[f"{name}_gbps"] = nbytes / timings[name]["total"] / 1e9
    nixl = timings["nixl"]
    result["speedup_vs_inline"] = timings["inline"]["total"] / nixl["total"]
    result["fraction_of_memcpy"] = timings["memcpy"]["total"] / nixl["total"]
    for part in ("rpc_publish", "read", "copy_out"):
        result[f"nixl_{part}_ms"] = nixl[part] * 1e3
    result["nixl_read_gbps"] = nbytes / nixl["read"] / 1e9
    # A copy into fresh memory, as fetch's copy-out is: it pays the first-touch page faults.
    result["clone_ms"] = timings["clone"]["total"] * 1e3
    return result


def print_table(results: list[dict[str, float]]) -> None:
    print(
        f"{'MiB':>5} | {'NIXL ms':>8} {'GB/s':>6} | {'inline ms':>9} {'GB/s':>6} | "
        f"{'memcpy ms':>9} {'GB/s':>6} | {'NIXL/inline':>11} | {'NIXL/memcpy':>11}"
    )
    for r in results:
        print(
            f"{r['size_mib']:>5g} | {r['nixl_ms']:>8.2f} {r['nixl_gbps']:>6.2f} | "
            f"{r['inline_ms']:>9.2f} {r['inline_gbps']:>6.2f} | "
            f"{r['memcpy_ms']:>9.2f} {r['memcpy_gbps']:>6.2f} | "
            f"{r['speedup_vs_inline']:>10.1f}x | {100 * r['fraction_of_memcpy']:>10.0f}%"
        )
    print(
        "\nNIXL path, median ms: gRPC call with the owner's copy into its pool | READ | "
        "copy-out to a fresh tensor | for reference, an in-process clone"
    )
    for r in results:
        print(
            f"{r['size_mib']:>5g} | {r['nixl_rpc_publish_ms']:>8.2f} | "
            f"{r['nixl_read_ms']:>8.2f} ({r['nixl_read_gbps']:.2f} GB/s) | "
            f"{r['nixl_copy_out_ms']:>8.2f} | {r['clone_ms']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="tensor sizes in MiB")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--device", default="cpu", help="where the tensors and pools live")
    parser.add_argument("--out", type=Path, default=Path("bench/results/transfer.json"))
    args = parser.parse_args()
    if "OMP_WAIT_POLICY" not in os.environ:
        # torch's OpenMP workers spin for milliseconds after every parallel copy: on a 2-core
        # host that takes the other process's core and makes every path jittery. OpenMP reads
        # the policy once, when torch loads, hence the restart.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=serve, args=(sizes, args.device, theirs))
    server.start()
    try:
        if not ours.poll(120):
            raise RuntimeError("the server process did not start")
        port = ours.recv()
        with (
            NixlTransfer(pool_bytes=pool_bytes(sizes), device=args.device) as agent,
            grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel,
        ):
            results = [
                bench_size(nbytes, channel, agent, args.reps, args.device) for nbytes in sizes
            ]
    finally:
        ours.send("stop")
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join()

    print_table(results)
    import nixl

    report = {
        "reps": args.reps,
        "warmup": WARMUP,
        "statistic": "median",
        "device": args.device,
        "host": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "torch": torch.__version__,
            "nixl_module": nixl._api.__name__,
            "UCX_TLS": os.environ.get("UCX_TLS"),
            "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
