"""Where image URLs may lead. The resolve-and-classify step is tested on private,
link-local and metadata addresses without connecting anywhere (a stand-in resolver
answers); real fetches go to the loopback image server only."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest
from aiohttp.abc import AbstractResolver
from support.content import png
from support.meshes import ALLOWED_HOST

from prism.media.fetch import MediaLoader
from prism.media.image import IMAGE
from prism.media.policy import MediaPolicy
from prism.media.url_guard import Allowance, GuardedResolver, Refused, blocked_reason, check_host
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError


@pytest.mark.parametrize(
    "address,reason",
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("10.1.2.3", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("100.100.100.200", "cloud metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("100.64.0.1", "non-public"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:127.0.0.1", "loopback"),
        ("8.8.8.8", None),
        ("1.1.1.1", None),
        ("2001:4860:4860::8888", None),
    ],
)
def test_addresses_are_classified(address, reason):
    assert blocked_reason(ipaddress.ip_address(address)) == reason


class StandIn(AbstractResolver):
    """Answers every name with fixed addresses, as a DNS server might."""

    def __init__(self, *addresses: str):
        self.addresses = addresses
        self.asked: list[str] = []

    async def resolve(self, host, port=0, family=socket.AF_INET):
        self.asked.append(host)
        return [{"hostname": host, "host": a, "port": port, "family": family, "proto": 0,
                 "flags": socket.AI_NUMERICHOST} for a in self.addresses]  # fmt: skip

    async def close(self):
        pass


def resolve(allow: list[str], host: str, *addresses: str) -> list[str]:
    resolver = GuardedResolver(Allowance(allow), StandIn(*addresses))
    return [r["host"] for r in asyncio.run(resolver.resolve(host, 80))]


def test_names_are_checked_on_every_address_they_resolve_to():
    assert resolve([], "images.example", "93.184.216.34") == ["93.184.216.34"]
    for addresses in (["10.0.0.7"], ["169.254.169.254"], ["93.184.216.34", "192.168.0.2"]):
        with pytest.raises(Refused):
            resolve([], "rebind.example", *addresses)
    # The operator may admit a network, or a name whatever it resolves to.
    assert resolve(["10.0.0.0/8"], "intranet.example", "10.0.0.7") == ["10.0.0.7"]
    with pytest.raises(Refused):
        resolve(["10.0.0.0/8"], "intranet.example", "10.0.0.7", "172.16.0.1")
    assert resolve(["Intranet.Example"], "intranet.example.", "172.16.0.1") == ["172.16.0.1"]


def test_ip_literals_are_checked_without_a_resolver():
    check_host("93.184.216.34", Allowance())
    for host in ("127.0.0.1", "[::1]", "169.254.169.254", "[::ffff:192.168.0.1]"):
        with pytest.raises(Refused):
            check_host(host, Allowance())
    check_host("127.0.0.1", Allowance(["127.0.0.0/8"]))
    check_host("example.com", Allowance())  # a name: left to the resolver


def fetch(url: str, **policy) -> bytes:
    async def run() -> bytes:
        loader = MediaLoader(MediaPolicy(**policy))
        try:
            return (await loader.load(IMAGE, common_pb2.Image(url=url), "image_url")).data
        finally:
            await loader.close()

    return asyncio.run(run())


def test_loopback_fetches_are_refused_unless_allowed(image_server):
    url = image_server("/guard/real.png", png(8))
    by_ip = url.replace(ALLOWED_HOST, "127.0.0.1")
    for target in (url, by_ip, by_ip.replace("127.0.0.1", "[::1]")):
        with pytest.raises(PrismError) as info:
            fetch(target)
        assert info.value.reason_name == "URL_REFUSED" and info.value.http_status == 400
        assert "loopback" in info.value.message and info.value.param == "image_url"
    assert fetch(url, fetch_allow=(ALLOWED_HOST,)) == png(8)
    assert fetch(by_ip, fetch_allow=("127.0.0.1/32",)) == png(8)


def test_every_redirect_is_checked_and_counted(image_server):
    target = image_server("/guard/target.png", png(9))
    by_ip = target.replace(ALLOWED_HOST, "127.0.0.1")
    hop = image_server("/guard/hop", location=target)
    assert fetch(hop, fetch_allow=(ALLOWED_HOST,)) == png(9)
    # An allowed host that redirects to a barred address is refused at the redirect.
    sneaky = image_server("/guard/sneaky", location=by_ip)
    with pytest.raises(PrismError) as info:
        fetch(sneaky, fetch_allow=(ALLOWED_HOST,))
    assert info.value.reason_name == "URL_REFUSED"
    loop = image_server("/guard/loop", location="/guard/loop")
    with pytest.raises(PrismError, match="more than 3 redirects"):
        fetch(loop, fetch_allow=(ALLOWED_HOST,))
    with pytest.raises(PrismError, match="not an http"):
        fetch(image_server("/guard/to-file", location="file:///etc/passwd"),
              fetch_allow=(ALLOWED_HOST,))  # fmt: skip
