"""Frees a finished prefill's KV blocks on demand, inside vLLM's worker process.

vLLM keeps a prefill's blocks for the decode that reads them, or until the connector's
lease expires; `AsyncLLM.abort` cannot reach a request that has already finished, and
no public call ends a lease early. This mix-in (vLLM's `worker_extension_cls`, called
through `collective_rpc`) ends the lease now, so the connector reports the request as
sent at its next step and the scheduler frees the blocks the usual way.
"""

from __future__ import annotations

from typing import Literal

Release = Literal["released", "pending", "gone"]


class KvRelease:
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
