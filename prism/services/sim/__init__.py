"""`prism worker --engine sim`: `EngineService` (and `KvEventsService`) on the simulated
engine of prism.services.sim.engine: no model, no vLLM, up in a second.

Each role behaves as a vLLM worker's does, where a processor sees it: prompts expand
each image or video placeholder to its tokens (an embedding's rows, or
`--sim-media-tokens` for a file), usage counts cached prompt tokens, prefill roles hold
the prompt's blocks for a decode under a lease and hand on KV transfer parameters that
name this server, and a decode "reads" them at `--sim-kv-tokens-per-s` and then frees
them with prefill's `Abort`, as a NIXL read's notification does. Media bytes and
embeddings are not read: the mesh in front of the engine is what a simulation measures.
"""
