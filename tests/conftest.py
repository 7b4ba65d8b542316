"""Three lanes: tests/unit (pure logic and in-process servers: no engine, no subprocess, no
torch or vLLM; `make test-unit`, tests/support/unit_lane.py), tests/contract (each RPC and
wire contract against real server processes, and the code that needs torch or vLLM
in-process) and tests/e2e (meshes of real processes). What they share is in tests/support:
the fixtures (fixtures.py), the cases and the oracle (cases.py), meshes (meshes.py).
"""

from __future__ import annotations

import os

# Before grpc: importing prism turns gRPC's fork handlers off, and only takes effect if
# grpc is not yet loaded (prism/__init__.py).
import prism  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The unit lane's rules (no process, no torch, no vLLM), and the fixtures the lanes share.
pytest_plugins = ["support.unit_lane", "support.fixtures"]
