"""gRPC plumbing shared by every process, one job a module: the error model (`errors`),
the options servers and channels share (`options`), TLS (`tls`), servers (`server`),
channels and health checks (`channel`), and batched streams (`multiplex`). The stage
runtime builds on it: `prism.runtime.service` (one handler per RPC, every per-call
concern) and `prism.runtime.stage` (start-up and drain).
"""
