"""What the test lanes share: their fixtures (fixtures.py, a plugin), the parity cases and
the offline-vLLM oracle (cases.py, oracle.py), meshes as the tests start them (meshes.py),
`vllm serve` as the reference (parity.py), doubles of outside services (Consul, the
Kubernetes API), simulated hosts and links, request content, and waiting. Importable as
`support` (tests/ is on the path: pytest puts the directory of tests/conftest.py there);
some also run as scripts in a process of their own (oracle.py, netem.py,
transfer_owner.py)."""
