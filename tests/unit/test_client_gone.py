"""A client that disconnects before its answer is written, or while it streams, ends what
the answer waits for (the processor's call: its generation), and only that ends the request
quietly; one watch follows the client from the request to the stream's end."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.responses import JSONResponse

from prism.gateway.streaming import ClientWatch, EventStream, unless_gone


class Client:
    """An ASGI receive past the body: http.disconnect once `leave` is called."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    def leave(self) -> None:
        self.left.set()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}


def test_a_client_gone_ends_the_answer_it_waited_for_with_a_499():
    ended: list[bool] = []

    async def answer() -> JSONResponse:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(True)
        raise AssertionError("never answered")

    async def run() -> None:
        client = Client()
        asyncio.get_running_loop().call_later(0.01, client.leave)
        response = await unless_gone(client.receive, answer())
        assert response.status_code == 499

    asyncio.run(run())
    assert ended == [True]


def test_a_client_still_there_gets_the_answer_and_the_watch_ends():
    async def run() -> None:
        client = Client()
        response = await unless_gone(client.receive, asyncio.sleep(0.01, JSONResponse({})))
        assert response.status_code == 200
        # Gone after its answer: nothing is cancelled.
        client.leave()
        await asyncio.sleep(0.01)

    asyncio.run(run())


def test_a_cancel_from_elsewhere_is_not_taken_for_the_client():
    async def run() -> None:
        client = Client()
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.01, task.cancel)
        await unless_gone(client.receive, asyncio.sleep(10))

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())


def test_an_event_stream_takes_the_watch_on_and_a_client_gone_mid_stream_ends_it(monkeypatch):
    """One watch on the client from the request to the stream's end: no second task."""
    watches: list[ClientWatch] = []
    init = ClientWatch.__init__

    def counted(self: ClientWatch, receive) -> None:
        init(self, receive)
        watches.append(self)

    monkeypatch.setattr(ClientWatch, "__init__", counted)
    closed: list[bool] = []
    sent: list[dict] = []

    async def chunks():
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()  # a generation that would go on for nobody
            yield b"never"
        finally:
            closed.append(True)

    async def run() -> None:
        client = Client()
        response = await unless_gone(client.receive, asyncio.sleep(0, EventStream(chunks())))

        async def send(message: dict) -> None:
            sent.append(message)
            if len(sent) == 2:
                asyncio.get_running_loop().call_later(0.01, client.leave)

        await response({}, client.receive, send)

    asyncio.run(run())
    assert len(watches) == 1
    assert [m.get("body") for m in sent] == [None, b"data: first\n\n"]
    assert closed == [True]
