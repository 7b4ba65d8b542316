"""A mesh started with `--tls-cert`, `--tls-key` and `--tls-ca` serves end to end, every
stage calling the next over mutual TLS; a peer whose certificate another CA signed, or one
without a certificate, is refused by every stage. Simulated engines: what is checked here is
the stages' channels, not the model."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cases import openai_client
from support.certs import write_certificates
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh

from prism.rpc.channel import check_health
from prism.rpc.tls import Tls, configure_tls


def tls_from(paths: dict[str, str]) -> Tls:
    return Tls(*(Path(paths[name]).read_bytes() for name in ("tls_cert", "tls_key", "tls_ca")))


@pytest.fixture(scope="module")
def tls_mesh(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    paths = write_certificates(tmp / "mesh", "prism-mesh-ca")
    # The launcher checks its stages' health over the same mutual TLS, as `prism serve` does.
    configure_tls(tls_from(paths))
    running = start_mesh("llava", "e/p/d", models["llava"], tmp, engine="sim", **paths)
    yield running, paths, tmp
    running.stop()
    configure_tls(None)


def test_every_stage_calls_the_next_over_mutual_tls(tls_mesh):
    mesh, _, _ = tls_mesh
    client = openai_client(mesh)
    reply = client.chat.completions.create(
        model=mesh.model, messages=user(image_part(data_url(png(9))), "What is it?"),
        max_tokens=4, temperature=0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


def test_a_peer_without_the_meshs_ca_is_refused_by_every_stage(tls_mesh):
    mesh, paths, tmp = tls_mesh
    stages = [s for s in mesh.mesh.stages if s.address and not s.address.endswith(":0")]
    assert {s.name.split("-")[0] for s in stages} >= {"encoder", "prefill", "decode"}
    configure_tls(None)
    assert not any(check_health(s.address) for s in stages), "plaintext was let in"
    configure_tls(tls_from(write_certificates(tmp / "other", "another-ca")))
    assert not any(check_health(s.address) for s in stages), "another CA's peer was let in"
    configure_tls(tls_from(paths))
    assert all(check_health(s.address) for s in stages)
