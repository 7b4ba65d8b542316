"""Frees a finished prefill's KV blocks on demand, inside vLLM's worker process.

vLLM keeps a prefill's blocks for the decode that reads them, or until the connector's
lease expires; `AsyncLLM.abort` cannot reach a request that has already finished, and
no public call ends a lease early. This mix-in (vLLM's `worker_extension_cls`, called
through `collective_rpc`) ends the lease now, so the connector reports the request as
sent at its next step and the scheduler frees the blocks the usual way.
"""

from __future__ import annotations


class KvRelease:
    def prism_release_kv(self, request_id: str) -> bool:
        """Ends the lease on `request_id`'s blocks; False if the connector holds none yet."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        held = get_kv_transfer_group().connector_worker._reqs_to_send
        if request_id not in held:
            return False
        held[request_id] = 0.0
        return True
