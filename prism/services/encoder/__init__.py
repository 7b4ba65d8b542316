"""The encoder stage: `EncoderService` runs the vision tower and projector in torch, on the
accelerator when there is one (prism.services.encoder.towers).

Items of concurrent requests are encoded together, and an item in flight or met before
is encoded once (prism.services.encoder.batching; an LRU cache keyed by the model, the
bytes and, for a video, how its frames are sampled). Embeddings are published through
the stage's transfer (prism.transfer): with NIXL, copied into memory registered at
start-up and answered as descriptors that the worker pulls from, a slice freed when the
reader's notification arrives or when its lease runs out unread; inline, answered with
the bytes themselves.

servicer.py holds the handler; serving.py starts the stage.
"""
