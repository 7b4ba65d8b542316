"""The contract lane's own fixture: a NIXL agent in the test process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def reader():
    """A NIXL transfer agent in this process, the reading side of transfer tests."""
    from prism.transfer.nixl import NixlTransfer

    with NixlTransfer(pool_bytes=64 * 2**20) as agent:
        yield agent
