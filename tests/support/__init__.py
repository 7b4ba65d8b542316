"""Helpers that the test lanes share: doubles of outside services (Consul, the Kubernetes
API), simulated hosts and links, the offline-vLLM oracle and the `vllm serve` reference,
request content, and waiting. Importable as `support` (tests/ is on the path: pytest puts
the directory of tests/conftest.py there); some also run as scripts in a process of their
own (oracle.py, netem.py, transfer_owner.py)."""
