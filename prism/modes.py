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

# The registry role each worker role serves under.
MESH_ROLE = {
    "aggregated": "worker",
    "prefill": "prefill",
    "encode_prefill": "prefill",
    "decode": "decode",
}


def modes_served(worker_role: str = "", enable_mm_embeds: bool = False) -> tuple[str, ...]:
    """The modes a worker (or, without a worker role, an encoder) can take part in."""
    if not worker_role:
        return tuple(mode for mode, roles in ROLES.items() if "encoder" in roles)
    if worker_role == "aggregated":
        # Precomputed embeddings are accepted beside images, not instead of them.
        return ("epd", "e/pd") if enable_mm_embeds else ("epd",)
    return tuple(mode for mode, role in PREFILL_ROLE.items() if worker_role in (role, "decode"))
