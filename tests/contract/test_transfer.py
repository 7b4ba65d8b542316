"""prism.transfer in one process: the pool allocator, NIXL reads from itself, leases,
idle agents and malformed descriptors (between two processes:
test_transfer_between_processes.py)."""

from __future__ import annotations

import ctypes
import resource
import sys
import threading
import time

import nixl
import pytest
import torch
from support.transfer_owner import make_tensor, parse, same_bytes
from support.waiting import wait_for

# With Prism's engine extension imported, vLLM's connector makes Prism's NIXL agent, as it
# does in an engine process.
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # isort: skip

from prism.engine.extension import GLOO_TIMER_SLACK_NS, timer_slack
from prism.proto.stage.v1 import tensor_pb2
from prism.transfer import TransferError, open_transfer
from prism.transfer.inline import InlineTransfer
from prism.transfer.nixl import NixlTransfer, PoolAllocator
from prism.transfer.nixl_compat import nixl_agent

pytestmark = pytest.mark.timeout(120)


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
        NixlTransfer(pool_bytes=2**20)


def test_loopback_read_is_released_by_its_notification():
    with NixlTransfer(pool_bytes=4 * 2**20) as agent:
        tensor = make_tensor("bfloat16", [300, 1024], seed=1)
        descriptor = agent.publish(tensor, "loop/0")
        with pytest.raises(TransferError, match="tag 'loop/0' is already published"):
            agent.publish(tensor, "loop/0")
        # The agent reads from itself: data and notification both go through NIXL.
        assert same_bytes(agent.fetch(descriptor), tensor)

        def released() -> bool:
            agent.poll()
            return not agent.pool_bytes_in_use

        assert wait_for(released, timeout=10, period=0.01)
        assert (agent.stats.released, agent.stats.transfers) == (1, 1)


def test_full_pool_reclaims_expired_leases_before_failing():
    with NixlTransfer(pool_bytes=2**20) as agent:
        big = make_tensor("float32", [600, 256], seed=2)  # 600 KiB: one fits, two do not
        agent.publish(big, "full/0", lease_s=0.3)
        with pytest.raises(TransferError, match="pool full"):
            agent.publish(big, "full/1")
        time.sleep(0.4)  # past the 0.3 s lease, on purpose: time the agent measures
        agent.publish(big, "full/1")
        assert agent.stats.reclaimed == 1


def test_idle_agent_does_not_spin(reader):
    # NIXL's default progress thread busy-polls a whole core; ours sleeps on UCX's event fd.
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)  # idle time, on purpose: the CPU spent in it is what is checked
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu < 0.5


def test_vllms_nixl_agent_is_made_not_to_spin():
    """vLLM's KV connector builds its NIXL agent (with its own config) through
    `nixl_agent`, once the engine process imports Prism's engine extension."""
    assert base_worker.NixlWrapper is nixl_agent
    agent = nixl_agent("vllm-like", nixl.nixl_agent_config(num_threads=4, capture_telemetry=True))
    assert "UCX" in agent.backends
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)  # idle time, on purpose: the CPU spent in it is what is checked
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime < 0.5


def test_threads_made_under_timer_slack_get_it_and_their_maker_keeps_its_own():
    """vLLM's gloo groups, made once the engine process imports Prism's engine extension,
    start their threads under 50 ms of timer slack; the engine's own thread keeps its."""
    import torch.distributed

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
        (lambda d: setattr(d.nixl, "memory_type", 0), "not DRAM or VRAM"),
        (lambda d: d.nixl.ClearField("regions"), "memory regions"),
        (lambda d: setattr(d.nixl, "lease_expiry_unix_ms", 1), "lease expired"),
        (lambda d: setattr(d.nixl, "notification_tag", ""), "notification tag"),
    ],
)
def test_malformed_descriptor_is_rejected_before_any_read(reader, change, message):
    location = tensor_pb2.NixlLocation(
        agent_name="prism-elsewhere",
        agent_metadata=b"never loaded: validation comes first",
        memory_type=tensor_pb2.MEMORY_TYPE_DRAM,
        regions=[tensor_pb2.MemoryRegion(address=4096, length=24)],
        notification_tag="bad/0",
        lease_expiry_unix_ms=int((time.time() + 60) * 1000),
    )
    descriptor = tensor_pb2.TensorDescriptor(dtype="float32", shape=[2, 3], nixl=location)
    change(descriptor)
    before = reader.stats
    with pytest.raises(TransferError, match=message):
        reader.fetch(parse(descriptor.SerializeToString()))
    assert reader.stats == before


# --- inline ------------------------------------------------------------------------------

INLINE_CASES = [("float32", [3, 5]), ("bfloat16", [4, 2, 3]), ("int64", [7]), ("uint8", [2, 2])]


def test_inline_tensors_travel_in_their_descriptor_and_any_reader_reads_them(reader):
    owner, inline_reader = open_transfer("inline", 0), InlineTransfer()
    for i, (dtype, shape) in enumerate(INLINE_CASES):
        tensor = make_tensor(dtype, shape, seed=i)
        wire = owner.publish(tensor, f"inline/{i}").SerializeToString()
        for reading in (inline_reader, reader):
            descriptor = parse(wire)
            assert descriptor.WhichOneof("location") == "inline_data"
            assert same_bytes(reading.fetch(descriptor), tensor)
    # Nothing is held for the reader: nothing to free, poll or lease.
    assert (owner.pool_bytes_in_use, owner.poll(), owner.stats.published) == (0, 0, 4)
    assert (inline_reader.stats.transfers, inline_reader.stats.bytes_moved) == (4, 60 + 48 + 56 + 4)


def test_an_inline_reader_refuses_what_it_cannot_read(reader):
    inline = InlineTransfer()
    held = reader.publish(torch.ones(4), "held/0")
    try:
        with pytest.raises(TransferError, match="inline tensors only"):
            inline.fetch(held)
    finally:
        reader.fetch(held)  # read it back here, which frees it
    short = tensor_pb2.TensorDescriptor(dtype="float32", shape=[2, 3], inline_data=b"\0" * 20)
    with pytest.raises(TransferError, match="24 bytes, but 20 came"):
        inline.fetch(short)
    with pytest.raises(TransferError, match="unknown dtype"):
        inline.fetch(tensor_pb2.TensorDescriptor(dtype="complex32", shape=[1], inline_data=b"x"))
    with pytest.raises(ValueError, match="choose from nixl, inline"):
        open_transfer("carrier-pigeon", 0)
