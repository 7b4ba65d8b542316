"""vLLM's own prefill/decode split, as a benchmark anchor: a proxy in front of two
`vllm serve` engines with the NixlConnector, speaking the protocol of vLLM's
`toy_proxy_server.py` (not installed with vLLM, hence this one).

    .venv/bin/python -m bench.pd_proxy --port P --prefill URL --decode URL

Each chat or completion request goes to prefill as a copy that asks for one token, not
streamed, with `kv_transfer_params: {"do_remote_decode": true}`; then the original goes
to decode with the `kv_transfer_params` prefill answered, and decode's answer (streamed
or not) is the client's.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

# What a prefill request must not carry: it answers one token, whole.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens")


def prefill_body(body: dict) -> dict:
    prefill = {key: value for key, value in body.items() if key not in _NOT_FOR_PREFILL}
    prefill.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return prefill


class Proxy:
    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        # No connection cap: the client's concurrency is the load.
        connector = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=600)
        )

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.json()
        path = request.path
        async with self.session.post(self.prefill + path, json=prefill_body(body)) as reply:
            if reply.status != 200:
                return web.Response(status=reply.status, body=await reply.read(),
                                    content_type="application/json")  # fmt: skip
            prefilled = await reply.json()
        body["kv_transfer_params"] = prefilled.get("kv_transfer_params")
        async with self.session.post(self.decode + path, json=body) as reply:
            response = web.StreamResponse(status=reply.status)
            response.content_type = reply.content_type
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for base in (self.prefill, self.decode):
            try:
                async with self.session.get(base + "/health") as reply:
                    if reply.status != 200:
                        return web.Response(status=503)
            except aiohttp.ClientError:
                return web.Response(status=503)
        return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="base URL of the prefill engine")
    parser.add_argument("--decode", required=True, help="base URL of the decode engine")
    args = parser.parse_args()
    proxy = Proxy(args.prefill, args.decode)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_get("/health", proxy.health)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
