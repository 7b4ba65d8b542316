"""prism.transfer: the pool allocator, and real NIXL reads between two OS processes.

The owner runs in tests/transfer_owner.py (its own process); this process is the reader.
"""

from __future__ import annotations

import base64
import ctypes
import json
import queue
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transfer_owner import make_tensor

from prism.transfer import PoolAllocator, TransferAgent, TransferError, nixl_agent
from prism.v1 import common_pb2

pytestmark = pytest.mark.timeout(120)

OWNER = Path(__file__).with_name("transfer_owner.py")


class Owner:
    """A TransferAgent in a child process, driven over stdin/stdout."""

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
            raise RuntimeError(f"owner exited with {self.proc.wait()}")
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


def parse(wire: bytes) -> common_pb2.TensorDescriptor:
    descriptor = common_pb2.TensorDescriptor()
    descriptor.ParseFromString(wire)
    return descriptor


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.fixture(scope="module")
def owner():
    process = Owner()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def reader():
    with TransferAgent(pool_bytes=64 * 2**20) as agent:
        yield agent


# --- allocator -------------------------------------------------------------------------


def test_allocator_aligns_and_fills_first_fit():
    pool = PoolAllocator(1000, alignment=64)
    assert pool.size == 960
    a, b, c = pool.alloc(1), pool.alloc(65), pool.alloc(64)
    assert (a, b, c) == (0, 64, 192)
    assert pool.bytes_in_use == 256
    pool.free(b)
    assert pool.alloc(100) == 64  # first fit reuses the hole
    assert pool.alloc(10) == 256


def test_allocator_coalesces_and_reports_full():
    pool = PoolAllocator(4096, alignment=64)
    blocks = [pool.alloc(1024) for _ in range(4)]
    assert blocks == [0, 1024, 2048, 3072]
    assert pool.alloc(1) is None
    for offset in (1024, 3072, 2048, 0):  # middle, end, then the gaps between
        pool.free(offset)
    assert pool.bytes_in_use == 0
    assert pool.largest_free == 4096
    assert pool.alloc(4096) == 0
    assert pool.alloc(1) is None


def test_allocator_rejects_misuse():
    pool = PoolAllocator(4096)
    with pytest.raises(ValueError):
        pool.free(0)
    with pytest.raises(ValueError):
        pool.alloc(0)
    with pytest.raises(ValueError):
        PoolAllocator(4096, alignment=48)
    assert pool.alloc(5000) is None


# --- one process ------------------------------------------------------------------------


def test_missing_nixl_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(TransferError, match="NIXL is not installed"):
        TransferAgent(pool_bytes=2**20)


def test_loopback_read_is_released_by_its_notification():
    with TransferAgent(pool_bytes=4 * 2**20) as agent:
        tensor = make_tensor("bfloat16", [300, 1024], seed=1)
        descriptor = agent.publish(tensor, "loop/0")
        with pytest.raises(TransferError, match="tag 'loop/0' is already published"):
            agent.publish(tensor, "loop/0")
        # The agent reads from itself: data and notification both go through NIXL.
        assert same_bytes(agent.fetch(descriptor), tensor)
        deadline = time.monotonic() + 10
        while agent.pool_bytes_in_use:
            assert time.monotonic() < deadline
            agent.poll()
            time.sleep(0.01)
        assert (agent.stats.released, agent.stats.transfers) == (1, 1)


def test_full_pool_reclaims_expired_leases_before_failing():
    with TransferAgent(pool_bytes=2**20) as agent:
        big = make_tensor("float32", [600, 256], seed=2)  # 600 KiB: one fits, two do not
        agent.publish(big, "full/0", lease_s=0.3)
        with pytest.raises(TransferError, match="pool full"):
            agent.publish(big, "full/1")
        time.sleep(0.4)
        agent.publish(big, "full/1")
        assert agent.stats.reclaimed == 1


def test_idle_agent_does_not_spin(reader):
    # NIXL's default progress thread busy-polls a whole core; ours sleeps on UCX's event fd.
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu < 0.5


def test_vllms_nixl_agent_is_made_not_to_spin():
    """vLLM's KV connector builds its NIXL agent (with its own config) through
    `nixl_agent`, once the engine process imports Prism's engine extension."""
    import nixl
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    import prism.services.engine_extension  # noqa: F401

    assert base_worker.NixlWrapper is nixl_agent
    agent = nixl_agent("vllm-like", nixl.nixl_agent_config(num_threads=4, capture_telemetry=True))
    assert "UCX" in agent.backends
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime < 0.5


def test_threads_made_under_timer_slack_get_it_and_their_maker_keeps_its_own():
    """vLLM's gloo groups, made once the engine process imports Prism's engine extension,
    start their threads under 50 ms of timer slack; the engine's own thread keeps its."""
    import torch.distributed

    from prism.services.engine_extension import GLOO_TIMER_SLACK_NS, timer_slack

    prctl = ctypes.CDLL(None).prctl

    def slack() -> int:
        return prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK

    own = slack()
    seen: list[int] = []
    with timer_slack(GLOO_TIMER_SLACK_NS):
        thread = threading.Thread(target=lambda: seen.append(slack()))
        thread.start()
    thread.join()
    assert seen == [GLOO_TIMER_SLACK_NS] != [own]
    assert slack() == own
    for make in (torch.distributed.new_group, torch.distributed.init_process_group):
        assert make.__code__.co_name == "made_with_slack"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.shape.append(2), "bytes but its regions hold"),
        (lambda d: setattr(d, "dtype", "complex32"), "unknown dtype"),
        (lambda d: setattr(d, "memory_type", common_pb2.MEMORY_TYPE_VRAM), "only DRAM"),
        (lambda d: d.ClearField("regions"), "memory regions"),
        (lambda d: setattr(d, "lease_expiry_unix_ms", 1), "lease expired"),
        (lambda d: setattr(d, "notification_tag", ""), "notification tag"),
    ],
)
def test_malformed_descriptor_is_rejected_before_any_read(reader, change, message):
    descriptor = common_pb2.TensorDescriptor(
        agent_name="prism-elsewhere",
        agent_metadata=b"never loaded: validation comes first",
        memory_type=common_pb2.MEMORY_TYPE_DRAM,
        regions=[common_pb2.MemoryRegion(address=4096, length=24)],
        dtype="float32",
        shape=[2, 3],
        notification_tag="bad/0",
        lease_expiry_unix_ms=int((time.time() + 60) * 1000),
    )
    change(descriptor)
    before = reader.stats
    with pytest.raises(TransferError, match=message):
        reader.fetch(parse(descriptor.SerializeToString()))
    assert reader.stats == before


# --- two processes ----------------------------------------------------------------------

CASES = [
    ("float32", [4, 1024]),
    ("bfloat16", [3, 577, 64]),
    ("int64", [7]),
    ("float16", []),
    ("bool", [5, 3]),
    ("float32", [1, 2048, 1024]),  # 8 MiB
]


def test_round_trip_between_processes_frees_owner_memory(owner, reader):
    wires = [
        owner.publish(f"rt/{i}", dtype, shape, seed=i) for i, (dtype, shape) in enumerate(CASES)
    ]
    assert owner.call(op="stats")["pool_bytes_in_use"] > 8 * 2**20
    for i, ((dtype, shape), wire) in enumerate(zip(CASES, wires, strict=True)):
        descriptor = parse(wire)
        assert descriptor.agent_name == owner.name
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
    # Once with the connection the reader already had, once reconnecting from scratch.
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(TransferError, match=doomed.name):
            reader.fetch(parse(second), timeout_s=5)
        assert time.monotonic() - started < 5.5
    assert reader.pool_bytes_in_use == 0

    wire = owner.publish("after/0", "int64", [3, 3], seed=9)
    assert same_bytes(reader.fetch(parse(wire)), make_tensor("int64", [3, 3], 9))
    owner.wait_stats(lambda s: s["pool_bytes_in_use"] == 0)
