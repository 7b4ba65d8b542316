"""Prism's code inside vLLM's engine process (vLLM's `worker_extension_cls`), for the
workers whose engine has a NIXL KV connector.

Importing this module (vLLM does, when it builds the engine's worker, before the KV
connector exists) gives that connector a NIXL agent whose progress thread sleeps while
idle: NIXL's Python agent hard-codes a 0 µs wake-up, and vLLM has no setting for it, so
every prefill and decode engine spun a core (`prism.transfer.nixl_agent`).

`prism_release_kv` frees a finished prefill's KV blocks on demand. vLLM keeps them for
the decode that reads them, or until the connector's lease expires; `AsyncLLM.abort`
cannot reach a request that has already finished, and no public call ends a lease early.
Called through `collective_rpc`, it ends the lease now, so the connector reports the
request as sent at its next step and the scheduler frees the blocks the usual way.
"""

from __future__ import annotations

from typing import Literal

from vllm.distributed import nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

from prism.transfer import nixl_agent

# The connector's worker reads this module global when it starts; the engine process may
# have imported it (binding vLLM's own agent) before this module, hence both.
nixl_utils.NixlWrapper = base_worker.NixlWrapper = nixl_agent

Release = Literal["released", "pending", "gone"]


class EngineExtension:
    def prism_release_kv(self, request_id: str) -> Release:
        """Ends the lease on `request_id`'s blocks: "released"; "pending" if the connector
        has not yet learned that the request finished; "gone" if it holds nothing for it
        any more (a decode read the blocks, or the lease ended)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group().connector_worker
        if request_id in connector._reqs_to_send:
            connector._reqs_to_send[request_id] = 0.0
            return "released"
        # The connector tracks a request from the step that schedules it until its
        # blocks are read or expire.
        return "pending" if request_id in connector._reqs_to_process else "gone"
