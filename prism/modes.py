"""The deployment modes: the registry roles a request passes through after the processor.

`worker` is an aggregated worker; in the disaggregated modes `prefill` is a worker in the
`prefill` role (E/P/D: images arrive as embeddings) or `encode_prefill` role (EP/D: it
encodes the images itself), and `decode` continues from the prefill's KV cache.
"""

ROLES = {
    "epd": ("worker",),
    "e/pd": ("encoder", "worker"),
    "e/p/d": ("encoder", "prefill", "decode"),
    "ep/d": ("prefill", "decode"),
}
MODES = tuple(ROLES)

# The worker roles of `prism worker --role`, and the one each mode's prefill step needs.
WORKER_ROLES = ("aggregated", "prefill", "decode", "encode_prefill")
PREFILL_ROLE = {"e/p/d": "prefill", "ep/d": "encode_prefill"}
