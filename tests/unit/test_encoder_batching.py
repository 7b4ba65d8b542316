"""The encoder's batcher: concurrent items share forward passes, repeats in flight are
encoded once, one bad item fails alone, and a caller that leaves takes nothing with it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from prism.services.encoder.batching import Batcher


class Recorder:
    """An `encode` that records each batch it is given, optionally held until released."""

    def __init__(self, bad: bytes = b"") -> None:
        self.batches: list[list[bytes]] = []
        self.bad = bad
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def __call__(self, items: Sequence[bytes]) -> list[str]:
        self.entered.set()
        self.release.wait(5)
        self.batches.append(list(items))
        if self.bad in items:
            raise ValueError(f"cannot encode {self.bad!r}")
        return [item.decode().upper() for item in items]


def test_concurrent_items_share_one_pass_and_a_full_batch_goes_at_once():
    async def main() -> None:
        encode = Recorder()
        # A wait far longer than the test: the batches go because they are full.
        batcher = Batcher(encode, max_items=4, wait_s=60)
        items = [f"i{n}".encode() for n in range(8)]
        results = await asyncio.gather(*(batcher.submit(i.decode(), i) for i in items))
        assert results == [i.decode().upper() for i in items]
        assert encode.batches == [items[:4], items[4:]]

    asyncio.run(main())


def test_an_item_alone_waits_only_the_window():
    async def main() -> None:
        encode = Recorder()
        batcher = Batcher(encode, max_items=32, wait_s=0.01)
        assert await asyncio.wait_for(batcher.submit("a", b"a"), 5) == "A"
        assert encode.batches == [[b"a"]]

    asyncio.run(main())


def test_an_item_in_flight_is_encoded_once_and_given_to_every_caller():
    async def main() -> None:
        encode = Recorder()
        encode.release.clear()
        seen: list[tuple[str, str]] = []
        batcher = Batcher(encode, 8, 0.005, on_result=lambda key, r: seen.append((key, r)))
        waiting = [asyncio.create_task(batcher.submit("same", b"x")) for _ in range(5)]
        assert await asyncio.to_thread(encode.entered.wait, 5)
        # Running now; another request for the same item joins it rather than queueing.
        waiting.append(asyncio.create_task(batcher.submit("same", b"x")))
        await asyncio.sleep(0.01)
        encode.release.set()
        assert await asyncio.gather(*waiting) == ["X"] * 6
        assert encode.batches == [[b"x"]]
        # The result is handed over (to the cache) once, before anyone is answered.
        assert seen == [("same", "X")]
        assert batcher.in_flight == 0

    asyncio.run(main())


def test_items_arriving_during_a_pass_form_the_next_batch():
    async def main() -> None:
        encode = Recorder()
        encode.release.clear()
        batcher = Batcher(encode, 16, 0.005)
        first = asyncio.create_task(batcher.submit("a", b"a"))
        assert await asyncio.to_thread(encode.entered.wait, 5)
        later = [asyncio.create_task(batcher.submit(k, k.encode())) for k in "bcd"]
        await asyncio.sleep(0.01)
        encode.release.set()
        assert await asyncio.gather(first, *later) == ["A", "B", "C", "D"]
        assert encode.batches == [[b"a"], [b"b", b"c", b"d"]]

    asyncio.run(main())


def test_a_bad_item_fails_alone():
    async def main() -> None:
        encode = Recorder(bad=b"bad")
        passes: list[int] = []
        batcher = Batcher(encode, 3, 0.05, on_batch=passes.append)
        outcomes = await asyncio.gather(
            *(batcher.submit(k, k.encode()) for k in ("a", "bad", "c")), return_exceptions=True
        )
        assert outcomes[0] == "A" and outcomes[2] == "C"
        assert isinstance(outcomes[1], ValueError)
        # The batch, then each item of it on its own.
        assert encode.batches == [[b"a", b"bad", b"c"], [b"a"], [b"bad"], [b"c"]]
        # Every forward pass is counted, the retries' too.
        assert passes == [3, 1, 1, 1]
        # A failure is not kept: the item is tried again when asked again.
        with pytest.raises(ValueError):
            await batcher.submit("bad", b"bad")

    asyncio.run(main())


def test_a_caller_that_leaves_does_not_cancel_the_pass_for_the_others():
    async def main() -> None:
        encode = Recorder()
        encode.release.clear()
        batcher = Batcher(encode, 8, 0.005)
        leaving = asyncio.create_task(batcher.submit("k", b"k"))
        staying = asyncio.create_task(batcher.submit("k", b"k"))
        assert await asyncio.to_thread(encode.entered.wait, 5)
        leaving.cancel()
        encode.release.set()
        assert await staying == "K"
        with pytest.raises(asyncio.CancelledError):
            await leaving

    asyncio.run(main())


@pytest.mark.parametrize(("max_items", "wait_s"), [(0, 0.01), (4, -1)])
def test_nonsense_settings_are_refused(max_items, wait_s):
    with pytest.raises(ValueError):
        Batcher(Recorder(), max_items, wait_s)
