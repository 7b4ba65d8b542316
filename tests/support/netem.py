"""A network link with latency and loss, in user space: what `tc netem` does, for kernels
built without sch_netem (this one). Two TAP devices, one for each end of the link, and
this process between them: every Ethernet frame read from one end is dropped with the
loss probability or written to the other end after the delay, in order.

    python tests/support/netem.py HOST_END BRIDGE_END

creates both devices and prints "ready" once they exist; the caller then moves HOST_END
into a host's namespace and puts BRIDGE_END on the bridge. Each line on stdin sets the
impairment of both directions, "DELAY_S LOSS" (e.g. "0.05 0.01"); end of stdin ends the
link (the devices go with this process).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main(host_end: str, bridge_end: str) -> None:
    ends = [tap(host_end), tap(bridge_end)]
    peer = {ends[0]: ends[1], ends[1]: ends[0]}
    # Frames on their way, per destination: (due time, frame), due times in order.
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        fd: collections.deque() for fd in ends
    }
    delay, loss = 0.0, 0.0
    control = sys.stdin.fileno()
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else None
        readable, _, _ = select.select([control, *ends], [], [], timeout)
        if control in readable:
            commands = os.read(control, 4096)
            if not commands:
                return
            delay, loss = (float(x) for x in commands.decode().split()[-2:])
        for fd in ends:
            if fd not in readable:
                continue
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if random.random() >= loss:
                    queues[peer[fd]].append((time.monotonic() + delay, frame))
        now = time.monotonic()
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                # An end that is down (a partition) loses the frame, as a cut cable would.
                with contextlib.suppress(OSError):
                    os.write(fd, queue.popleft()[1])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
