"""The stage runtime, on prism.rpc's plumbing: `service` serves one handler per RPC in its
plain and batched forms, `stage` starts a stage and drains it, `clients` calls the stages
a stage calls."""
