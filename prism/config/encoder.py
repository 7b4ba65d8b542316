"""The encoder's settings: where its vision path runs, its pools and batches."""

from __future__ import annotations

from dataclasses import dataclass

from prism.config.flags import Flags, flag


@dataclass
class EncoderConfig(Flags):
    """`prism encoder`'s own flags."""

    pool_mib: int = flag(256, "NIXL embedding pool (MiB)")
    cache_mib: int = flag(256, "embedding cache (MiB)")
    device: str = flag(
        "auto",
        "where the vision path runs and its embeddings are published: cpu, cuda, "
        "cuda:N (auto: the accelerator when there is one)",
    )
    dtype: str = flag(
        "auto",
        "the vision path's dtype (auto: float32 on CPU, as the CPU engine; else the "
        "checkpoint's 16-bit dtype)",
    )
    batch_size: int = flag(
        32, "most items (images, or videos) of concurrent requests encoded in one pass"
    )
    batch_wait_ms: float = flag(2.0, "how long an item waits for others to share its forward pass")
    lease_s: float = flag(30.0, "free unread embeddings after this long")
