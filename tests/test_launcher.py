"""The launcher's plan: which stages a mode runs and how they are wired (no processes)."""

from __future__ import annotations

import os

import pytest

from prism.launcher import MeshConfig, _ephemeral_ports, free_port, plan


def flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


@pytest.mark.parametrize("mode,prefill_role", [("e/p/d", "prefill"), ("ep/d", "encode_prefill")])
def test_disaggregated_modes_wire_prefill_and_decode(mode, prefill_role):
    stages = plan(MeshConfig(mode=mode, model="m", prefill_workers=2, decode_workers=1))
    names = [stage.name for stage in stages]
    encoders = ["encoder-0"] if mode == "e/p/d" else []
    assert names == [*encoders, "prefill-0", "prefill-1", "decode-0", "processor", "gateway"]
    by_name = {stage.name: stage for stage in stages}
    assert flag(by_name["prefill-1"].argv, "--role") == [prefill_role]
    assert flag(by_name["decode-0"].argv, "--role") == ["decode"]
    engines = [by_name[n] for n in ("prefill-0", "prefill-1", "decode-0")]
    kv_ports = [flag(stage.argv, "--kv-port")[0] for stage in engines]
    assert len(set(kv_ports)) == 3
    peers = flag(by_name["processor"].argv, "--peer")
    assert sorted(peer.split("=")[0] for peer in peers) == sorted(
        [*(["encoder"] if encoders else []), "prefill", "prefill", "decode"]
    )
    assert f"decode={by_name['decode-0'].address}" in peers
    assert flag(by_name["processor"].argv, "--mode") == [mode]


def test_engines_get_disjoint_cores():
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        pytest.skip("the caller chose the cores")
    stages = plan(MeshConfig(mode="ep/d", model="m"))
    prefill, decode = (s for s in stages if s.name in ("prefill-0", "decode-0"))
    assert prefill.cpus and decode.cpus
    if len(os.sched_getaffinity(0)) >= 2:
        assert not prefill.cpus & decode.cpus
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(prefill.cpus)))


def test_free_ports_avoid_the_ephemeral_range():
    ephemeral = _ephemeral_ports()
    assert all(free_port() not in ephemeral for _ in range(20))
