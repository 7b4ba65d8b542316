"""prism.transfer between two OS processes: real NIXL reads, leases and a lost owner.

The owner runs in tests/support/transfer_owner.py (its own process); this process is the reader.
"""

from __future__ import annotations

import base64
import json
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.transfer_owner import make_tensor, parse, same_bytes

from prism.transfer import TransferError

pytestmark = pytest.mark.timeout(120)

OWNER = Path(__file__).parent.parent / "support" / "transfer_owner.py"

CASES = [
    ("float32", [4, 1024]),
    ("bfloat16", [3, 577, 64]),
    ("int64", [7]),
    ("float16", []),
    ("bool", [5, 3]),
    ("float32", [1, 2048, 1024]),  # 8 MiB
]


class Owner:
    """A NixlTransfer in a child process, driven over stdin/stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(OWNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=OWNER.parent.parent,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.name = self._reply(timeout=90)["ready"]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float = 30) -> dict:
        line = self._lines.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"owner exited with {self.proc.wait(timeout=30)}")
        return json.loads(line)

    def call(self, **request: object) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        assert "error" not in reply, reply["error"]
        return reply

    def publish(self, tag: str, dtype: str, shape: list[int], seed: int, **kw: object) -> bytes:
        reply = self.call(op="publish", tag=tag, dtype=dtype, shape=shape, seed=seed, **kw)
        return base64.b64decode(reply["descriptor"])

    def wait_stats(self, until, timeout: float = 15) -> dict:
        """Polls the owner's stats until `until(stats)` holds."""
        deadline = time.monotonic() + timeout
        while not until(stats := self.call(op="stats")):
            assert time.monotonic() < deadline, f"owner stats stuck at {stats}"
            time.sleep(0.05)
        return stats

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=15)
            except Exception:
                self.kill()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def owner():
    process = Owner()
    yield process
    process.stop()


def test_round_trip_between_processes_frees_owner_memory(owner, reader):
    wires = [
        owner.publish(f"rt/{i}", dtype, shape, seed=i) for i, (dtype, shape) in enumerate(CASES)
    ]
    assert owner.call(op="stats")["pool_bytes_in_use"] > 8 * 2**20
    for i, ((dtype, shape), wire) in enumerate(zip(CASES, wires, strict=True)):
        descriptor = parse(wire)
        assert descriptor.nixl.agent_name == owner.name
        assert same_bytes(reader.fetch(descriptor, timeout_s=30), make_tensor(dtype, shape, i))
    stats = owner.wait_stats(lambda s: s["pool_bytes_in_use"] == 0)
    assert stats["released"] >= len(CASES) and stats["reclaimed"] == 0


def test_concurrent_fetches(owner, reader):
    wires = [owner.publish(f"cc/{i}", "float32", [256, 512], seed=100 + i) for i in range(8)]
    before = reader.stats
    with ThreadPoolExecutor(4) as pool:
        tensors = list(pool.map(lambda w: reader.fetch(parse(w), timeout_s=30), wires))
    for i, tensor in enumerate(tensors):
        assert same_bytes(tensor, make_tensor("float32", [256, 512], 100 + i))
    assert reader.stats.transfers == before.transfers + 8
    assert reader.stats.bytes_moved == before.bytes_moved + 8 * 256 * 512 * 4
    assert reader.pool_bytes_in_use == 0
    owner.wait_stats(lambda s: s["pool_bytes_in_use"] == 0)


def test_unread_descriptor_is_reclaimed_after_its_lease(owner, reader):
    reclaimed = owner.call(op="stats")["reclaimed"]
    wire = owner.publish("lease/0", "float32", [1000], seed=7, lease_s=0.5)
    assert owner.call(op="stats")["pool_bytes_in_use"] > 0
    stats = owner.wait_stats(lambda s: s["pool_bytes_in_use"] == 0)
    assert stats["reclaimed"] == reclaimed + 1
    with pytest.raises(TransferError, match="lease expired"):
        reader.fetch(parse(wire))


def test_owner_gone_fails_fast_and_reader_recovers(owner, reader):
    doomed = Owner()
    try:
        first = doomed.publish("gone/0", "float32", [64], seed=1)
        second = doomed.publish("gone/1", "float32", [64], seed=2)
        assert same_bytes(reader.fetch(parse(first)), make_tensor("float32", [64], 1))
    finally:
        doomed.kill()
        doomed.stop()
    # Once with the connection the reader already had, once reconnecting from scratch: each
    # fails as the owner is gone, not by waiting out the read's deadline.
    for _ in range(2):
        with pytest.raises(TransferError, match=doomed.name) as failed:
            reader.fetch(parse(second), timeout_s=60)
        assert "no completion within" not in str(failed.value)
    assert reader.pool_bytes_in_use == 0

    wire = owner.publish("after/0", "int64", [3, 3], seed=9)
    assert same_bytes(reader.fetch(parse(wire)), make_tensor("int64", [3, 3], 9))
    owner.wait_stats(lambda s: s["pool_bytes_in_use"] == 0)
