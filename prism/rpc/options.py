"""The gRPC options every server and channel of the mesh is made with: message limits,
keepalive and reconnect backoff, chosen together since each side must accept what the
other sends."""

# Images travel inside requests to the processor and worker: raise gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ERROR_DOMAIN = "prism.v1"

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer cut off by the network sends nothing, not even a reset: a stream to it would
    # wait forever. A ping unanswered 5 s after it went out, every 10 s, ends the
    # connection (UNAVAILABLE), and its requests move to another replica. gRPC core
    # answers pings, not the busy event loop.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default backoff grows to minutes: a replica that came up (or back) after a
    # peer's first try would stay unreachable from that peer for as long. (Not
    # grpc.min_reconnect_backoff_ms: it is also the connect timeout, 20 s by default.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Servers accept the keepalive pings their clients send. By default a server takes a ping
# more often than every 5 minutes on an idle connection as abuse and, at the third, drops
# the connection with GOAWAY "too_many_pings": every idle channel was cut every 90 s.
# Half the clients' interval, so that a ping sent a little early is no abuse either.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 5_000)]
