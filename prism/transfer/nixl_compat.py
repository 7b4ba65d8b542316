"""Where Prism reaches past NIXL's public Python API: its agent's progress-thread wake-up.

Everything else of NIXL that Prism uses is public (`prism.transfer`); a NIXL release that
lets `nixl_agent_config` set the wake-up makes this module one call.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# nixl_agent starts UCX's progress thread with a 0 µs poll() timeout, which spins a whole
# core per process even when idle, mostly in the kernel. With a timeout the thread sleeps on
# UCX's event fd and still wakes at once on traffic; the timeout only bounds a missed
# wake-up. The thread is needed: a reader's READ completes only after the owner's UCX
# worker has progressed.
PROGRESS_WAKEUP_US = 10_000


def nixl_agent(name: str, conf: Any = None) -> Any:
    """`nixl.nixl_agent(name, conf)`, alike in all but its progress thread's wake-up.

    Prism's transfer agents are made here, and so are vLLM's (`prism.engine.extension`)."""
    import nixl

    conf = conf or nixl.nixl_agent_config()
    # nixl_agent cannot set the wake-up: build it with no backend and no thread, swap in a
    # core agent built with one, then add the backends as nixl_agent would have.
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
    core = nixl._bindings.nixlAgentConfig()
    core.useProgThread = conf.enable_pthread
    core.useListenThread = conf.enable_listen
    core.listenPort = conf.port
    sync = conf.sync_mode or (
        nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        if conf.enable_listen
        else nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
    )
    core.syncMode = sync.value
    core.pthrDelay = PROGRESS_WAKEUP_US
    core.lthrDelay = 100_000
    core.captureTelemetry = conf.capture_telemetry
    agent.agent = nixl._bindings.nixlAgent(name, core)
    for backend in conf.backends:
        if backend not in agent.plugin_list:
            log.warning("NIXL has no %s plugin; agent %s goes without it", backend, name)
            continue
        init = {"num_threads": str(conf.num_threads)} if conf.num_threads > 0 else {}
        agent.create_backend(backend, init)
    return agent
