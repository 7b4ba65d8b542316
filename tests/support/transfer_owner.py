"""The owner side of tests/contract/test_transfer_between_processes.py: a NixlTransfer in
its own OS process; and the tensor helpers of both sides' tests.

Reads one JSON request per line on stdin and answers one JSON line on stdout; descriptors
travel as base64 of the serialized protobuf, as they would inside a mesh message.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from dataclasses import asdict

import torch

from prism.proto.stage.v1 import tensor_pb2

FLOATS = {"float32", "float16", "bfloat16", "float64"}


def make_tensor(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    """The same tensor in every process for the same arguments."""
    generator = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        return torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    values = torch.randint(-(2**40), 2**40, shape, generator=generator, dtype=torch.int64)
    return values.to(getattr(torch, dtype))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def parse(wire: bytes) -> tensor_pb2.TensorDescriptor:
    descriptor = tensor_pb2.TensorDescriptor()
    descriptor.ParseFromString(wire)
    return descriptor


def main() -> None:
    # UCX logs to stdout: keep the real stdout for replies and send fd 1 to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    from prism.transfer.nixl import NixlTransfer

    agent = NixlTransfer(pool_bytes=64 * 2**20, lease_s=30.0)

    def reply(**fields: object) -> None:
        replies.write(json.dumps(fields) + "\n")

    reply(ready=agent.name)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "publish":
                tensor = make_tensor(request["dtype"], request["shape"], request["seed"])
                descriptor = agent.publish(tensor, request["tag"], request.get("lease_s"))
                reply(descriptor=base64.b64encode(descriptor.SerializeToString()).decode())
            elif op == "stats":
                agent.poll()
                reply(**asdict(agent.stats))
            elif op == "exit":
                agent.close()
                reply(closed=True)
                return
            else:
                reply(error=f"unknown op {op!r}")
        except Exception as exc:
            reply(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
