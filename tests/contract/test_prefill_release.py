"""A prefill worker frees the KV its engine holds for a decode that will not come: after an
Abort, and when its call is cut short in the moment after the engine finished the prompt,
before the worker read that output (no processes: a stand-in for vLLM's engine and its
NIXL connector's lease book)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from prism.engine.extension import held_kv, is_engine_id, release_kv
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2
from prism.services.worker.roles import Prefill
from prism.services.worker.servicer import EngineServicer


def test_a_request_is_known_by_the_id_vllm_runs_it_under():
    assert is_engine_id("req-1-0a1b2c3d", "req-1")
    assert is_engine_id("req-1", "req-1")  # vLLM told not to add its suffix
    assert not is_engine_id("req-1-0a1b2c3d", "req")
    assert not is_engine_id("req-10-0a1b2c3d", "req-1")
    assert not is_engine_id("req-1-migrated-1-0a1b2c3d", "req-1")


def test_release_ends_the_lease_of_every_run_and_waits_for_one_still_running():
    processing = {"a-00000001", "a-00000002", "b-00000003"}
    leases = {"a-00000001": 99.0, "b-00000003": 99.0}
    # One run of `a` holds blocks, the other is still running: its end is not known yet.
    assert release_kv(processing, leases, "a") == "pending"
    assert leases == {"a-00000001": 0.0, "b-00000003": 99.0}
    processing.discard("a-00000002")
    assert release_kv(processing, leases, "a") == "released"
    assert release_kv(processing, leases, "c") == "gone"


class Engine:
    """vLLM's `AsyncLLM` as a prefill worker uses it: a request's blocks are leased when it
    finishes, and `prism_release_kv` ends the lease."""

    def __init__(self) -> None:
        self.processing: set[str] = set()
        self.leases: dict[str, float] = {}
        self.finished = asyncio.Event()
        # Whether the worker reads the finished output, or is cut short before it does.
        self.deliver = True

    async def generate(self, prompt, params, request_id: str, lora_request=None):
        engine_id = f"{request_id}-0a1b2c3d"
        self.processing.add(engine_id)
        await asyncio.sleep(0)
        self.leases[engine_id] = 30.0
        self.finished.set()
        if not self.deliver:
            await asyncio.Event().wait()
        output = SimpleNamespace(
            token_ids=[7], logprobs=None, finish_reason="length", text="",
        )  # fmt: skip
        yield SimpleNamespace(
            outputs=[output], prompt_token_ids=prompt["prompt_token_ids"], num_cached_tokens=0,
            prompt_logprobs=None, finished=True,
            kv_transfer_params={"do_remote_prefill": True, "remote_request_id": engine_id},
        )  # fmt: skip

    async def abort(self, request_id: str) -> None:
        """A request that has finished is no longer the engine's to abort."""

    async def collective_rpc(self, method: str, args: tuple) -> list:
        if method == "prism_kv_held":
            return [held_kv(self.processing, *args)]
        assert method == "prism_release_kv"
        return [release_kv(self.processing, self.leases, *args)]

    def read_by_decode(self, engine_id: str) -> None:
        """A decode read the blocks: the connector lets go of the request."""
        self.processing.discard(engine_id)
        self.leases.pop(engine_id, None)


def request(request_id: str) -> engine_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0)
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7], sampling=sampling
    )


def prefill() -> tuple[Engine, Prefill, EngineServicer]:
    engine = Engine()
    role = Prefill(engine, kv_lease_s=30)
    return engine, role, EngineServicer(engine, role)


async def released(role: Prefill) -> None:
    while role._releases:
        await asyncio.gather(*role._releases)
        # A finished task leaves the set in a done callback, which runs at the loop's next
        # turn: gathering tasks already done need not yield (Python 3.12 does not).
        await asyncio.sleep(0)


def test_a_call_cut_short_after_the_engine_finished_frees_its_kv():
    async def main() -> None:
        engine, role, servicer = prefill()
        engine.deliver = False

        async def read() -> None:
            async for _ in servicer.generate(request("r1")):
                pass

        call = asyncio.create_task(read())
        await engine.finished.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await released(role)
        assert engine.leases == {"r1-0a1b2c3d": 0.0}

    asyncio.run(main())


def test_an_abort_frees_the_kv_held_for_decode():
    async def main() -> None:
        engine, role, servicer = prefill()
        replies = [reply async for reply in servicer.generate(request("r2"))]
        assert replies[-1].last.kv_transfer_params.remote_request_id == "r2-0a1b2c3d"
        assert engine.leases == {"r2-0a1b2c3d": 30.0}
        abort = await servicer.abort(engine_pb2.EngineServiceAbortRequest(request_id="r2"))
        assert abort.aborted
        await released(role)
        assert engine.leases == {"r2-0a1b2c3d": 0.0}
        # Once freed, it is not held any more.
        again = await servicer.abort(engine_pb2.EngineServiceAbortRequest(request_id="r2"))
        assert not again.aborted

    asyncio.run(main())


def test_a_completed_call_keeps_its_kv_for_decode():
    async def main() -> None:
        engine, role, servicer = prefill()
        async for _ in servicer.generate(request("r3")):
            pass
        await released(role)
        assert engine.leases == {"r3-0a1b2c3d": 30.0}

    asyncio.run(main())


def test_held_kv_names_the_requests_whose_blocks_await_a_decode():
    processing = {"a-00000001", "b-00000002"}
    assert held_kv(processing, ["a", "c", "b"]) == ["a", "b"]
    assert held_kv(set(), ["a"]) == []


@pytest.mark.parametrize("collected", ["read by a decode", "its lease ended"])
def test_a_drained_prefill_is_idle_once_what_it_holds_is_collected(collected: str):
    """A prefill scaled down lives on until a decode has read each prompt's KV it handed
    off (or the lease ended): else the decode's read finds it gone."""

    async def main() -> bool:
        engine, role, servicer = prefill()
        async for _ in servicer.generate(request("r5")):
            pass
        servicer.service.drain()
        idle = asyncio.ensure_future(servicer.service.idle())
        await asyncio.sleep(0.2)
        holding = not idle.done()
        if collected == "read by a decode":
            engine.read_by_decode("r5-0a1b2c3d")
        else:
            role._held["r5"] = time.monotonic()
        await asyncio.wait_for(idle, 2)
        return holding

    assert asyncio.run(main())


def test_a_prefill_whose_engine_died_holds_nothing_to_wait_for():
    async def main() -> tuple[bool, bool]:
        engine, role, servicer = prefill()
        async for _ in servicer.generate(request("r7")):
            pass
        before = await role.holding()

        async def dead(method: str, args: tuple) -> list:
            raise RuntimeError("the engine core died")

        engine.collective_rpc = dead
        return before, await role.holding()

    assert asyncio.run(main()) == (True, False)
