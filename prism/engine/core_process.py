"""The CPU engine core, forked from its worker instead of spawned.

vLLM spawns the engine core on its CPU platform, and the new process imports vLLM and torch
again before it does anything: on a small model, most of an engine's start. Forked, it has
them already. A spawned core's OpenMP runtime reads its thread count and its cores from the
environment as it loads; a forked one inherits the worker's runtime, already loaded, so it is
given the same settings as it begins."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import torch
from vllm.utils.ompmultiprocessing import OMPProcessManager
from vllm.utils.system_utils import set_env_var

_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"

# What the next forked child is to take: (OpenMP threads, cores), set only around the fork
# of the engine core; any other fork in the worker finds None.
_pending: tuple[int | None, list[int] | None] | None = None


def _in_child() -> None:
    global _pending
    if _pending is None:
        return
    threads, cores = _pending
    _pending = None
    # The worker's event loop may listen for signals through this descriptor: a signal
    # meant for the core would otherwise reach the worker as its own.
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    if cores:
        os.sched_setaffinity(0, cores)
    if threads:
        torch.set_num_threads(threads)


os.register_at_fork(after_in_child=_in_child)


@contextlib.contextmanager
def forked_core(omp: OMPProcessManager) -> Iterator[None]:
    """While inside, vLLM forks the engine core, with the OpenMP settings `omp` would give
    a spawned one: as many threads as its first core list, bound to those cores unless vLLM
    binds automatically (`auto` keeps a core for a scheduler process that here runs the
    model, so its threads stay unbound) or not at all (`nobind`)."""
    global _pending
    if omp.skip_setup:
        threads, cores = None, None
    else:
        cores = list(omp.cpu_lists[0])
        threads = len(cores)
        if omp.auto_setup:
            cores = None
    _pending = (threads, cores)
    # vLLM's CPU platform asks for spawn when it builds the engine's config, before this.
    environment = {_METHOD: "fork"}
    if threads:
        # For the processes the core starts in turn (Inductor's compile workers).
        environment["OMP_NUM_THREADS"] = str(threads)
    try:
        with contextlib.ExitStack() as stack:
            for name, value in environment.items():
                stack.enter_context(set_env_var(name, value))
            yield
    finally:
        _pending = None
