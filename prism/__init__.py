"""Prism: a gRPC service mesh that serves multimodal LLMs stage by stage."""

import os
from importlib import metadata

# gRPC core's fork handlers, on by default, run at every fork() in the process (vLLM's
# engine and compiler processes, subprocesses) and can close or garble connections in
# flight in the parent. Prism never uses gRPC in a forked child, so they only do harm.
# This must be set before grpc is first imported, hence here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

try:
    __version__ = metadata.version("prism-mesh")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "unknown"
