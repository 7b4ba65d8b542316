"""The planner: sets the replicas of each role (encoders, prefills, decodes, aggregated
workers) apart, against goals for the time to first token and between tokens.

Every interval it reads the fronts' metrics (prism.planner.observe), decides
(prism.planner.decide: pure, so that its rules are tested without a mesh) and asks its
backend for the replica counts decided. Backends: `local`, the stage processes `prism
serve` runs (prism.ops.scaling, beside the launcher: the planner imports nothing of
prism.ops), and `kubernetes`, each role's Deployment through its `scale` subresource
(prism.planner.kubernetes). A replica leaves by draining, as on any SIGTERM: it stops
taking calls, finishes those it has, then exits; registries see replicas come and go as
they do today.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit


class Backend(Protocol):
    def replicas(self, role: str) -> int:
        """Replicas of `role` running now (started and not yet stopping)."""
        ...

    def scale(self, role: str, count: int) -> None:
        """Asks for `count` replicas of `role`; they come and go in the background."""
        ...


def open_backend(url: str) -> Backend:
    """The backend `url` names: `kubernetes:///PREFIX` in a pod, or
    `kubernetes+http://HOST:PORT/PREFIX` through `kubectl proxy`. (`prism serve`'s own
    processes are the local backend, which the launcher makes.)"""
    parts = urlsplit(url)
    if parts.scheme in ("kubernetes", "kubernetes+http"):
        from prism.planner.kubernetes import KubernetesBackend

        return KubernetesBackend.from_url(parts)
    raise ValueError(
        f"--backend must be kubernetes:///PREFIX or kubernetes+http://HOST:PORT/PREFIX, got {url!r}"
    )
