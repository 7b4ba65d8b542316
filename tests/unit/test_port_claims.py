"""A mesh's doors are claimed before its fronts bind them: a second mesh that checks the
same address in between (when the first has not bound it yet) is refused all the same."""

from __future__ import annotations

import os
import socket

import pytest

from prism.rpc.ports import PortInUse, claim
from prism.runtime.ports import free_port


def test_a_claimed_port_is_refused_to_a_second_claim_until_released():
    port = free_port()
    first = claim("HTTP", "127.0.0.1", port)
    assert first is not None
    # Nothing listens yet: only the claim stands in the way.
    with pytest.raises(PortInUse, match=f"HTTP port {port} on 127.0.0.1 is in use"):
        claim("HTTP", "127.0.0.1", port)
    os.close(first)
    again = claim("HTTP", "127.0.0.1", port)
    assert again is not None
    os.close(again)


def test_a_port_another_process_listens_on_is_refused_unclaimed():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(PortInUse):
            claim("gRPC API", "127.0.0.1", port)


def test_port_zero_is_never_claimed():
    assert claim("KServe gRPC", "127.0.0.1", 0) is None
