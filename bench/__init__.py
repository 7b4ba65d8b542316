"""Prism's benchmarks: each script here is run from the repository root as
`python -m bench.<name>` (the Makefile's bench targets); what they share is bench.lib."""
