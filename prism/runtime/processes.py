"""Ending the processes a launcher started, with a deadline on every wait.

A process that does not go within its deadline is reported (pid, state, what the kernel
waits on) and left: a launcher that waits without bound on one stuck process stops
serving, or stopping, everything else. A process the launcher did not start itself (vLLM's
engine core, started by a worker) ends with its parent (`exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

# How long a killed process may take to go before it is reported and left.
REAP_DEADLINE_S = 30.0


def describe(pid: int) -> str:
    """`pid`'s command, scheduler state and kernel wait channel, as /proc tells them."""
    proc = Path(f"/proc/{pid}")
    try:
        # pid (comm) state ppid ...: comm may hold spaces, so split after it.
        stat = (proc / "stat").read_text()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat.rsplit(")", 1)[1].split()[0]
        wchan = (proc / "wchan").read_text().strip() or "-"
    except (OSError, ValueError):
        return f"pid {pid}: gone"
    return f"pid {pid} ({comm}): state {state}, wchan {wchan}"


def kill_group(process: subprocess.Popen) -> None:
    """Kills what is left of a process started in its own group (its children too)."""
    # ProcessLookupError: nothing of that group is left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def reap(
    process: subprocess.Popen, patience: float = 5.0, deadline: float = REAP_DEADLINE_S
) -> bool:
    """Waits for a killed process to be gone; False (and a report) if it is not within
    `deadline` seconds.

    Seen on these machines' kernel: a worker killed while reaping its engine process spun
    in the kernel (wait4 -> release_task -> shrink_dcache_parent) with SIGKILL pending, for
    as long as it was scheduled like its peers; made the lowest of priorities
    (SCHED_IDLE) after `patience` seconds, it let the kernel's own work run and went."""
    try:
        process.wait(timeout=patience)
        return True
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))
    try:
        process.wait(timeout=max(0.0, deadline - patience))
        return True
    except subprocess.TimeoutExpired:
        log.error("left behind after %.0f s: %s", deadline, describe(process.pid))
        return False


def stop(process: subprocess.Popen, grace: float) -> bool:
    """SIGTERM, then `finish`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return finish(process, grace)


def finish(process: subprocess.Popen, grace: float) -> bool:
    """`grace` seconds for a process told to stop to exit, then SIGKILL to its group;
    whether it is gone."""
    try:
        process.wait(timeout=grace)
        gone = True
    except subprocess.TimeoutExpired:
        process.kill()
        gone = reap(process)
    kill_group(process)
    return gone


def exit_reason(code: int) -> str:
    """A process's exit status as people say it: "code 1", "SIGKILL"."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def exit_with_parent(interval: float = 1.0) -> threading.Thread:
    """Kills this process once its parent has gone (it is then adopted, and its parent
    id changes). vLLM's engine core keeps running when the worker that started it is
    killed; if the launcher is killed too before it has killed the worker's group, the
    engine would hold its cores and memory for good.

    A thread that looks every `interval` seconds, not the kernel's parent-death signal:
    that one fires when the parent *thread* that forked ends, which need not be when the
    parent process does."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        log.warning("parent %d has gone; exiting", parent)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="prism-exit-with-parent", daemon=True)
    thread.start()
    return thread


# A file whose existence lets this engine start (prism.ops.launcher starts some engines in
# turn: those that share a GPU, or that compile the same graphs).
START_GATE = "PRISM_START_GATE"


def wait_for_turn(poll_s: float = 0.2) -> None:
    """Waits, where the launcher gave this process a start gate, until the gate opens:
    its imports are done meanwhile, beside the stages it waits for."""
    gate = os.environ.get(START_GATE)
    if gate:
        log.info("waiting for the stages started before this one (%s)", gate)
        while not os.path.exists(gate):
            time.sleep(poll_s)
