"""Forks leave gRPC alone in any process that imports prism first (a real process that
forks beside calls in flight)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

FORKING = textwrap.dedent("""
    import os, threading
    from concurrent import futures

    import prism
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    check = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}")).Check
    done = threading.Event()

    def calls():
        while not done.is_set():
            check(health_pb2.HealthCheckRequest(), timeout=10)

    threads = [threading.Thread(target=calls) for _ in range(3)]
    for thread in threads:
        thread.start()
    for _ in range(50):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    done.set()
    for thread in threads:
        thread.join()
    server.stop(None)
""")


def test_forks_beside_calls_in_flight_leave_grpc_alone():
    """gRPC's fork handlers are off in any process that imports prism first: with them on,
    forks beside calls in flight log from fork_posix.cc and can break connections."""
    env = {**os.environ, "GRPC_VERBOSITY": "INFO"}
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    done = subprocess.run([sys.executable, "-c", FORKING], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "fork_posix" not in done.stderr, done.stderr
